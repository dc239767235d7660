"""Plots of a ``demb train`` run, drawn from its metrics records (:mod:`.report`).

Rendering uses matplotlib's object API (a :class:`~matplotlib.figure.Figure` on an Agg canvas):
no ``pyplot``, no global state, and the caller's backend is left as it was.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["ADMISSION_PNG", "QUALITY_PNG", "TABLES_PNG", "TIERS_PNG", "plot_run"]

QUALITY_PNG = "quality.png"
"""File name of the quality plot (losses and AUCs over steps)."""
TABLES_PNG = "tables.png"
"""File name of the tables plot (load factors, inserts and evictions over steps)."""
TIERS_PNG = "tiers.png"
"""File name of the cache-tier plot (cache hit share, keys moved between the tiers), drawn
when the records have cache counts."""
ADMISSION_PNG = "admission.png"
"""File name of the admission plot (admitted and rejected keys per table over steps), drawn
when the records have admission counts."""

_DPI = 100
_QUALITY_SIZE = (10.0, 7.0)  # inches: 1000 x 700 pixels
_TABLES_SIZE = (10.0, 8.0)  # inches: 1000 x 800 pixels
_LEGEND_TABLES = 8  # up to this many tables get a legend; more get labels on the top lines
_LABELED_TABLES = 3
_MARKERS_UP_TO = 60  # series with this many points or fewer get markers

Series = tuple[list[int], list[float]]


def _number(value: object) -> float | None:
    """``value`` as a finite float, or ``None`` (missing, bool, non-numeric, non-finite)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _step(record: Mapping[str, Any]) -> int | None:
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        return None
    return int(step)


def _get(record: Mapping[str, Any], *path: str) -> object:
    node: object = record
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def _series(records: Sequence[tuple[int, Mapping[str, Any]]], *path: str) -> Series:
    steps: list[int] = []
    values: list[float] = []
    for step, record in records:
        value = _number(_get(record, *path))
        if value is not None:
            steps.append(step)
            values.append(value)
    return steps, values


