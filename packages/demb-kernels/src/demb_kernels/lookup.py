"""The ops of a table module step: its batch deduplicated per table (``csrc/dedup.cpp``) and
its two row ops (``csrc/lookup_rule.h``).

``gather_table_rows`` reads, for every occurrence of a batch, its key's row straight from the
key's table (several tables in one launch), as float32. ``segment_sum_rows`` sums the gradient
rows of each unique key in a fixed order (chunks of 32 rows, then the chunks), so a hot key's
many occurrences spread over many warps without atomics and every device gives the same float.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)

__all__ = [
    "MAX_GATHER_TABLES",
    "SEGMENT_CHUNK",
    "WINDOW_MAX_DIM",
    "DedupOutput",
    "check_batch",
    "dedup_batch",
    "gather_table_rows",
    "index_tables",
    "plan_differs",
    "segment_plan",
    "segment_single_rows",
    "segment_sum_rows",
    "status_count_tensor",
    "status_counts",
    "sums_need_plan",
]

MAX_GATHER_TABLES = 64
"""The most tables one ``gather_table_rows`` call takes."""

_BATCH_CHECK_WORDS = 6
"""The batch checks index_tables and dedup_batch read back (kDedupFlags in dedup_checks.h)."""

SEGMENT_CHUNK = 32
"""Rows a chunk of ``segment_sum_rows`` sums before the chunks are added."""

WINDOW_MAX_DIM = 128
"""The widest gradient rows that ``segment_sum_rows`` on CUDA sums by windows of ``order`` (one
warp per 32 entries, the chunks that start there), with no plan."""


def sums_need_plan(dim: int) -> bool:
    """Whether ``segment_sum_rows`` on CUDA cuts gradient rows of ``dim`` floats by a
    :func:`segment_plan`; False: by windows of ``order`` (``dim`` a multiple of 4 up to
    :data:`WINDOW_MAX_DIM`, the gradients 16-byte aligned, as a fresh tensor is), a plan given
    to it unread. The sums are the same floats either way."""
    return dim % 4 != 0 or dim > WINDOW_MAX_DIM


class DedupOutput(NamedTuple):
    """A batch's unique (table, key) pairs (:func:`dedup_batch`)."""

    keys: torch.Tensor
    """``(U,)`` int64 unique keys, sorted by table, then key."""
    tables: torch.Tensor
    """``(U,)`` int64 table of each unique key."""
    inverse: torch.Tensor
    """``(N,)`` int64 position in ``keys`` of each index."""
    counts: torch.Tensor
    """``(U,)`` int64 occurrences of each unique key (or its summed frequency counters)."""
    order: torch.Tensor
    """``(N,)`` int64 index positions sorted by (table, key), stable."""
    starts: torch.Tensor
    """``(U,)`` int64 where each unique key's occurrences start in ``order``."""
    bounds: torch.Tensor
    """``(T + 1 + F + 1,)`` int64 on the CPU: where each table's unique keys start (and the
    end), then ``offsets[::B]``."""
    key_bits: int
    """How many low bits the batch's keys differ in (a good ``key_bits`` for the next
    batch)."""


def dedup_batch(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    num_tables: int,
    batch_size: int,
    counters: torch.Tensor | None = None,
    key_bits: int = 64,
) -> DedupOutput:
    """Deduplicate a TBE-layout batch per table, with one host sync.

    Args:
        indices: ``(N,)`` int64 keys, feature-major.
        offsets: ``(F * B + 1,)`` int64 bag offsets into ``indices``.
        feature_tables: ``(F,)`` int64 table of each feature, in ``[0, num_tables)``.
        num_tables: ``T``.
        batch_size: ``B >= 1``.
        counters: ``(N,)`` int64 per-index counts summed into ``counts`` (default 1 each).
        key_bits: a guess, in ``[1, 64]``, of how many low bits the keys differ in: on CUDA
            the sort by key looks at those bits only (fewer radix passes), and when the keys
            turn out to differ in more it sorts again on all 64 (a second sync). The outputs
            never depend on it. Pass the previous batch's :attr:`DedupOutput.key_bits`.

    On CUDA the sort's scratch (56 bytes per index) is kept per stream for the last four batch
    sizes, and from a size's second batch on, its radix sort and scan replay from a CUDA graph
    (one launch instead of eight); not while the stream is being captured into a graph.

    Raises:
        ValueError: a -1 key, a negative counter, or offsets that do not start at 0, decrease,
            or do not end at ``N`` (checked before anything is returned).
    """
    rows, counts, bounds, bits = torch.ops.demb.dedup_batch(
        indices, offsets, feature_tables, num_tables, batch_size, counters, key_bits
    )
    u = counts.shape[0]
    inverse, order, keys, tables, starts = rows.unbind()  # one (5, N) buffer
    return DedupOutput(keys[:u], tables[:u], inverse, counts, order, starts[:u], bounds, int(bits))


