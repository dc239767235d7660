"""``demb bench tiers``: the train step and the eval forward of caching tables
(``caching=True``: a device cache over a host table) beside the same tables with every value on
the device, and beside the copy floor of the rows that cross between the tiers, in one run.

The workload (the issue's, at ``scale``): 10 tables of 3,355,443 rows (32M in all) at scale 1,
D=128, Adam (or SGD), NONE pooling, one id a bag, 1,048,576 ids a step (104,858 a table) drawn
per table from a power law with exponent 1.05 over the table's rows
(:func:`~demb_torchrec.bench.workload.power_law_ids`); ``scale`` multiplies the rows and the
ids. Every step has a batch of its own (``warmup + steps`` batches, the same for every mode).
Each table's ``max_capacity`` is a power of two >= 2 x its rows (buckets of 128), so it could
hold every row without evicting; it starts at ``init_capacity``, a power of two >= 2 x the
distinct ids of the table in all the batches, so it never grows during the run.

Modes, one after another (each one's module freed before the next):

* ``all-device``: ``caching=False``, every value on the device (the baseline);
* ``caching 1.0``: ``caching=True`` with ``local_hbm_for_values`` = 1.0 x the unique ids of a
  table's step (the mean over the batches) x the value row's bytes (embedding and optimizer
  state, float32); the cache rounds it down to whole buckets (:func:`demb_torchrec._tiers.
  cache_config`); the storage is the default host table of ``max_capacity`` slots;
* ``caching 0.8``: the same with 0.8 x.

Each mode takes ``warmup`` untimed train steps (the caches fill) and one untimed eval forward,
then ``steps`` timed train steps (forward and backward of a constant gradient) and one timed
eval forward of each of their batches; each timed between device synchronizations. The figure
is the median. ``cache_stats()`` over the timed steps counts the rows that crossed between the
tiers: ``(storage_hits + write_backs) x row bytes`` a step. Floor: one host-to-device copy of
the storage hits' bytes plus one device-to-host copy of the write-backs' bytes, from and into
pinned host memory on CUDA (between CUDA events), a host ``Tensor.copy_`` of each on the CPU;
each the fastest of ``copy_iters`` (every timing is in the report); target: step / floor <= 2x.
Beside it: the all-device step and eval (their ratio, no target). Checked: every module held
exactly the distinct ids of its batches after the run (nothing evicted, nothing lost between
the tiers) and the all-device tables never grew; every unique id of a timed step was counted
once as a cache hit, a storage hit or a new key.

* ``hybrid (10% of value bytes on the device)``: ``caching=False`` with a budget of a tenth of
  the tables' value bytes (``init_capacity`` rows): their first rows in device memory, the
  others in host memory under one index;
* ``no device memory for values``: the same with a budget of 0 (the spec's default).

A hybrid mode's floor: the rows past the device rows that a timed step touches (its unique
keys' slots), read host-to-device and written back device-to-host, at the same copy bandwidth.
The reference system's published figures are printed, labelled as such.

Memory at scale 1 (Adam, rows of 1,536 B): the tables start at 2^20 slots (1.6 GB a table, 16 GB
in all on the device for ``all-device``; the same in pinned host memory for a caching mode's
storage, its index on the device); the caches hold about 37,000 rows a table (57 MB).
"""

from __future__ import annotations

import gc
import math
import statistics
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.bench._delta_report import figure, stats
from demb_torchrec.bench._tiers_parts import (
    HYBRID_MODES,
    PREFETCH_MODES,
    PUBLISHED,
    copy_floor,
    prefetch_figures,
    print_report,
)
from demb_torchrec.bench.compare import check_counts, machine_info
from demb_torchrec.bench.workload import (
    BUCKET,
    Workload,
    make_batches,
    reference_tables,
    timed,
)
from demb_torchrec.options import DynamicEmbTableOptions

__all__ = ["TiersCheckError", "TiersWorkload", "row_bytes", "run"]

_GRAD = 1e-3
_TARGET = 2.0
_ROWS = 3_355_443  # a table's rows at scale 1: 10 tables, 32M rows in all
_IDS = 1_048_576  # ids a step at scale 1, over the 10 tables

Batch = tuple[torch.Tensor, torch.Tensor]


class TiersCheckError(RuntimeError):
    """A mode whose work was not what it should be: tables that evicted, grew or lost keys, or
    cache counts that do not add up to the steps' unique ids."""