def _natural_key(name: str) -> list[int | str]:
    """Sort key putting ``cat_2`` before ``cat_10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _plot(
    ax: Axes,
    series: Series,
    label: str,
    color: str,
    *,
    lw: float = 1.5,
    alpha: float = 1.0,
    ls: str = "-",
) -> bool:
    """Draw ``series`` (markers when it is short); whether there was anything to draw."""
    steps, values = series
    if not steps:
        return False
    marker = "o" if len(steps) <= _MARKERS_UP_TO else None
    ax.plot(steps, values, label=label, color=color, lw=lw, alpha=alpha, ls=ls, marker=marker, ms=3)
    return True


def _note(ax: Axes, text: str) -> None:
    ax.text(
        0.5,
        0.5,
        text,
        transform=ax.transAxes,
        ha="center",
        va="center",
        color="0.4",
        fontsize=11,
    )


def _finish(ax: Axes, drawn: bool, empty_text: str, ylabel: str) -> None:
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if drawn:
        ax.legend(loc="best", fontsize=9)
    else:
        _note(ax, empty_text)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)  # attaches itself to the figure: PNG through Agg, whatever the backend
    fig.savefig(path, dpi=_DPI, facecolor="white")
    return path


def _span(records: Sequence[tuple[int, Mapping[str, Any]]]) -> str:
    if not records:
        return "no records"
    return f"{len(records)} records, steps {records[0][0]}-{records[-1][0]}"


def _quality(records: Sequence[tuple[int, Mapping[str, Any]]], path: Path) -> Path:
    fig = Figure(figsize=_QUALITY_SIZE, dpi=_DPI, layout="constrained")
    loss_ax, auc_ax = fig.subplots(2, 1, sharex=True)
    drawn = _plot(loss_ax, _series(records, "train", "loss"), "train loss", "tab:blue")
    drawn |= _plot(
        loss_ax, _series(records, "eval", "logloss"), "eval log loss", "tab:orange", lw=2
    )
    _finish(loss_ax, drawn, "no loss in the records", "log loss")
    loss_ax.set_title("Loss")

    drawn = _plot(auc_ax, _series(records, "eval", "auc"), "eval AUC", "tab:orange", lw=2)
    drawn |= _plot(auc_ax, _series(records, "train", "auc"), "train AUC", "tab:blue", alpha=0.6)
    drawn |= _plot(auc_ax, _series(records, "replica", "auc"), "replica AUC", "tab:green", ls="--")
    _finish(auc_ax, drawn, "no eval records", "AUC")
    auc_ax.set_title("AUC")
    auc_ax.set_xlabel("step")
    fig.suptitle(f"Training quality ({_span(records)})")
    return _save(fig, path)


def _table_names(records: Sequence[tuple[int, Mapping[str, Any]]]) -> list[str]:
    names: set[str] = set()
    for _, record in records:
        tables = record.get("tables")
        if isinstance(tables, Mapping):
            names.update(name for name, t in tables.items() if isinstance(t, Mapping))
    return sorted(names, key=_natural_key)


def _load_factor(table: object) -> float | None:
    """``size / capacity`` when the table reports both (capacity > 0), else its ``load_factor``."""
    if not isinstance(table, Mapping):
        return None
    size, capacity = _number(table.get("size")), _number(table.get("capacity"))
    if size is not None and capacity is not None and capacity > 0:
        return size / capacity
    return _number(table.get("load_factor"))


def _counter_sums(
    records: Sequence[tuple[int, Mapping[str, Any]]],
    names: Sequence[str],
    key: str,
    counters: Literal["interval", "cumulative"],
) -> Series:
    """Per record, ``key`` summed over the tables reporting it; with cumulative counters, the
    increase since the table's previous report (its value when it went down: a reset)."""
    steps: list[int] = []
    sums: list[float] = []
    last: dict[str, float] = {}
    for step, record in records:
        total: float | None = None
        for name in names:
            value = _number(_get(record, "tables", name, key))
            if value is None:
                continue
            if counters == "cumulative":
                before = last.get(name)
                last[name] = value
                if before is not None and value >= before:
                    value -= before
            total = value if total is None else total + value
        if total is not None:
            steps.append(step)
            sums.append(total)
    return steps, sums


def _tables(
    records: Sequence[tuple[int, Mapping[str, Any]]],
    path: Path,
    counters: Literal["interval", "cumulative"],
) -> Path:
    fig = Figure(figsize=_TABLES_SIZE, dpi=_DPI, layout="constrained")
    load_ax, count_ax = fig.subplots(2, 1, sharex=True)
    names = _table_names(records)
    cmap = colormaps["turbo"]
    finals: list[tuple[float, int, float, str, tuple[float, float, float, float]]] = []
    per_step: dict[int, list[float]] = {}
    for index, name in enumerate(names):
        steps: list[int] = []
        values: list[float] = []
        for step, record in records:
            value = _load_factor(_get(record, "tables", name))
            if value is not None:
                steps.append(step)
                values.append(value)
                per_step.setdefault(step, []).append(value)
        if not steps:
            continue
        color = cmap(0.05 + 0.9 * index / max(len(names) - 1, 1))
        load_ax.plot(steps, values, color=color, lw=1.0, alpha=0.85, label=name)
        finals.append((values[-1], steps[-1], values[-1], name, color))
    load_ax.set_ylabel("load factor (size / capacity)")
    load_ax.grid(True, alpha=0.3)
    if finals:
        mean_steps = sorted(per_step)
        mean = [sum(per_step[s]) / len(per_step[s]) for s in mean_steps]
        load_ax.plot(mean_steps, mean, color="black", lw=2.2, label="mean")
        load_ax.set_ylim(bottom=0.0)
        if len(finals) <= _LEGEND_TABLES:
            load_ax.legend(loc="best", fontsize=8)
        else:
            load_ax.legend(handles=load_ax.get_lines()[-1:], loc="upper left", fontsize=8)
            for _, step, value, name, color in sorted(finals, reverse=True)[:_LABELED_TABLES]:
                load_ax.annotate(
                    name,
                    xy=(step, value),
                    xytext=(4, 0),
                    textcoords="offset points",
                    fontsize=8,
                    color=color,
                    va="center",
                    annotation_clip=False,
                )
        title = f"Load factor of {len(finals)} tables"
        if len(finals) > _LEGEND_TABLES:
            title += f" (the top {_LABELED_TABLES} labeled)"
        load_ax.set_title(title)
    else:
        load_ax.set_title("Load factor")
        _note(load_ax, "no table size / capacity in the records")

    drawn = _plot(
        count_ax, _counter_sums(records, names, "inserts", counters), "inserts", "tab:blue"
    )
    drawn |= _plot(
        count_ax,
        _counter_sums(records, names, "evictions", counters),
        "evictions",
        "tab:red",
    )
    if drawn:
        count_ax.set_yscale("symlog", linthresh=1.0)
    ylabel = "count per interval (symlog)" if drawn else "count per interval"
    _finish(count_ax, drawn, "no inserts / evictions in the records", ylabel)
    count_ax.set_title("Inserts and evictions per interval, summed over tables")
    count_ax.set_xlabel("step")
    fig.suptitle(f"Dynamic tables ({_span(records)})")
    return _save(fig, path)


