"""The report of ``demb bench delta``: each figure beside its baseline (median, min, max,
samples, ratio, target) and the printed table (:mod:`demb_torchrec.bench.delta_bench`)."""

from __future__ import annotations

import math
import statistics
from typing import Any

__all__ = ["figure", "print_report", "stats"]


def stats(seconds: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(seconds),
        "min": min(seconds),
        "max": max(seconds),
        "seconds": seconds,
    }


def figure(
    name: str,
    seconds: list[float],
    baseline_name: str,
    baseline: list[float],
    target: float | None,
    nbytes: int | None,
    unit: str = "s",
) -> dict[str, Any]:
    """One figure beside its baseline: each's median, min, max and samples; the ratio of the
    medians; the target (None: reported for information)."""
    figure = stats(seconds)
    base = stats(baseline)
    ratio = figure["median"] / base["median"] if base["median"] > 0 else math.inf
    return {
        "figure": name,
        "unit": unit,
        **figure,
        "baseline_name": baseline_name,
        "baseline": base,
        "ratio": ratio,
        "target": target,
        "meets_target": None if target is None else ratio <= target,
        "bytes": nbytes,
    }


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g}"


def _spread(stats: dict[str, Any]) -> str:
    """``median (min-max) ms``."""
    return f"{_ms(stats['median'])} ({_ms(stats['min'])}-{_ms(stats['max'])}) ms"


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.3g} GB"


def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(
        f"delta bench on {report['device']} ({report['machine'].get('gpu', 'host')}): "
        f"{w['tables']} tables x {w['rows']:,} rows ({w['capacity']:,} slots), D={w['dim']}, "
        f"{w['optimizer']}, {w['score_strategy']} scores; window {w['touched_rows']:,} rows "
        f"a table; {w['repeats']} repeats (median, min-max)"
    )
    head = ("figure", "median (min-max)", "baseline", "ratio", "target", "meets")
    rows = []
    for f in report["figures"]:
        met = f["meets_target"]
        rows.append(
            (
                f["figure"],
                _spread(f),
                _spread(f["baseline"]),
                f"{f['ratio']:.3g}x",
                "-" if f["target"] is None else f"<= {f['target']:g}x",
                "-" if met is None else ("yes" if met else "no"),
            )
        )
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        print(
            f"  {r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}  "
            f"{r[3]:>{widths[3]}}  {r[4]:<{widths[4]}}  {r[5]}"
        )
    print("  baselines:")
    for f in report["figures"]:
        size = "" if f["bytes"] is None else f" ({_gb(f['bytes'])})"
        print(f"    {f['figure']}: {f['baseline_name']}{size}")
    write = report["background_write"]
    print(
        f"  background write: {_ms(statistics.median(write['seconds']))} ms median for "
        f"{_gb(write['checkpoint_bytes'])} on disk; steps during it "
        f"{write['steps_during']}, before it {write['steps_before']}"
    )
    c = report["checks"]
    print(
        f"  checks: {c['deltas']} deltas held exactly their window's keys; "
        f"{c['replays']} replays equal to the source bit for bit"
    )
