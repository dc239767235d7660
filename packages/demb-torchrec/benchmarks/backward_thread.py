"""The reference workload (Adam, NONE) timed as ``demb bench module`` times it (``time_demb``),
in one of three host set-ups, given as the argument: ``default``; ``caller-thread`` (every
``torch.autograd.backward`` under ``torch.autograd.set_multithreading_enabled(False)``: the
backward runs on the calling thread, not on autograd's CUDA device thread); ``one-core`` (the
process, and so every thread it starts, on one CPU core).

Usage: ``python backward_thread.py MODE`` (after ``source .device/setup.sh`` on the H200);
``results/backward_thread_h200.txt`` ran the modes in turn, twice. A tidied copy of the
scratch script that ran.
"""

from __future__ import annotations

import os
import sys

import torch
from demb_torchrec.bench.module_bench import time_demb
from demb_torchrec.bench.workload import Workload


def main(mode: str) -> None:
    if mode == "caller-thread":
        orig = torch.autograd.backward

        def backward(*a: object, **k: object) -> None:
            with torch.autograd.set_multithreading_enabled(False):
                orig(*a, **k)

        torch.autograd.backward = backward  # type: ignore[assignment]
    elif mode == "one-core":
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[2]})
    elif mode != "default":
        raise SystemExit(f"mode: {mode!r}; one of default, caller-thread, one-core")
    r = time_demb(Workload(), torch.device("cuda"), steps=20, warmup=5)
    print(
        f"{mode:14s} fwd {r['forward_ms']:.3f} bwd {r['backward_ms']:.3f} "
        f"train {r['train_ms']:.3f} eval {r['eval_ms']:.3f} eval loop {r['eval_loop_ms']:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main(sys.argv[1])