def _has_counts(
    records: Sequence[tuple[int, Mapping[str, Any]]], names: list[str], keys: Sequence[str]
) -> bool:
    return any(
        (_number(_get(r, "tables", n, k)) or 0) > 0 for _, r in records for n in names for k in keys
    )


@dataclass(frozen=True)
class _Counts:
    """A two-panel figure of per-table counts: the share ``part / sum(whole)`` per table and
    record, then the ``lines`` (key, label, colour) summed over tables."""

    part: str
    whole: tuple[str, ...]
    share_label: str
    share_title: str
    lines: tuple[tuple[str, str, str], ...]
    count_title: str
    empty: str
    title: str


_ADMISSION = _Counts(
    part="rejected",
    whole=("admitted", "rejected"),
    share_label="rejected / missing keys",
    share_title="Share of each table's missing keys its admission rejected, per interval",
    lines=(
        ("admitted", "admitted", "tab:green"),
        ("rejected", "rejected", "tab:orange"),
        ("counter_evictions", "counter evictions", "tab:purple"),
    ),
    count_title="Keys admitted, rejected and evicted from the counters, summed over tables",
    empty="no admission counts in the records",
    title="Admission",
)
_TIERS = _Counts(
    part="cache_hits",
    whole=("cache_hits", "storage_hits", "cache_misses"),
    share_label="cache hits / keys looked up",
    share_title="Share of each caching table's keys found in its device cache, per interval",
    lines=(
        ("storage_hits", "read from the storage", "tab:blue"),
        ("cache_misses", "new (in neither tier)", "tab:green"),
        ("write_backs", "written back", "tab:red"),
        ("storage_evictions", "dropped by the storage", "tab:purple"),
    ),
    count_title="Keys moved between the tiers, summed over caching tables",
    empty="no cache counts in the records",
    title="Cache tiers",
)


