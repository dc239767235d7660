"""Where a table-module backward's wall time goes before its GPU work, on the reference workload
(Adam, NONE): host and GPU stamps of ``torch.autograd.backward``, default threading and on the
calling thread, with and without a tensor hook on the output (the hook runs on the engine's
thread just before the module's node: its host stamp and an event it records tell when the
engine reached the node, and the GPU time from that event to the end is the node's work, its
host calls before the first launch included). Also a trivial backward of the same shape
(``x * 1``) for the engine's own cost. Medians of 20 steps after 5, in microseconds:
``ret_host`` until ``backward`` returns, ``wall`` until the GPU is done, ``gpu_span`` from an
event recorded at the start (the GPU idle) to one recorded at the return.

Usage: ``python backward_start.py`` (after ``source .device/setup.sh`` on the H200). A tidied
copy of the scratch script that ran for ``results/backward_start_h200.txt``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload

Batch = tuple[torch.Tensor, torch.Tensor]


def event() -> torch.cuda.Event:
    e = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    e.record()
    return e


def stamper(
    stamps: dict[str, float], events: dict[str, torch.cuda.Event]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """A tensor hook that stamps the host time and records an event when it runs."""

    def at_node(g: torch.Tensor) -> torch.Tensor:
        stamps["hook"] = time.perf_counter()
        events["hook"] = event()
        return g

    return at_node


def run(
    module: DynamicEmbeddingTables,
    batches: list[Batch],
    grad: torch.Tensor,
    caller: bool,
    hook: bool,
    label: str,
) -> None:
    rows: list[dict[str, float]] = []
    for i in range(25):
        module.train()
        out = module(*batches[i % len(batches)])
        torch.cuda.synchronize()
        stamps: dict[str, float] = {}
        events: dict[str, torch.cuda.Event] = {}
        if hook:
            out.register_hook(stamper(stamps, events))
        with torch.autograd.set_multithreading_enabled(not caller):
            e0 = event()
            t0 = time.perf_counter()
            torch.autograd.backward([out], [grad])
            t1 = time.perf_counter()
            e1 = event()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i < 5:
            continue
        r = {"ret_host": (t1 - t0) * 1e6, "wall": (t2 - t0) * 1e6}
        r["gpu_span"] = e0.elapsed_time(e1) * 1e3
        if hook:
            r["hook_host"] = (stamps["hook"] - t0) * 1e6
            r["hook_gpu"] = e0.elapsed_time(events["hook"]) * 1e3
            r["after_hook_gpu"] = events["hook"].elapsed_time(e1) * 1e3
        rows.append(r)
    cols = "  ".join(f"{k} {statistics.median(r[k] for r in rows):7.1f}" for k in rows[0])
    print(f"{label:28s} {cols}", flush=True)


def trivial(caller: bool) -> None:
    x = torch.zeros((1_048_570, 128), device="cuda", requires_grad=True)
    g = torch.ones_like(x)
    times = []
    for i in range(25):
        y = x * 1.0
        torch.cuda.synchronize()
        with torch.autograd.set_multithreading_enabled(not caller):
            t0 = time.perf_counter()
            torch.autograd.backward([y], [g])
            torch.cuda.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e6)
        x.grad = None
    mode = "caller" if caller else "default"
    print(f"trivial x*1 backward ({mode}): wall {statistics.median(times):.1f} us", flush=True)


def main() -> None:
    module, batches, grad = ready(Workload(), torch.device("cuda"))
    for caller in (False, True):
        name = "caller" if caller else "default"
        run(module, batches, grad, caller, False, f"{name} no hook")
        run(module, batches, grad, caller, True, f"{name} hook")
    trivial(False)
    trivial(True)


if __name__ == "__main__":
    main()