def index_tables(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    num_tables: int,
    batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table of each index of a TBE-layout batch, and the batch's checks, without a sync.

    Args: as :func:`dedup_batch` (no counters).

    Returns:
        ``(N,)`` int64 table of each index (feature ``f`` owns ``[offsets[f * B], offsets[(f +
        1) * B])``; tables stay in range even for bad offsets), and the checks: a device int64
        tensor for :func:`check_batch` to read back.
    """
    tables, checks = torch.ops.demb.index_tables(
        indices, offsets, feature_tables, num_tables, batch_size
    )
    return tables, checks


def check_batch(checks: torch.Tensor, n: int, features: int) -> list[int]:
    """Read back (one sync) the checks of :func:`index_tables` for a batch of ``n`` indices and
    ``features`` features; returns ``offsets[::B]`` (``F + 1`` host ints).

    Raises:
        ValueError: as :func:`dedup_batch`.
    """
    bounds: torch.Tensor = torch.ops.demb.batch_bounds(checks.cpu(), n, 0, features)
    out: list[int] = bounds.tolist()[1:]
    return out


def status_counts(status: torch.Tensor, bounds: Sequence[int]) -> tuple[list[int], list[int]]:
    """Per table, the new rows (INSERTED or EVICTED) and the FAILED keys of a find_or_insert
    whose keys are grouped by table (table ``t``'s are ``[bounds[t], bounds[t + 1])``); one
    read-back.

    Args:
        status: ``(U,)`` int64 :class:`demb_kernels.table.InsertStatus` of each key.
        bounds: ``T + 1`` host offsets, from 0 to ``U``.
    """
    counts: list[list[int]] = status_count_tensor(status, bounds).tolist()
    return counts[0], counts[1]


def status_count_tensor(status: torch.Tensor, bounds: Sequence[int]) -> torch.Tensor:
    """:func:`status_counts` left on ``status``' device (no sync): ``(2, T)`` int64, row 0 the
    new rows per table, row 1 the FAILED keys."""
    counts: torch.Tensor = torch.ops.demb.status_counts(status, list(bounds))
    return counts


def gather_table_rows(
    values: Sequence[torch.Tensor],
    slots: torch.Tensor,
    tables: torch.Tensor,
    inverse: torch.Tensor | None,
    dim: int,
    *,
    check: bool = True,
) -> torch.Tensor:
    """``out[i] = values[tables[u]][slots[u], :dim]`` as float32, ``u = inverse[i]`` (or
    ``u = i`` without ``inverse``).

    Args:
        values: ``T <= 64`` contiguous ``(R_t, W_t >= dim)`` value buffers of one dtype
            (float32, float16 or bfloat16).
        slots: ``(U,)`` int64 row of each unique key, -1 for none (its rows read zeros).
        tables: ``(U,)`` int64 table of each unique key.
        inverse: ``(N,)`` int64 unique key of each output row, or None: one row per key
            (``N = U``).
        dim: columns to read.
        check: on CUDA, check ``inverse``, ``tables`` and ``slots`` ranges first (one sync);
            unchecked, an out-of-range entry reads zeros. The CPU kernel always checks.

    Returns:
        ``(N, dim)`` float32.
    """
    if check and slots.device.type != "cpu" and slots.numel():
        rows = torch.tensor([v.shape[0] for v in values], device=slots.device)
        bad_table = (tables < 0) | (tables >= len(values))
        bad_slot = (slots < -1) | (slots >= rows[tables.clamp(0, len(values) - 1)])
        bad_inverse = (
            torch.zeros((), dtype=torch.bool, device=slots.device)
            if inverse is None
            else ((inverse < 0) | (inverse >= slots.numel())).any()
        )
        flags = torch.stack([bad_table.any(), bad_slot.any(), bad_inverse]).tolist()
        for name, bad in zip(("tables", "slots", "inverse"), flags, strict=True):
            if bad:
                raise ValueError(f"{name}: out of range")
    out: torch.Tensor = torch.ops.demb.gather_table_rows(list(values), slots, tables, inverse, dim)
    return out


def segment_plan(starts: torch.Tensor, n: int) -> torch.Tensor:
    """The chunks :func:`segment_sum_rows` sums for ``starts`` over ``n`` rows, made ahead of
    the sum (no sync): a training forward makes it while its gather runs, so its backward
    launches only the sums.

    Args:
        starts: ``(U,)`` int64 segment starts, as for :func:`segment_sum_rows`.
        n: ``N``, the rows (``order``'s length).

    Returns:
        ``(U + 1 + 3 * (U + N // 32 + 1),)`` int64 on ``starts``' device (``PlanLayout`` in
        ``csrc/lookup_rule.h``): each segment's first chunk, then each chunk's first row in
        ``order``, its length and where its sum goes. The CPU kernel checks ``starts``; on
        CUDA :func:`segment_sum_rows`' ``check`` does.
    """
    plan: torch.Tensor = torch.ops.demb.segment_plan(starts, n)
    return plan


def plan_differs(plan: torch.Tensor, starts: torch.Tensor, n: int) -> torch.Tensor:
    """A ``()`` bool on ``starts``' device (no sync): whether ``plan`` is not
    :func:`segment_plan` ``(starts, n)`` (its live entries: the chunk offsets and each existing
    chunk's columns). A plan of another dtype, device or size is left to the op's own error.
    """
    expected = segment_plan(starts, n)
    same_form = plan.dtype == expected.dtype and plan.device == expected.device
    if not same_form or plan.shape != expected.shape:
        return torch.zeros((), dtype=torch.bool, device=starts.device)
    u = starts.numel()
    heads = (plan[: u + 1] != expected[: u + 1]).any()
    columns = (plan[u + 1 :] != expected[u + 1 :]).view(3, -1)
    live = torch.arange(columns.shape[1], device=starts.device) < expected[u]
    return heads | (columns & live).any()


def segment_sum_rows(
    grads: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    *,
    plan: torch.Tensor | None = None,
    check: bool = True,
    rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    skip_single: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out[u]`` = the sum of ``grads[order[k]]`` for ``k`` in ``[starts[u], starts[u + 1])``
    (the last segment ends at ``N``), in chunks of :data:`SEGMENT_CHUNK` rows. With ``rows``
    and/or ``scale``, entry ``p = order[k]`` adds ``scale[p] * grads[rows[p]]`` instead (the
    product in float32, then the sum): a pooled output's gradient summed per unique key
    (``rows[p]``: the bag of occurrence ``p``; ``scale[p]``: its weight, or ``1 / bag size``
    for MEAN).

    Args:
        grads: ``(N, D)`` float32, or ``(R, D)`` with ``rows``.
        order: ``(N,)`` int64 a permutation of ``[0, N)`` (grouped by segment).
        starts: ``(U,)`` int64 segment starts in ``order``: 0 first, never decreasing.
        plan: :func:`segment_plan` ``(starts, N)`` made ahead (default: made here when
            needed: :func:`sums_need_plan`). The CPU kernel checks that it is; on CUDA
            ``check`` does (:func:`plan_differs`), and unchecked only its size is.
        check: on CUDA, check ``order``, ``starts`` and ``rows`` first (one sync); the CPU
            kernel always checks.
        rows: ``(N,)`` int64 the ``grads`` row of each entry (default: the entry's own).
        scale: ``(N,)`` float32 each entry's factor (default 1).
        skip_single: a segment of one entry is checked for NaN/inf but its row of ``out`` is
            not written (its content is unspecified): an update reads that gradient row where
            it is (:func:`segment_single_rows`). Only without ``rows`` and ``scale``.

    Returns:
        ``(U, D)`` float32 sums, and a ``()`` bool on their device (no sync): whether any sum
        (or, with ``skip_single``, skipped row) is NaN or infinite.
    """
    if check and grads.device.type != "cpu" and starts.numel():
        n = order.numel()
        no = torch.zeros((), dtype=torch.bool, device=grads.device)
        checks = [
            ((order < 0) | (order >= n)).any(),
            (starts[0] != 0) | (starts.diff() < 0).any() | (starts[-1] > n),
            no if plan is None else plan_differs(plan, starts, n),
            no if rows is None else ((rows < 0) | (rows >= grads.shape[0])).any(),
        ]
        flags = torch.stack(checks).tolist()
        if flags[0]:
            raise ValueError(f"order: out of range for {n} entries")
        if flags[1]:
            raise ValueError(f"starts: must begin at 0, never decrease and stay <= {n}")
        if flags[2]:
            raise ValueError(f"plan: not segment_plan(starts, {n}) of these starts")
        if flags[3]:
            raise ValueError(f"rows: out of range for {grads.shape[0]} grads rows")
    out, nonfinite = torch.ops.demb.segment_sum_rows(
        grads, order, starts, plan, rows, scale, skip_single
    )
    return out, nonfinite


def segment_single_rows(order: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """``(U,)`` int64: ``order[starts[u]]`` where segment ``u`` has one entry, else -1: the
    ``grads`` rows that :func:`segment_sum_rows` with ``skip_single`` leaves to an update
    (``demb::optimizer_update``'s ``grad_rows``). The CPU kernel checks ``starts`` as
    :func:`segment_sum_rows` does; the CUDA kernel writes -1 where a start is out of range.

    Args:
        order: ``(N,)`` int64 positions grouped by segment.
        starts: ``(U,)`` int64 segment starts in ``order`` (the last segment ends at ``N``).
    """
    rows: torch.Tensor = torch.ops.demb.segment_single_rows(order, starts)
    return rows


@torch.library.register_fake("demb::gather_table_rows")  # type: ignore[untyped-decorator]
def _gather_table_rows_fake(
    values: list[torch.Tensor],
    slots: torch.Tensor,
    tables: torch.Tensor,
    inverse: torch.Tensor | None,
    dim: int,
) -> torch.Tensor:
    rows = slots.shape[0] if inverse is None else inverse.shape[0]
    return slots.new_empty((rows, dim), dtype=torch.float32)


@torch.library.register_fake("demb::segment_plan")  # type: ignore[untyped-decorator]
def _segment_plan_fake(starts: torch.Tensor, n: int) -> torch.Tensor:
    u = starts.shape[0]
    return starts.new_empty((u + 1 + 3 * (u + n // SEGMENT_CHUNK + 1),))


@torch.library.register_fake("demb::segment_sum_rows")  # type: ignore[untyped-decorator]
def _segment_sum_rows_fake(
    grads: torch.Tensor,
    order: torch.Tensor,
    starts: torch.Tensor,
    plan: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    skip_single: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    flag = grads.new_empty((), dtype=torch.bool)
    return grads.new_empty((starts.shape[0], grads.shape[1])), flag


@torch.library.register_fake("demb::segment_single_rows")  # type: ignore[untyped-decorator]
def _segment_single_rows_fake(order: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    return starts.new_empty(starts.shape)


@torch.library.register_fake("demb::dedup_batch")  # type: ignore[untyped-decorator]
def _dedup_batch_fake(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    num_tables: int,
    *_: object,
    **__: object,
) -> tuple[torch.Tensor, ...]:
    unique = torch.library.get_ctx().new_dynamic_size()
    bounds = num_tables + 1 + feature_tables.shape[0] + 1
    return (
        indices.new_empty((5, indices.shape[0])),
        indices.new_empty((unique,)),
        torch.empty((bounds,), dtype=torch.int64, device="cpu"),
        torch.empty((), dtype=torch.int64, device="cpu"),
    )


@torch.library.register_fake("demb::index_tables")  # type: ignore[untyped-decorator]
def _index_tables_fake(
    indices: torch.Tensor, offsets: torch.Tensor, feature_tables: torch.Tensor, *_: int
) -> tuple[torch.Tensor, torch.Tensor]:
    checks = _BATCH_CHECK_WORDS + feature_tables.shape[0] + 1
    return indices.new_empty(indices.shape), indices.new_empty((checks,))


@torch.library.register_fake("demb::batch_bounds")  # type: ignore[untyped-decorator]
def _batch_bounds_fake(host: torch.Tensor, n: int, num_tables: int, features: int) -> torch.Tensor:
    return host.new_empty((num_tables + 1 + features + 1,))


@torch.library.register_fake("demb::status_counts")  # type: ignore[untyped-decorator]
def _status_counts_fake(status: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    return status.new_empty((2, len(bounds) - 1))
