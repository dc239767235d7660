"""The reference workload of ``demb bench module``: its shape, its batches, the
bytes a step must move, and the device's copy bandwidth."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.capacity import get_table_value_bytes
from demb_torchrec.options import DynamicEmbPoolingMode, DynamicEmbTableOptions

__all__ = [
    "BUCKET",
    "Workload",
    "all_on_device",
    "floor_bytes",
    "make_batches",
    "power_law_ids",
    "reference_tables",
    "timed",
]


BUCKET = 128
"""Slots per bucket of the benchmarks' tables (:func:`reference_tables`)."""


@dataclass(frozen=True)
class _Shape:
    """What :func:`~demb_torchrec.get_table_value_bytes` reads of a table's config."""

    num_embeddings: int
    embedding_dim: int


def all_on_device(dim: int, capacity: int, optimizer: str, bucket_capacity: int = BUCKET) -> int:
    """The ``local_hbm_for_values`` (bytes) that keeps every value row of an unplanned table
    of ``capacity`` slots, ``dim`` fp32 columns and ``optimizer``'s state in device memory (a
    budget of 0 keeps none there): the spec's sizing helper for one rank."""
    return get_table_value_bytes(_Shape(capacity, dim), optimizer, 1, bucket_capacity)


def reference_tables(
    ref: Workload,
    device: torch.device,
    capacity: int,
    options: dict[str, Any] | None = None,
    *,
    seed: int = 0,
) -> DynamicEmbeddingTables:
    """The reference workload's ``ref.tables`` tables of ``ref.dim`` columns and ``capacity``
    slots (``max_capacity``) in buckets of :data:`BUCKET`, NONE pooling, ``ref.optimizer`` at
    learning rate 0.01 and initializer ``seed``: what the delta, retain, admission and tiers
    benchmarks build.
    ``options``: more ``DynamicEmbTableOptions`` fields, the same for every table; without a
    ``local_hbm_for_values`` every value row is in device memory (:func:`all_on_device`)."""
    options = {"local_hbm_for_values": all_on_device(ref.dim, capacity, ref.optimizer)} | (
        options or {}
    )
    tables = [
        DynamicEmbTableOptions(
            dim=ref.dim, max_capacity=capacity, bucket_capacity=BUCKET, **options
        )
        for _ in range(ref.tables)
    ]
    return DynamicEmbeddingTables(
        tables,
        pooling_mode=DynamicEmbPoolingMode.NONE,
        device=device,
        optimizer=ref.optimizer,
        seed=seed,
        learning_rate=0.01,
    )


@dataclass(frozen=True)
class Workload:
    """10 tables of 1,677,721 pre-filled fp32 rows of D=128; per table 104,857 samples of one
    id each (NONE pooling: 1,048,570 lookups a step) or bags of 1-10 ids (SUM), ids drawn from
    a power law with exponent ``alpha`` over each table's rows. ``check_gradients`` is the
    module's option: False skips the NaN/inf check before each update (the reference system has
    none)."""

    tables: int = 10
    dim: int = 128
    rows: int = 1_677_721
    samples: int = 104_857
    alpha: float = 1.05
    pooling: str = "none"
    max_bag: int = 10
    optimizer: str = "adam"
    check_gradients: bool = True

    def scaled(self, scale: float) -> Workload:
        """Rows and samples times ``scale`` (tables, dim and the rest unchanged)."""
        return replace(
            self,
            rows=max(1, round(self.rows * scale)),
            samples=max(1, round(self.samples * scale)),
        )

    @property
    def spare_capacity(self) -> int:
        """Slots a table of ``rows`` keys gets at load factor <= 0.5: a power of two, at least
        one bucket of 128."""
        return _power_of_two(2 * self.rows)

    @property
    def evicting_capacity(self) -> int:
        """Slots a table gets that every step evicts from: a power of two (at least one bucket
        of 128) of at least half a step's ids of a table, fewer than the distinct ids of a step
        or two."""
        return _power_of_two(self.samples // 2)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _power_of_two(at_least: int, bucket: int = 128) -> int:
    """The smallest power of two ``>= at_least`` and ``>= bucket``."""
    cap = bucket
    while cap < at_least:
        cap *= 2
    return cap


def power_law_ids(gen: torch.Generator, n: int, rows: int, alpha: float) -> torch.Tensor:
    """``(n,)`` int64 ids in ``[0, rows)``: rank ``r`` (1-based) drawn with probability
    ``~ r^-alpha`` (inverse CDF of the continuous power law on ``[1, rows + 1)``), then
    scattered over the rows by a fixed odd multiplier so hot ids are not adjacent."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    a = 1.0 - alpha
    top = float(rows + 1) ** a
    rank = ((top - 1.0) * u + 1.0) ** (1.0 / a)
    rank = rank.floor().to(torch.int64).clamp(1, rows) - 1
    ids: torch.Tensor = (rank * 2_654_435_761) % rows
    return ids


def make_batches(
    w: Workload, count: int, device: torch.device, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` batches ``(indices, offsets)`` in the module's layout (feature-major)."""
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        if w.pooling == "none":
            lengths = torch.ones(w.tables * w.samples, dtype=torch.int64)
        else:
            lengths = torch.randint(1, w.max_bag + 1, (w.tables * w.samples,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        per_table = lengths.view(w.tables, w.samples).sum(1).tolist()
        indices = torch.cat([power_law_ids(gen, n, w.rows, w.alpha) for n in per_table])
        batches.append((indices.to(device), offsets.to(device)))
    return batches


def floor_bytes(w: Workload, lookups: int, unique: int, state_dim: int, train: bool) -> int:
    """Bytes a step cannot avoid moving: the ids, each unique row read, the output written;
    training also reads the output gradient and reads and writes each unique row with its
    optimizer state."""
    row = w.dim * 4
    out_rows = lookups if w.pooling == "none" else w.samples * w.tables
    moved = lookups * 8 + unique * row + out_rows * row
    if train:
        moved += out_rows * row + 2 * unique * (w.dim + state_dim) * 4
    return moved


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn`` takes, synchronizing the device before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
