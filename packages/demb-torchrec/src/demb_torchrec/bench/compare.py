"""What ``demb bench table``, ``demb bench update`` and ``demb bench io`` share: each figure
they measure is reported beside a baseline (or physical floor) measured in the same run, with
the ratio ``figure / baseline``; the machine they ran on; a device's copy bandwidth; timing."""

from __future__ import annotations

import math
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = [
    "Comparison",
    "check_counts",
    "copy_bandwidth",
    "format_si",
    "machine_info",
    "median_seconds",
    "print_comparisons",
    "run_cases",
    "seconds_of",
]


@dataclass(frozen=True)
class Comparison:
    """One measured figure beside the same run's baseline for it, both in ``unit`` (a rate:
    higher is better, so ``ratio`` above 1 means the figure beats its baseline)."""

    case: str
    """What was measured (an op, an optimizer, a checkpoint read...)."""
    figure: float
    """The measured figure, in ``unit``."""
    baseline: float
    """The baseline or floor measured in the same run, in ``unit``."""
    unit: str
    """The figures' unit (SI, without a prefix: ``keys/s``, ``B/s``)."""
    baseline_name: str
    """What the baseline is."""

    @property
    def ratio(self) -> float:
        """``figure / baseline``."""
        return self.figure / self.baseline

    def as_dict(self) -> dict[str, Any]:
        """The comparison as JSON fields, its ratio included."""
        return {
            "case": self.case,
            "figure": self.figure,
            "baseline": self.baseline,
            "ratio": self.ratio,
            "unit": self.unit,
            "baseline_name": self.baseline_name,
        }


_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def check_counts(settings: object, *names: str, minimum: int = 1) -> None:
    """Each attribute ``names`` of a workload's ``settings`` is an integer ``>= minimum``.

    Raises:
        ValueError: naming the first that is not.
    """
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ValueError(f"{name}={value!r}: must be {what}")


_Case = TypeVar("_Case")
_Row = TypeVar("_Row")


def run_cases(
    device: torch.device, cases: Iterable[_Case], run: Callable[[_Case], list[_Row]]
) -> list[_Row]:
    """The rows ``run(case)`` returns for each case in turn, in one list; on CUDA the
    allocator's cache is emptied after each case, so one case's buffers do not crowd the next."""
    rows: list[_Row] = []
    for case in cases:
        rows += run(case)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_si(value: float, unit: str) -> str:
    """``value`` with an SI prefix and 3 significant digits: ``12.3 GB/s``, ``4.56 M keys/s``."""
    scale, prefix = next(((s, p) for s, p in _PREFIXES if abs(value) >= s), (1.0, ""))
    number = f"{value / scale:.3g}"
    if unit.startswith("B/") or not prefix:  # bytes take the prefix: GB/s; words: M keys/s
        return f"{number} {prefix}{unit}"
    return f"{number} {prefix} {unit}"


def _format_ratio(ratio: float) -> str:
    return f"{ratio:.3g}x" if math.isfinite(ratio) else str(ratio)


def print_comparisons(title: str, comparisons: Sequence[Comparison]) -> None:
    """Print ``title`` and a table: each comparison's case, figure, baseline, ratio and what
    the baseline is."""
    header = ("case", "figure", "baseline", "ratio", "baseline is")
    rows = [
        (
            c.case,
            format_si(c.figure, c.unit),
            format_si(c.baseline, c.unit),
            _format_ratio(c.ratio),
            c.baseline_name,
        )
        for c in comparisons
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(4)]
    print(title)
    for r in [header, *rows]:
        print(
            f"  {r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  "
            f"{r[3]:>{widths[3]}}  {r[4]}"
        )


def machine_info(device: torch.device | None = None) -> dict[str, Any]:
    """Python, torch, the CPU, its cores and torch's threads, and the device (its name and
    memory on CUDA)."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device is not None:
        info["device"] = str(device)
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            info.update(
                gpu=props.name,
                gpu_memory_gib=round(props.total_memory / 2**30, 1),
                sm_count=props.multi_processor_count,
                cuda=torch.version.cuda,
            )
    return info


def seconds_of(call: Callable[[], object], device: torch.device) -> float:
    """Seconds one ``call`` takes: between CUDA events on a GPU (after a synchronize), by the
    wall clock on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        call()
        return time.perf_counter() - t0
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize(device)
    start.record()
    call()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3


def median_seconds(call: Callable[[], object], device: torch.device, iters: int) -> float:
    """The median of ``iters`` timings of ``call`` (:func:`seconds_of`)."""
    times = sorted(seconds_of(call, device) for _ in range(iters))
    return times[len(times) // 2]


def copy_bandwidth(device: torch.device, mib: int = 512, iters: int = 5) -> float:
    """Bytes/s of a device-to-device copy of ``mib`` MiB (read + write counted): the median of
    ``iters`` copies after a warm-up one."""
    src = torch.zeros(mib * 2**18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), device, iters)