@dataclass(frozen=True)
class TiersWorkload:
    """The issue's workload at ``scale``: ``steps`` timed steps a mode after ``warmup``
    untimed ones; caches of each of ``ratios`` x a table step's unique ids."""

    scale: float = 1.0
    optimizer: str = "adam"
    steps: int = 20
    warmup: int = 5
    seed: int = 0
    ratios: tuple[float, ...] = (1.0, 0.8)
    copy_iters: int = 10
    """Copies of each direction timed for the floor (the fastest counts)."""
    prefetch_ratio: float | None = 1.0
    """The cache ratio of the two prefetch modes (None: no prefetch modes)."""
    tables: int = 10
    dim: int = 128
    alpha: float = 1.05

    def __post_init__(self) -> None:
        check_counts(self, "steps", "copy_iters", "tables", "dim")
        check_counts(self, "warmup", minimum=0)
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale={self.scale!r}: must be a finite number > 0")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r}: must be 'adam' or 'sgd'")
        if not self.ratios or not all(r > 0 and math.isfinite(r) for r in self.ratios):
            raise ValueError(f"ratios={self.ratios!r}: must be finite numbers > 0")
        p = self.prefetch_ratio
        if p is not None and not (p > 0 and math.isfinite(p)):
            raise ValueError(f"prefetch_ratio={p!r}: must be a finite number > 0 or None")

    @property
    def reference(self) -> Workload:
        """The shape at ``scale``: rows a table and ids a table a step (NONE pooling)."""
        return Workload(
            tables=self.tables,
            dim=self.dim,
            rows=max(1, round(_ROWS * self.scale)),
            samples=max(1, round(_IDS * self.scale / self.tables)),
            alpha=self.alpha,
            pooling="none",
            optimizer=self.optimizer,
        )

    @property
    def max_capacity(self) -> int:
        """A table's slots at most: a power of two >= 2 x its rows (at least a bucket)."""
        return self.reference.spare_capacity


def _power_of_two(at_least: int) -> int:
    return max(BUCKET, 1 << max(0, at_least - 1).bit_length())


def row_bytes(dim: int, optimizer: str) -> int:
    """Bytes of a float32 value row (embedding and optimizer state), as the module lays it."""
    probe = DynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=dim, max_capacity=BUCKET)], device="cpu", optimizer=optimizer
    )
    return int(probe.tables.values[0].shape[1]) * probe.tables.values[0].element_size()


class _Keys:
    """What the batches hold, per table: each batch's unique ids and the distinct ids of all."""

    def __init__(self, ref: Workload, batches: list[Batch]) -> None:
        per_batch = [b[0].view(ref.tables, ref.samples).cpu() for b in batches]
        self.unique = [
            [int(torch.unique(p[t]).numel()) for t in range(ref.tables)] for p in per_batch
        ]
        """Per batch, each table's unique ids."""
        self.distinct = [
            int(torch.unique(torch.cat([p[t] for p in per_batch])).numel())
            for t in range(ref.tables)
        ]
        """Per table, its distinct ids in all the batches."""


def _build(
    w: TiersWorkload, device: torch.device, init: int, budget: int | None, caching: bool
) -> DynamicEmbeddingTables:
    """The workload's tables: all-device (``budget`` None), caching with ``budget`` bytes, or
    hybrid (``caching`` False) with ``budget`` bytes of device rows."""
    options: dict[str, Any] = {"init_capacity": init, "caching": caching}
    if budget is not None:  # else every value row on the device
        options["local_hbm_for_values"] = budget
    return reference_tables(w.reference, device, w.max_capacity, options)


