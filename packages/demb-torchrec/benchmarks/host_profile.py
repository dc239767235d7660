"""Python-level host time of a table-module step on the reference workload (Adam, NONE):
cProfile over the training forward, the backward's update (profiled in the autograd thread
that runs it) and the eval forward, each printed as the functions with the most self time per
step. A function that waits for the GPU (``tolist``, ``item``, ``__bool__``) shows that wait as
its self time. CUDA only.

Usage: ``python host_profile.py [--steps 20] [--top 25]`` (after ``source .device/setup.sh`` on
the H200).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats

import demb_torchrec._autograd as ag
import torch
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload


def report(name: str, prof: cProfile.Profile, steps: int, top: int) -> None:
    """Print the ``top`` functions by self time, in microseconds per step."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, func), (_, calls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{file.rsplit('/', 2)[-1]}:{line}" if line else file
        rows.append((tottime, cumtime, calls, f"{func} ({where})"))
    total = sum(r[0] for r in rows)
    print(f"== {name}: {total / steps * 1e6:.0f} us self time per step")
    for tottime, cumtime, calls, label in sorted(rows, reverse=True)[:top]:
        print(
            f"  {tottime / steps * 1e6:7.1f} self {cumtime / steps * 1e6:7.1f} cum "
            f"{calls / steps:5.1f}x  {label[:110]}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    dev = torch.device("cuda")
    w = Workload()
    m, batches, grad = ready(w, dev)
    fwd, bwd, ev = cProfile.Profile(), cProfile.Profile(), cProfile.Profile()
    update = ag.TrainStep.update
    active = [False]

    @functools.wraps(update)
    def profiled_update(self: ag.TrainStep, grads: object) -> None:
        if not active[0]:
            update(self, grads)  # type: ignore[arg-type]
            return
        bwd.enable()  # the autograd thread running this backward
        try:
            update(self, grads)  # type: ignore[arg-type]
        finally:
            bwd.disable()

    ag.TrainStep.update = profiled_update  # type: ignore[method-assign]
    sync = torch.cuda.synchronize
    for i in range(5 + args.steps):
        active[0] = i >= 5
        b = batches[i % 4]
        m.train()
        sync()
        if active[0]:
            fwd.enable()
        out = m(*b)
        if active[0]:
            fwd.disable()
        sync()
        torch.autograd.backward([out], [grad])
        sync()
        m.eval()
        with torch.no_grad():
            if active[0]:
                ev.enable()
            m(*b)
            if active[0]:
                ev.disable()
            sync()
    for name, prof in (("train forward", fwd), ("backward update", bwd), ("eval forward", ev)):
        report(name, prof, args.steps, args.top)


if __name__ == "__main__":
    main()
