"""Why the first eval forward after a training step is slower than a second one: the reference
workload (Adam, NONE), one training step (forward, backward) then two eval forwards of the same
batch, under variants of what comes between and of how the eval is called. Prints, per variant,
the medians (20 steps after 5) of the wall time, the host's time to return and the GPU span (an
event before the call to one after it); then, under torch.profiler, each eval's kernel times in
order (first, second, first, ...).

Variants: no backward; a tiny kernel and a sync, a 2 ms sleep, a 2 ms busy spin or gc.collect()
between; the table op called directly with and without its batch checks; another batch;
``check_gradients=False``; no training at all; every thread of the process on one CPU core.

Usage: ``python eval_wakeup.py`` (after ``source .device/setup.sh`` on the H200). A tidied
merge of the two scratch scripts whose output is ``results/eval_wakeup_h200.txt``.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable

import torch
from demb_kernels.table import lookup_batch_rows
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload, timed
from torch.profiler import ProfilerActivity, profile

Batch = tuple[torch.Tensor, torch.Tensor]
DEV = torch.device("cuda")
module, batches, grad = ready(Workload(), DEV)


def one_eval(batch: Batch, check: bool | None) -> tuple[float, float, float]:
    """(wall, host, GPU span) us of one eval: the module's forward (``check`` None) or the table
    op with or without its checks."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    if check is None:
        module(*batch)
    else:
        indices, offsets = batch
        b = (offsets.numel() - 1) // len(module.feature_table_map)
        ftab = module._feature_tables
        values = module.tables.values
        index = module.tables.index
        lookup_batch_rows(index, values, indices, offsets, ftab, b, module.dims[0], check=check)
    end.record()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6, (t1 - t0) * 1e6, start.elapsed_time(end) * 1e3


def train(batch: Batch, backward: bool = True) -> list[torch.Tensor]:
    module.train()
    box: list[torch.Tensor] = []
    timed(lambda: box.append(module(*batch)), DEV)
    if backward:
        timed(lambda: torch.autograd.backward([box[0]], [grad]), DEV)
    return box


def loop(
    label: str,
    pre: Callable[[], object] | None = None,
    check: bool | None = None,
    backward: bool = True,
    other_batch: bool = False,
    do_train: bool = True,
) -> None:
    rows: dict[str, list[tuple[float, float, float]]] = {"first": [], "second": []}
    for i in range(25):
        b = batches[i % len(batches)]
        keep = train(b, backward) if do_train else None
        if pre:
            pre()
        module.eval()
        eb = batches[(i + 1) % len(batches)] if other_batch else b
        with torch.no_grad():
            first, second = one_eval(eb, check), one_eval(eb, check)
        del keep
        if i >= 5:
            rows["first"].append(first)
            rows["second"].append(second)
    for name, got in rows.items():
        w, h, sp = (statistics.median(x[j] for x in got) for j in range(3))
        print(
            f"{label:34s} {name:6s} wall {w:6.1f} us  host {h:6.1f} us  gpu span {sp:6.1f} us",
            flush=True,
        )


def tiny() -> None:
    torch.ones(1, device=DEV).add_(1)
    torch.cuda.synchronize()


def sleep2() -> None:
    time.sleep(0.002)


def spin2() -> None:
    t = time.perf_counter()
    while time.perf_counter() - t < 0.002:
        pass


def on_cores(cores: set[int]) -> None:
    """Every thread of this process on ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cores)


def kernel_times() -> None:
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for i in range(6):
            b = batches[i % len(batches)]
            keep = train(b)
            module.eval()
            with torch.no_grad():
                one_eval(b, None)
                one_eval(b, None)
            del keep
    found: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ("find_rows" in ev.name or "index_tables" in ev.name):
            key = "find_rows" if "find_rows" in ev.name else "index_tables"
            found.setdefault(key, []).append(round(ev.device_time_total, 1))
    for k, v in found.items():
        print("kernel", k, "us in order (first, second, ...):", v)


def main() -> None:
    loop("A module eval after train")
    loop("B module eval after fwd only", backward=False)
    loop("C tiny kernel+sync after train", pre=tiny)
    loop("D op check=True after train", check=True)
    loop("D2 op check=False after train", check=False)
    loop("G gc.collect after train", pre=gc.collect)
    loop("H other batch after train", other_batch=True)
    module.check_gradients = False
    loop("E check_gradients=False")
    module.check_gradients = True
    loop("Z no train", do_train=False)
    loop("B2 fwd only + 2 ms sleep", backward=False, pre=sleep2)
    loop("A2 train + 2 ms spin", pre=spin2)
    loop("A5 train + 2 ms sleep", pre=sleep2)
    cores = sorted(os.sched_getaffinity(0))
    on_cores({cores[2]})
    loop("A3 train, process on one core")
    loop("B3 fwd only, process on one core", backward=False)
    on_cores(set(cores))
    kernel_times()


if __name__ == "__main__":
    main()