def _counts(
    records: Sequence[tuple[int, Mapping[str, Any]]],
    path: Path,
    counters: Literal["interval", "cumulative"],
    spec: _Counts,
) -> Path:
    fig = Figure(figsize=_TABLES_SIZE, dpi=_DPI, layout="constrained")
    share_ax, count_ax = fig.subplots(2, 1, sharex=True)
    names = _table_names(records)
    cmap = colormaps["turbo"]
    drawn = False
    for index, name in enumerate(names):
        sums = [
            dict(zip(*_counter_sums(records, [name], k, counters), strict=True)) for k in spec.whole
        ]
        part = dict(zip(*_counter_sums(records, [name], spec.part, counters), strict=True))
        steps = sorted({s for d in sums for s, v in d.items() if v > 0})
        if not steps:
            continue
        share = [part.get(s, 0.0) / sum(d.get(s, 0.0) for d in sums) for s in steps]
        color = cmap(0.05 + 0.9 * index / max(len(names) - 1, 1))
        label = name if len(names) <= _LEGEND_TABLES else None
        share_ax.plot(steps, share, color=color, lw=1.0, alpha=0.85, label=label)
        drawn = True
    share_ax.set_ylim(-0.02, 1.02)
    share_ax.set_ylabel(spec.share_label)
    share_ax.grid(True, alpha=0.3)
    if drawn and len(names) <= _LEGEND_TABLES:
        share_ax.legend(loc="best", fontsize=8)
    if not drawn:
        _note(share_ax, spec.empty)
    share_ax.set_title(spec.share_title)
    drawn = False
    for key, label, line_color in spec.lines:
        drawn |= _plot(count_ax, _counter_sums(records, names, key, counters), label, line_color)
    if drawn:
        count_ax.set_yscale("symlog", linthresh=1.0)
    _finish(count_ax, drawn, spec.empty, "keys per interval (symlog)")
    count_ax.set_title(spec.count_title)
    count_ax.set_xlabel("step")
    fig.suptitle(f"{spec.title} ({_span(records)})")
    return _save(fig, path)


def plot_run(
    records: Sequence[Mapping[str, Any]],
    out_dir: Path,
    *,
    counters: Literal["interval", "cumulative"] = "interval",
) -> list[Path]:
    """Draw a run's records as PNGs in ``out_dir`` (created); returns the paths written.

    - ``quality.png`` (1000 x 700 px), two panels over steps: the train loss and the eval log
      loss (``eval/logloss``); the eval AUC, the train AUC and the replica AUC
      (``replica/auc``), each where the records have it.
    - ``tables.png`` (1000 x 800 px), two panels over steps: each table's load factor
      (``size / capacity``, else its ``load_factor``), one line per table coloured along a
      colormap, their mean in black, a legend up to 8 tables and else the 3 fullest tables
      labeled; the ``inserts`` and ``evictions`` of all tables summed per record (symlog axis).
    - ``admission.png`` (1000 x 800 px), only when some table reports admission counts: per
      table, the share of its missing keys rejected per record; the ``admitted``,
      ``rejected`` and ``counter_evictions`` of all tables summed per record.
    - ``tiers.png`` (1000 x 800 px), only when some table reports cache counts (caching
      tables): per table, the share of its keys found in its device cache per record; the
      keys read from the storage, new keys, rows written back and keys the storage dropped,
      summed per record.

    The first two files are always written: a panel with nothing to draw (no records, no eval,
    no table stats) says so in its middle. Records are taken in step order; those without an integer
    ``"step"`` are left out, and so are missing, ``None``, bool and non-finite values.

    Args:
        records: the run's records (:func:`~demb_torchrec.train.report.read_records`).
        out_dir: where to write the PNGs.
        counters: how the tables' ``inserts`` / ``evictions`` count: ``"interval"`` (since the
            previous record, plotted as they are) or ``"cumulative"`` (since the start: plotted
            as the increase since the previous record).
    """
    if counters not in ("interval", "cumulative"):
        raise ValueError(f"counters: 'interval' or 'cumulative', not {counters!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stepped = [(step, r) for r in records if (step := _step(r)) is not None]
    stepped.sort(key=lambda item: item[0])
    paths = [_quality(stepped, out / QUALITY_PNG), _tables(stepped, out / TABLES_PNG, counters)]
    names = _table_names(stepped)
    if _has_counts(stepped, names, _ADMISSION.whole):
        paths.append(_counts(stepped, out / ADMISSION_PNG, counters, _ADMISSION))
    if _has_counts(stepped, names, _TIERS.whole):
        paths.append(_counts(stepped, out / TIERS_PNG, counters, _TIERS))
    return paths
