"""``demb bench module --profile``: where a step of the module benchmark's workload spends its
time, by torch.profiler.

After the timed run, a fresh module of the same workload (every row inserted) takes a few
untimed steps, then ``steps`` profiled ones: a training forward, its backward (with the fused
update) and an eval forward, each a ``record_function`` range (``train_forward``,
``train_backward``, ``eval_forward``) ended by a synchronization. Reported per profiled step:
each phase's host time (and, on CUDA, the time the device was busy within it: the union of its
kernels, copies and memsets), and the ops with the most self time on the device (CUDA: the
kernels an op launched itself) and on the host, with their calls and total time (children
included). ``--trace FILE`` also writes the profile as a Chrome trace (open it in
Perfetto or ``chrome://tracing``). The profiled steps are not the timed ones: profiling slows
every op, so their times are only relative.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent, FunctionEventAvg
from torch.profiler import ProfilerActivity, profile, record_function

from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload

__all__ = ["PHASES", "print_profile", "profile_module"]

PHASES = ("train_forward", "train_backward", "eval_forward")
"""The ``record_function`` ranges of a profiled step."""
_ALLOCATOR = ("num_alloc_retries", "num_device_alloc", "num_device_free")
_NAME_WIDTH = 60
_PROFILER = frozenset({"Activity Buffer Request"})
"""The profiler's own events (left out of the top ops)."""


def _op(event: FunctionEventAvg, steps: int) -> dict[str, Any]:
    """One op's (or range's) averages per profiled step, in microseconds."""
    return {
        "name": str(event.key),
        "calls_per_step": event.count / steps,
        "self_host_us": event.self_cpu_time_total / steps,
        "host_us": event.cpu_time_total / steps,
        "self_device_us": event.self_device_time_total / steps,
        "device_us": event.device_time_total / steps,
    }


def profile_module(
    w: Workload,
    device: torch.device,
    steps: int = 2,
    warmup: int = 3,
    top: int = 15,
    trace: str | None = None,
) -> dict[str, Any]:
    """Profile ``steps`` steps of ``w`` on ``device`` after ``warmup`` untimed ones; the ``top``
    ops by self device time (``by_device``, CUDA only) and by self host time (``by_host``),
    each phase's host and device busy time (``phases``), all per step in microseconds; with
    ``trace``, also write a Chrome trace there."""
    module, batches, grad = ready(w, device, 2)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(i: int) -> None:
        batch = batches[i % len(batches)]
        module.train()
        with record_function(PHASES[0]):
            out = module(*batch)
            sync()
        with record_function(PHASES[1]):
            torch.autograd.backward([out], [grad])
            sync()
        module.eval()
        with record_function(PHASES[2]), torch.no_grad():
            module(*batch)
            sync()

    for i in range(warmup):
        step(i)
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    before = torch.cuda.memory_stats(device) if on_gpu else {}
    with profile(activities=activities, acc_events=True) as prof:  # one cycle: no warning
        for i in range(steps):
            step(i)
    report: dict[str, Any] = {
        "device": device.type,
        "steps": steps,
        "warmup": warmup,
        "trace": trace,
    }
    if on_gpu:
        after = torch.cuda.memory_stats(device)
        report["allocator"] = {k: after.get(k, 0) - before.get(k, 0) for k in _ALLOCATOR}
    if trace:
        prof.export_chrome_trace(trace)
    report["phases"] = _phases(list(prof.events() or []), steps)
    ops = [
        _op(e, steps)
        for e in prof.key_averages()
        if e.device_type == DeviceType.CPU and e.key not in PHASES and e.key not in _PROFILER
    ]
    for key, side in (("by_device", "self_device_us"), ("by_host", "self_host_us")):
        ranked = sorted((op for op in ops if op[side] > 0), key=lambda op: -op[side])
        report[key] = ranked[:top]
    return report


def _busy(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the ``(start, end)`` spans."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _phases(events: list[FunctionEvent], steps: int) -> dict[str, dict[str, float]]:
    """Per phase and profiled step: its host time (the range's wall time) and the time the
    device was busy within it (the union of kernels, copies and memsets), in microseconds."""
    ranges: dict[str, list[tuple[float, float]]] = {name: [] for name in PHASES}
    device: list[tuple[float, float]] = []
    for e in events:
        span = (float(e.time_range.start), float(e.time_range.end))
        if e.device_type == DeviceType.CPU:
            if e.name in ranges:
                ranges[e.name].append(span)
        elif not e.is_user_annotation:
            device.append(span)
    phases = {}
    for name, spans in ranges.items():
        busy = 0.0
        for lo, hi in spans:
            busy += _busy([(max(a, lo), min(b, hi)) for a, b in device if b > lo and a < hi])
        phases[name] = {
            "host_us": sum(hi - lo for lo, hi in spans) / steps,
            "device_busy_us": busy / steps,
        }
    return phases


def _print_ops(title: str, ops: list[dict[str, Any]], side: str) -> None:
    total = "device_us" if side == "self_device_us" else "host_us"
    print(title)
    print(f"  {'op':<{_NAME_WIDTH}}  {'calls':>7}  {'self us':>10}  {'total us':>10}")
    for op in ops:
        name = op["name"][:_NAME_WIDTH]
        print(
            f"  {name:<{_NAME_WIDTH}}  {op['calls_per_step']:>7.4g}  {op[side]:>10.1f}  "
            f"{op[total]:>10.1f}"
        )


def print_profile(report: dict[str, Any]) -> None:
    """Print :func:`profile_module`'s report: the phases, then the top ops by device time
    (CUDA) and by host time."""
    print(
        f"profile (torch.profiler, {report['steps']} steps after {report['warmup']} untimed; "
        "per step; profiled steps run slower than timed ones):"
    )
    on_gpu = report["device"] == "cuda"
    for name in PHASES:
        if name in report["phases"]:
            phase = report["phases"][name]
            device = f", device busy {phase['device_busy_us']:.1f} us" if on_gpu else ""
            print(f"  {name:<15} host {phase['host_us']:.1f} us{device}")
    if on_gpu:
        print(f"  caching allocator during the profiled steps: {report['allocator']}")
        _print_ops("top ops by self device time (per step):", report["by_device"], "self_device_us")
    _print_ops("top ops by self host time (per step):", report["by_host"], "self_host_us")
    if report["trace"]:
        print(f"wrote the Chrome trace to {report['trace']}")
