"""The parts of ``demb bench tiers`` (:mod:`demb_torchrec.bench.tiers_bench`): the copy floor
of the rows that cross between the tiers, the reference system's published figures and the
printed report."""

from __future__ import annotations

from typing import Any

import torch

from demb_torchrec.bench._delta_report import figure
from demb_torchrec.bench.compare import seconds_of

__all__ = [
    "HYBRID_MODES",
    "PREFETCH_MODES",
    "PUBLISHED",
    "copy_floor",
    "prefetch_figures",
    "print_report",
]

HYBRID_MODES = ("hybrid (10% of value bytes on the device)", "no device memory for values")
"""The issue's hybrid modes: ``caching=False`` with a device budget of a tenth of the tables'
value bytes, and with a budget below one row (every value in host memory)."""

PREFETCH_MODES = ("overlapped", "serial")
"""How a prefetch mode's step prefetches the next batch: between its forward and its backward
(``module.prefetch`` returns before its storage reads are done: they overlap the backward),
or after its backward, timed on its own (nothing to overlap)."""

_HIDDEN_TARGET = 0.7
"""The share of the prefetch's time the overlap should hide."""


def prefetch_figures(modes: list[dict[str, Any]], device: torch.device) -> list[dict[str, Any]]:
    """The prefetch's time left visible when it overlaps the step, beside the prefetch alone
    (target: at most 1 - 0.7 of it, i.e. at least 70% hidden); and the overlapped step beside
    the same step without prefetch (for information). Step i of each prefetch mode ran the
    same batch; the last step, which has no next batch to prefetch, is left out."""
    by = {m.get("prefetch"): m for m in modes}
    over, serial = by.get(PREFETCH_MODES[0]), by.get(PREFETCH_MODES[1])
    if over is None or serial is None or not serial["prefetch_alone"]:
        return []
    alone = serial["prefetch_alone"]["seconds"]
    n = len(alone)
    rest = [s - p for s, p in zip(serial["step"]["seconds"][:n], alone, strict=True)]
    visible = [max(0.0, o - r) for o, r in zip(over["step"]["seconds"][:n], rest, strict=True)]
    fig = figure(
        f"{over['mode']}: the prefetch's time not hidden (overlapped step - serial step "
        "without its prefetch)",
        visible,
        "the same prefetch alone, between device syncs (the serial mode's)",
        alone,
        1 - _HIDDEN_TARGET,
        None,
        unit="s/step",
    )
    fig["hidden_share"] = 1 - fig["ratio"]
    fig["hidden_target"] = _HIDDEN_TARGET
    if device.type != "cuda":
        fig["note"] = (
            "on the CPU a prefetch runs in the caller's thread before it returns: nothing "
            "overlaps, and the figure is noise around 0% hidden"
        )
    plain = next((m for m in modes if m["mode"] == over["mode"].split(",")[0]), None)
    out = [fig]
    if plain is not None:
        out.append(
            figure(
                f"{over['mode']}: train step vs without prefetch",
                over["step"]["seconds"],
                f"{plain['mode']} train step, no prefetch, same batches",
                plain["step"]["seconds"],
                None,
                None,
                unit="s/step",
            )
        )
    return out


PUBLISHED: dict[str, Any] = {
    "what": "published figures of another system (the reference system) on another machine "
    "(an H100), for its 256M-row version of this workload with Adam: not measured here, for "
    "context only",
    "unit": "ms",
    "figures": {
        "caching 0.8": {"train_ms": 24.3, "eval_ms": 3.5},
        "caching 1.0": {"train_ms": 12.3, "eval_ms": 1.19},
        HYBRID_MODES[0]: {"train_ms": 33.3, "eval_ms": 20.5},
        HYBRID_MODES[1]: {"train_ms": 43.5, "eval_ms": 28.5},
    },
}


def _copy_seconds(nbytes: int, device: torch.device, to_device: bool, iters: int) -> list[float]:
    """``iters`` timings of one copy of ``nbytes``: host (pinned) to device or device to host
    on CUDA, between CUDA events; a host ``Tensor.copy_`` on the CPU (after a warm-up copy)."""
    if nbytes == 0:
        return [0.0] * iters
    cuda = device.type == "cuda"
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    other = torch.ones(nbytes, dtype=torch.uint8, device=device)
    src, dst = (host, other) if to_device else (other, host)
    dst.copy_(src)
    return [seconds_of(lambda: dst.copy_(src), device) for _ in range(iters)]