def _time(
    model: DynamicEmbeddingTables,
    batches: list[Batch],
    w: TiersWorkload,
    device: torch.device,
    prefetch: str | None = None,
) -> tuple[list[float], list[float], dict[str, int], list[float]]:
    """Warm-up, then the timed train steps and eval forwards; the cache counts of the timed
    train steps (summed over the tables). ``prefetch``: each step also prefetches the next
    batch, ``"overlapped"`` between its forward and its backward, ``"serial"`` after its
    backward, timed on its own (the fourth list: those timings; the last step has no next
    batch)."""
    ref = w.reference
    grad = torch.full((ref.tables * ref.samples, ref.dim), _GRAD, device=device)
    alone: list[float] = []

    def step(batch: Batch, after: Batch | None = None) -> None:
        out = model(*batch)
        if after is not None and prefetch == "overlapped":
            model.prefetch(*after)
        torch.autograd.backward([out], [grad])
        if after is not None and prefetch == "serial":
            alone.append(timed(partial(model.prefetch, *after), device))

    def lookup(batch: Batch) -> None:
        with torch.no_grad():
            model(*batch)

    nexts: list[Batch | None] = [*batches[1:], None] if prefetch else [None] * len(batches)
    model.train()
    for batch, after in zip(batches[: w.warmup], nexts, strict=False):
        step(batch, after)
    timed_batches = batches[w.warmup :]
    model.eval()
    lookup(timed_batches[0])  # (it takes what the last warm-up step prefetched)
    model.train()
    if prefetch:
        model.prefetch(*timed_batches[0])
    model.cache_stats()  # the warm-up's counts
    alone.clear()
    train = [
        timed(partial(step, b, a), device)
        for b, a in zip(timed_batches, nexts[w.warmup :], strict=True)
    ]
    counted: dict[str, int] = {}
    for per_table in model.cache_stats().values():
        for name, n in per_table.items():
            counted[name] = counted.get(name, 0) + n
    model.eval()
    evals = [timed(partial(lookup, b), device) for b in timed_batches]
    model.train()
    return train, evals, counted, alone


def _held(model: DynamicEmbeddingTables) -> list[int]:
    """Per table, the keys in the module: its cache and, for a caching table, its storage."""
    held = [model.tables.size(t) for t in range(model.num_tables)]
    if model.cache is not None:
        model.cache.settle()
        for t, below in enumerate(model.cache.below):
            if below is not None:
                held[t] += below.storage.size(below.table_id)
    return held


def _host_rows(model: DynamicEmbeddingTables, batches: list[Batch], device_rows: int) -> float:
    """The rows past ``device_rows`` (in host memory) a timed batch touches, on average: each
    batch's unique keys found at their slots (the tables neither grew nor evicted)."""
    ref_tables = model.num_tables
    total = 0
    for indices, _ in batches:
        per_table = indices.view(ref_tables, -1)
        for t in range(ref_tables):
            unique = torch.unique(per_table[t])
            slots = model.tables.find(unique, torch.full_like(unique, t))
            total += int((slots >= device_rows).sum())
    return total / len(batches)


