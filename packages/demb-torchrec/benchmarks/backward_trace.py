"""A CPU-only profiler timeline of one table-module backward on the reference workload (Adam,
NONE; no CUDA activity recorded, so no CUPTI cost on the launches): each op's start from the
step's start and its duration, per thread, for default threading and for the calling thread;
then the op totals. The profiler adds its own cost to every op: compare threads and ops, not
absolute times.

Usage: ``python backward_trace.py OUT_DIR`` (after ``source .device/setup.sh`` on the H200). A
tidied copy of the scratch script that ran for ``results/backward_trace_h200.txt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload
from torch.profiler import ProfilerActivity, profile, record_function


def main(out_dir: Path) -> None:
    module, batches, grad = ready(Workload(), torch.device("cuda"))

    def step(i: int, caller: bool) -> None:
        module.train()
        out = module(*batches[i % len(batches)])
        torch.cuda.synchronize()
        with torch.autograd.set_multithreading_enabled(not caller):
            with record_function("BWD"):
                torch.autograd.backward([out], [grad])
            torch.cuda.synchronize()

    for caller in (False, True):
        mode = "caller" if caller else "default"
        for i in range(8):
            step(i, caller)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for i in range(3):
                step(i, caller)
        path = out_dir / f"trace_{mode}.json"
        prof.export_chrome_trace(str(path))
        events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
        bwd = max((e for e in events if e["name"] == "BWD"), key=lambda e: e["ts"])
        t0, t1 = bwd["ts"], bwd["ts"] + bwd["dur"]
        print(f"== {mode}: BWD {bwd['dur']:.1f} us")
        for e in sorted(events, key=lambda e: e["ts"]):
            if t0 <= e["ts"] <= t1 and e["dur"] >= 0.5:
                print(f"  {e['ts'] - t0:8.1f} +{e['dur']:8.1f}  tid {e['tid']}  {e['name'][:90]}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