def copy_floor(h2d_bytes: int, d2h_bytes: int, device: torch.device, iters: int) -> dict[str, Any]:
    """The floor of a step that moves ``h2d_bytes`` up (storage hits) and ``d2h_bytes`` down
    (write-backs): the fastest of ``iters`` copies of each direction, added (a floor is what
    the link does; on a shared host a copy whose thread another process held up is not)."""
    up = _copy_seconds(h2d_bytes, device, True, iters)
    down = _copy_seconds(d2h_bytes, device, False, iters)
    cuda = device.type == "cuda"
    return {
        "what": "H2D copy from pinned host memory + D2H copy into pinned host memory"
        if cuda
        else "host memcpy (Tensor.copy_) of each direction's bytes",
        "h2d_bytes": h2d_bytes,
        "d2h_bytes": d2h_bytes,
        "h2d_seconds": up,
        "d2h_seconds": down,
        "seconds": min(up) + min(down),
        "h2d_bytes_per_s": h2d_bytes / min(up) if min(up) > 0 else None,
        "d2h_bytes_per_s": d2h_bytes / min(down) if min(down) > 0 else None,
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def _row(m: dict[str, Any], base: dict[str, Any]) -> tuple[str, ...]:
    vs = m["step"]["median"] / base["step"]["median"]
    if "floor_figure" not in m:
        return (m["mode"], _ms(m["step"]["median"]), _ms(m["eval"]["median"]), "-", "-", "-",
                "-", "-", _ms(base["step"]["median"]), f"{vs:.3g}x")  # fmt: skip
    f = m["floor_figure"]
    met = "yes" if f["meets_target"] else "no"
    return (
        m["mode"],
        _ms(m["step"]["median"]),
        _ms(m["eval"]["median"]),
        f"{m['bytes_per_step'] / 1e6:.3g} MB",
        _ms(f["baseline"]["median"]),
        f"{f['ratio']:.3g}x",
        f"<= {f['target']:g}x",
        met,
        _ms(base["step"]["median"]),
        f"{vs:.3g}x",
    )


def _print_floor(fl: dict[str, Any]) -> None:
    rates = ", ".join(
        f"{d.upper()} {fl[d + '_bytes'] / 1e6:.3g} MB at {rate / 1e9:.3g} GB/s"
        for d in ("h2d", "d2h")
        if (rate := fl[d + "_bytes_per_s"])
    )
    print(f"      floor {_ms(fl['seconds'])} ms: {fl['what']} ({rates}; the fastest of each)")


def print_report(report: dict[str, Any]) -> None:
    """The modes as a table, the rows that crossed between the tiers and the published figures
    (labelled)."""
    w = report["workload"]
    modes = report["modes"]
    base = modes[0]
    print(
        f"tiers bench on {report['device']} ({report['machine'].get('gpu', 'host')}): "
        f"{w['tables']} tables x {w['rows']:,} rows ({w['tables'] * w['rows']:,} in all), "
        f"D={w['dim']}, {w['optimizer']}, NONE pooling; {w['ids_per_step']:,} ids a step "
        f"({w['samples']:,} a table, {w['unique_keys_per_table_step']:,.0f} unique); "
        f"max_capacity {w['max_capacity']:,} slots (init {w['init_capacity']:,}), rows of "
        f"{w['row_bytes']:,} B; medians of {w['steps']} steps after {w['warmup']} warm-up"
    )
    head = ("mode", "step ms", "eval ms", "moved/step", "floor ms", "step/floor", "target",
            "meets", "all-device ms", "vs all-device")  # fmt: skip
    rows = [head, *(_row(m, base) for m in modes)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    for r in rows:
        cells = [
            f"{c:<{widths[i]}}" if i in (0, 6) else f"{c:>{widths[i]}}" for i, c in enumerate(r)
        ]
        print("  " + "  ".join(cells).rstrip())
    print("  caching modes (over the timed steps; moved = (storage hits + write-backs) x row):")
    for m in (m for m in modes if m.get("kind") == "caching"):
        s, per = m["cache_stats"], m["steps"]
        share = m["cache_rows"][0] / w["unique_keys_per_table_step"]
        print(
            f"    {m['mode']}: cache of {m['cache_rows'][0]:,} rows a table "
            f"({m['budget_bytes']:,} B budget, {share:.3g}x "
            f"the unique keys of a step); a step: {s['cache_hits'] / per:,.0f} cache hits, "
            f"{s['storage_hits'] / per:,.0f} storage hits, {s['misses'] / per:,.0f} new, "
            f"{s['write_backs'] / per:,.0f} write-backs, {s['overflows'] / per:,.0f} overflows"
        )
        _print_floor(m["floor"])
    print("  hybrid modes (moved = the touched rows past the device rows, read and written):")
    for m in (m for m in modes if m.get("kind") == "hybrid"):
        print(
            f"    {m['mode']}: the first {m['device_rows']:,} of {w['init_capacity']:,} rows a "
            f"table in device memory ({m['budget_bytes']:,} B budget); a step touches "
            f"{m['host_rows_per_step']:,.0f} rows in host memory"
        )
        _print_floor(m["floor"])
    for f in report["figures"]:
        if "hidden_share" in f:
            met = "yes" if f["meets_target"] else "no"
            print(
                f"  prefetch: {_ms(f['baseline']['median'])} ms alone, "
                f"{_ms(f['median'])} ms of it not hidden by the overlap: "
                f"{f['hidden_share']:.0%} hidden (target >= {f['hidden_target']:.0%}: {met})"
            )
            if "note" in f:
                print(f"    ({f['note']})")
    print(f"  {PUBLISHED['what']}; train (eval) ms:")
    print(
        "    "
        + ", ".join(
            f"{k} {v['train_ms']:g} ({v['eval_ms']:g})" for k, v in PUBLISHED["figures"].items()
        )
    )