def _mode(
    name: str,
    w: TiersWorkload,
    device: torch.device,
    batches: list[Batch],
    keys: _Keys,
    init: int,
    budget: int | None,
    row: int,
    caching: bool = True,
    prefetch: str | None = None,
) -> dict[str, Any]:
    """Build, time and check one mode; its entry of the report (the module freed after).
    ``prefetch``: as :func:`_time`."""
    caching = caching and budget is not None
    model = _build(w, device, init, budget, caching)
    train, evals, counted, alone = _time(model, batches, w, device, prefetch)
    held = _held(model)
    if held != keys.distinct:
        raise TiersCheckError(
            f"{name}: the tables held {held} keys after the run, not the {keys.distinct} "
            "distinct ids of their batches (a key was evicted or lost)"
        )
    kind = "caching" if caching else "all-device" if budget is None else "hybrid"
    out: dict[str, Any] = {
        "mode": name,
        "kind": kind,
        "caching": caching,
        "steps": w.steps,
        "step": stats(train),
        "eval": stats(evals),
        "keys_held": held,
    }
    if prefetch is not None:
        out.update(prefetch=prefetch, prefetch_alone=stats(alone) if alone else None)
    if not caching:
        grown = [model.tables.capacity(t) for t in range(model.num_tables)]
        if any(c != init for c in grown):
            raise TiersCheckError(f"{name}: the tables grew to {grown} slots from {init}")
        out["capacity"] = grown
    if kind == "hybrid":
        assert budget is not None
        rows = model.tables.configs[0].device_rows
        if rows is None:
            raise TiersCheckError(f"{name}: a budget of {budget} B built an all-device table")
        touched = _host_rows(model, batches[w.warmup :], rows)
        moved = round(touched * row)  # read (host to device) and written back
        out.update(
            budget_bytes=budget,
            device_rows=rows,
            host_rows_per_step=touched,
            bytes_per_step=2 * moved,
            floor=copy_floor(moved, moved, device, w.copy_iters),
        )
    elif caching:
        unique = sum(sum(u) for u in keys.unique[w.warmup :])
        looked = counted["cache_hits"] + counted["storage_hits"] + counted["misses"]
        if looked != unique:
            raise TiersCheckError(
                f"{name}: {looked} keys counted as cache hits, storage hits or new, not the "
                f"{unique} unique ids of the timed steps"
            )
        h2d = round(counted["storage_hits"] * row / w.steps)
        d2h = round(counted["write_backs"] * row / w.steps)
        out.update(
            budget_bytes=budget,
            cache_rows=[model.tables.capacity(t) for t in range(model.num_tables)],
            value_buffer_rows=[int(v.shape[0]) for v in model.tables.values],
            cache_stats=counted,
            rows_crossed_per_step=(counted["storage_hits"] + counted["write_backs"]) / w.steps,
            bytes_per_step=h2d + d2h,
            floor=copy_floor(h2d, d2h, device, w.copy_iters),
        )
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _figures(modes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per caching mode: its step beside the copy floor (target) and beside the all-device
    step, its eval beside the all-device eval (no target)."""
    base = modes[0]
    out = []
    for m in modes[1:]:
        crossed = (
            "(storage hits + write-backs) x row bytes"
            if m["kind"] == "caching"
            else "the touched rows in host memory, read and written"
        )
        floor = figure(
            f"{m['mode']}: train step",
            m["step"]["seconds"],
            f"copy floor: {m['floor']['what']} of the rows that crossed a step ({crossed})",
            [m["floor"]["seconds"]],
            _TARGET,
            m["bytes_per_step"],
            unit="s/step",
        )
        m["floor_figure"] = floor
        out.append(floor)
        for what in ("step", "eval"):
            label = "train step" if what == "step" else "eval forward"
            out.append(
                figure(
                    f"{m['mode']}: {label} vs all-device",
                    m[what]["seconds"],
                    f"all-device {label} (caching=False), same batches",
                    base[what]["seconds"],
                    None,
                    None,
                    unit="s/step" if what == "step" else "s/forward",
                )
            )
    return out


def run(w: TiersWorkload, device: torch.device) -> dict[str, Any]:
    """Time every mode on ``device``; print the table and return the report.

    Raises:
        TiersCheckError: a mode whose work was not what it should be (see the module).
    """
    torch.manual_seed(w.seed)
    ref = w.reference
    batches = make_batches(ref, w.warmup + w.steps, device, w.seed)
    keys = _Keys(ref, batches)
    unique = statistics.fmean(u for per_batch in keys.unique for u in per_batch)
    init = min(w.max_capacity, _power_of_two(2 * max(keys.distinct)))
    row = row_bytes(ref.dim, ref.optimizer)
    modes = [_mode("all-device", w, device, batches, keys, init, None, row)]
    for ratio in w.ratios:
        budget = math.ceil(ratio * unique) * row
        modes.append(
            _mode(f"caching {float(ratio)!r}", w, device, batches, keys, init, budget, row)
        )
    if w.prefetch_ratio is not None:
        budget = math.ceil(w.prefetch_ratio * unique) * row
        for how in PREFETCH_MODES:
            name = f"caching {float(w.prefetch_ratio)!r}, prefetch {how}"
            mode = _mode(name, w, device, batches, keys, init, budget, row, prefetch=how)
            modes.append(mode)
    tenth = math.ceil(init / 10) * row  # a tenth of the value bytes; then none
    for name, budget in zip(HYBRID_MODES, (tenth, 0), strict=True):
        modes.append(_mode(name, w, device, batches, keys, init, budget, row, caching=False))
    figures = _figures(modes)
    figures += prefetch_figures(modes, device)
    report: dict[str, Any] = {
        "benchmark": "tiers",
        "device": str(device),
        "machine": machine_info(device),
        "workload": {
            **asdict(w),
            "rows": ref.rows,
            "samples": ref.samples,
            "ids_per_step": ref.tables * ref.samples,
            "pooling": "none",
            "max_capacity": w.max_capacity,
            "init_capacity": init,
            "bucket_capacity": BUCKET,
            "row_bytes": row,
            "unique_keys_per_table_step": unique,
            "distinct_keys_per_table": keys.distinct,
        },
        "modes": modes,
        "figures": figures,
        "published": PUBLISHED,
        "ratio": "figure median / baseline median (seconds); a caching mode's train step beside "
        f"its copy floor (target <= {_TARGET:g}x) and beside the all-device step and eval",
    }
    print_report(report)
    return report
