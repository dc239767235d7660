"""The scored hash table's index and its ops (``demb::table_*``), as defined in docs/hash_table.md.

A :class:`TableIndex` holds ``T`` fused logical tables in plain tensors (keys, digests, score
words, per-table layout). The ops are the same algorithm on CPU (C++) and CUDA: fed the same
batches, a CPU index and a CUDA index end identical. Slots are table-local, in
``[0, capacity[t])``; they address the table's value rows (kept by demb-storage).

Keys and table ids are int64 (int32 accepted and widened); ``-1`` (:data:`EMPTY_KEY`) marks an
empty slot and is never a valid key. Bad arguments raise ``ValueError`` / ``TypeError`` naming
them; on CUDA the data checks (table ids in range, no empty key, counts >= 0) cost one
synchronizing reduction and can be skipped with ``check=False`` by callers that checked before
(the kernels then skip invalid entries: misses, or FAILED inserts).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from demb_kernels import (
    _fakes,  # noqa: F401  (registers the fake kernels)
    _library,  # noqa: F401  (loads the native ops)
)
from demb_kernels._table_index import (
    EMPTY_KEY,
    ExportResult,
    InsertResult,
    InsertStatus,
    ScorePolicy,
    TableIndex,
)

__all__ = [
    "EMPTY_KEY",
    "ExportResult",
    "FoundRows",
    "InsertResult",
    "InsertStatus",
    "RowGather",
    "ScorePolicy",
    "TableIndex",
    "as_batch",
    "clear",
    "erase",
    "export",
    "find",
    "find_batch_rows",
    "find_or_insert",
    "find_or_insert_rows",
    "find_rows",
    "insert_or_assign",
    "rehash",
    "timestamp",
]


def as_batch(
    index: TableIndex, keys: torch.Tensor, table_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``keys`` and ``table_ids`` of a batch for ``index``, as every op takes them.

    Raises:
        TypeError: a dtype other than int64 / int32 (the message names the tensor).
        ValueError: a tensor on another device than the index.
    """
    for name, t in (("keys", keys), ("table_ids", table_ids)):
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be int64 or int32, got {t.dtype}")
        if t.device != index.device:
            raise ValueError(f"{name} is on {t.device}, the index on {index.device}")
    return (
        keys if keys.dtype == torch.int64 else keys.to(torch.int64),
        table_ids if table_ids.dtype == torch.int64 else table_ids.to(torch.int64),
    )


def _checked(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    counts: torch.Tensor | None,
    check: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`as_batch`, then, when ``check``, the data checks: on CUDA all of them (one
    sync); on the CPU the empty key (the kernels check table ids and counts for free, and skip
    an entry of the empty key, as the CUDA kernels do: see :func:`find_or_insert`)."""
    keys, table_ids = as_batch(index, keys, table_ids)
    if check and keys.numel() > 0:
        if index.device.type == "cpu":
            empty = keys == EMPTY_KEY
            if bool(empty.any()):
                raise ValueError(
                    f"keys[{int(empty.nonzero()[0, 0])}] is -1, the empty-key sentinel, which "
                    "can never be a key"
                )
        else:
            _check_data(index, keys, table_ids, counts)
    return keys, table_ids


def _check_data(
    index: TableIndex, keys: torch.Tensor, table_ids: torch.Tensor, counts: torch.Tensor | None
) -> None:
    """Raises on a table id out of range, an empty key or a negative count."""
    flags = [
        ((table_ids < 0) | (table_ids >= index.num_tables)).any(),
        (keys == EMPTY_KEY).any(),
    ]
    if counts is not None:
        flags.append((counts < 0).any())
    bad = torch.stack(flags).tolist()
    if bad[0]:
        raise ValueError(f"table_ids: out of range for an index of {index.num_tables} tables")
    if bad[1]:
        raise ValueError("keys: contains -1, the empty-key sentinel, which can never be a key")
    if len(bad) > 2 and bad[2]:
        raise ValueError("counts: contains a negative count")


def find(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    score_args: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Slot of each key, optionally touching the keys found (updating their scores).

    Args:
        index: the index.
        keys: ``(N,)`` int64 keys.
        table_ids: ``(N,)`` int64 table of each key.
        score_args: ``(T,)`` int64 batch score per table; ``None`` leaves scores alone.
        counts: ``(N,)`` int64 frequency of each key for LFU words (default 1 each).
        check: check the data on CUDA (one sync).

    Returns:
        ``(N,)`` int64 table-local slots, -1 for keys not in the table.
    """
    keys, table_ids = _checked(index, keys, table_ids, counts, check)
    slots: torch.Tensor = torch.ops.demb.table_lookup(
        *index._tensors(), keys, table_ids, score_args, counts
    )
    return slots


def find_rows(
    index: TableIndex,
    values: list[torch.Tensor],
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    dim: int,
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each key's row, read where :func:`find` finds it (no score touched): a lookup and a
    gather in one pass (on CUDA, one launch).

    Args:
        index: the index.
        values: per table, its contiguous ``(R_t >= capacity_t, W_t >= dim)`` value rows, one
            float dtype (float32, float16 or bfloat16) for all.
        keys: ``(N,)`` int64 keys.
        table_ids: ``(N,)`` int64 table of each key.
        dim: columns to read.
        check: check the data on CUDA (one sync); unchecked, an invalid entry reads as missing.

    Returns:
        ``(N, dim)`` float32 rows (zeros for a missing key) and ``(N,)`` int64 table-local
        slots (-1 for a missing key).
    """
    keys, table_ids = _checked(index, keys, table_ids, None, check)
    rows, slots = torch.ops.demb.table_find_rows(
        *index._tensors(), list(values), keys, table_ids, dim
    )
    return rows, slots


def find_batch_rows(
    index: TableIndex,
    values: list[torch.Tensor],
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    batch_size: int,
    dim: int,
    *,
    check: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`find_rows` of a TBE-layout batch: each index's table is its feature's (feature
    ``f`` owns ``indices[offsets[f * B]:offsets[(f + 1) * B]]``), found in the same pass (on
    CUDA, one launch).

    Args:
        index: the index.
        values: as :func:`find_rows`.
        indices: ``(N,)`` int64 keys, feature-major.
        offsets: ``(F * B + 1,)`` int64 bag offsets.
        feature_tables: ``(F,)`` int64 table of each feature.
        batch_size: ``B`` (>= 1).
        dim: columns to read.
        check: check the batch's data (offsets start at 0, never decrease and end at ``N``;
            feature tables in range; no empty key) as :func:`demb_kernels.lookup.dedup_batch`
            does. On CUDA the checks run before the lookup and the host waits for them only,
            not for the lookup. Without it, on CUDA an index of a bad feature table, or an
            empty key, reads as missing (bad offsets only move indices between features); the
            CPU kernel raises on a table out of range.

    Raises:
        ValueError: a failed check, naming the argument.
    """
    rows, slots = torch.ops.demb.table_find_batch_rows(
        *index._tensors(), list(values), indices, offsets, feature_tables, batch_size, dim, check
    )
    return rows, slots


def find_or_insert(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    score_args: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    check: bool = True,
    wait: bool = True,
) -> InsertResult:
    """Find each key, inserting the missing ones (evicting in full buckets); see docs/hash_table.md.

    Keys present before the call are hits and are protected for the whole batch; missing keys
    are inserted bucket by bucket in batch order; duplicates map to one slot. No key of the
    batch evicts another key of the batch: a bucket with no unprotected slot left fails the
    insert (status FAILED, slot -1), as does a full NO_EVICTION bucket. A table that ranks its
    victims (:attr:`TableIndex.ranked`) evicts the lowest :attr:`TableIndex.victim_rank`
    instead of the lowest score words.

    On CUDA the op reads back whether any key missed (one sync, after the lookup pass) and,
    when every key was found, skips the insert pass's schedule (a sort of the whole batch).
    While the stream is captured into a CUDA graph, or with ``wait=False``, it does not sync
    and always runs both.

    An entry whose key is -1 (the empty key; only unchecked, ``check=False``) is skipped: slot
    -1, status FAILED, nothing in the index changes for it (a caller leaves entries out of a
    batch that way without compacting it, which on CUDA would sync). The same holds for
    :func:`find` (-1), :func:`erase` (-1) and :func:`insert_or_assign` (FAILED).

    Args:
        index: the index (mutated).
        keys: ``(N,)`` int64 keys.
        table_ids: ``(N,)`` int64 table of each key.
        score_args: ``(T,)`` int64 batch score per table.
        counts: ``(N,)`` int64 frequency of each key for LFU words (default 1 each).
        check: check the data on CUDA (one more sync).
        wait: on CUDA, wait for the lookup pass's all-found flag (one sync) to skip the insert
            pass when every key was found; False: no sync, the insert pass always runs (a batch
            that is expected to miss).

    Returns:
        :class:`InsertResult`.
    """
    return find_or_insert_rows(
        index, keys, table_ids, score_args, counts, check=check, wait=wait
    ).result


class RowGather(NamedTuple):
    """The rows :func:`find_or_insert_rows` reads when every key was found:
    :func:`demb_kernels.lookup.gather_table_rows` ``(values, slots, table_ids, inverse, dim)``."""

    values: list[torch.Tensor]
    """Per table, its ``(rows, width)`` value buffer on the index's device."""
    inverse: torch.Tensor
    """``(N_occ,)`` int64 the key (position in ``keys``) of each occurrence."""
    dim: int
    """The columns read, ``<=`` every table's width."""


class FoundRows(NamedTuple):
    """:func:`find_or_insert_rows`' outcome."""

    result: InsertResult
    all_hit: bool
    """Every status HIT: no row is new and none failed (False on CUDA while the stream is
    captured into a CUDA graph, where it is not known). A caller that initializes new rows can
    skip that work when True."""
    rows: torch.Tensor | None
    """With a :class:`RowGather`, when ``all_hit``: ``(N_occ, dim)`` float32 rows; else None
    (new rows are not initialized yet: the caller gathers after that)."""


def find_or_insert_rows(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    score_args: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    gather: RowGather | None = None,
    check: bool = True,
    wait: bool = True,
) -> FoundRows:
    """:func:`find_or_insert`, whether every key was found and, with ``gather``, when every
    key was found, each occurrence's row. On CUDA that gather is queued behind the lookup pass
    before the op waits for its flag, so the rows are being read while the host learns whether
    they are the right ones.

    Args:
        index, keys, table_ids, score_args, counts, check, wait: as :func:`find_or_insert`.
        gather: the rows to read (:class:`RowGather`), or None (needs ``wait``: the rows are
            kept only when the flag says every key was found).

    Returns:
        :class:`FoundRows`.

    Raises:
        ValueError / TypeError: bad keys, values, inverse or dim, or victim ranks of the wrong
            size (:attr:`TableIndex.victim_rank`), before the index changes.
    """
    keys, table_ids = _checked(index, keys, table_ids, counts, check)
    ranks = index._ranks()
    tensors = (*index._tensors(), index.sizes, keys, table_ids, score_args, counts)
    if gather is None:
        *out, all_hit = torch.ops.demb.table_find_or_insert(*tensors, *ranks, wait)
        return FoundRows(InsertResult(*out), bool(all_hit), None)
    if not wait:
        raise ValueError("find_or_insert_rows: a gather needs wait=True (its all-found flag)")
    values, inverse, dim = gather
    *out, hit, rows = torch.ops.demb.table_find_or_insert_rows(
        *tensors, values, inverse, dim, *ranks
    )
    all_hit = bool(hit)
    return FoundRows(InsertResult(*out), all_hit, rows if all_hit else None)


def insert_or_assign(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    scores: torch.Tensor,
    *,
    check: bool = True,
) -> InsertResult:
    """Insert each key or overwrite its scores, bucket by bucket in batch order (evicting as
    :func:`find_or_insert` does: the lowest score words, or victim rank where the table ranks).

    Args:
        index: the index (mutated).
        keys: ``(N,)`` int64 keys.
        table_ids: ``(N,)`` int64 table of each key.
        scores: ``(W, N)`` int64 score words to store (the last duplicate wins).
        check: check the data on CUDA (one sync).

    Returns:
        :class:`InsertResult`; present keys are HIT.
    """
    keys, table_ids = _checked(index, keys, table_ids, None, check)
    out = torch.ops.demb.table_insert_or_assign(
        *index._tensors(), index.sizes, keys, table_ids, scores, *index._ranks()
    )
    return InsertResult(*out)


def erase(
    index: TableIndex, keys: torch.Tensor, table_ids: torch.Tensor, *, check: bool = True
) -> torch.Tensor:
    """Remove keys from their tables.

    Args:
        index: the index (mutated).
        keys: ``(N,)`` int64 keys.
        table_ids: ``(N,)`` int64 table of each key.
        check: check the data on CUDA (one sync).

    Returns:
        ``(N,)`` int64 the freed slot of each erased key, -1 for absent keys and later
        duplicates.
    """
    keys, table_ids = _checked(index, keys, table_ids, None, check)
    freed: torch.Tensor = torch.ops.demb.table_erase(
        *index._tensors(), index.sizes, keys, table_ids
    )
    return freed


def export(
    index: TableIndex,
    table_id: int,
    begin: int = 0,
    end: int | None = None,
    min_score: int | None = None,
    score_word: int = 0,
) -> ExportResult:
    """Occupied slots of table ``table_id`` in the slot range ``[begin, end)``.

    Args:
        index: the index.
        table_id: which table.
        begin: first table-local slot.
        end: one past the last slot (default: the table's capacity).
        min_score: keep only slots whose ``score_word`` is ``>= min_score`` (incremental dumps).
        score_word: which score word ``min_score`` filters on.

    Returns:
        :class:`ExportResult` in ascending slot order.
    """
    lo, hi = index.slot_range(table_id)
    cap = hi - lo
    stop = cap if end is None else end
    if not 0 <= begin <= stop <= cap:
        raise ValueError(f"slot range [{begin}, {end}): must lie in [0, {cap}]")
    if not 0 <= score_word < index.score_words:
        raise ValueError(f"score_word={score_word}: the index has {index.score_words} words")
    keys = index.keys[lo + begin : lo + stop]
    scores = index.scores[:, lo + begin : lo + stop]
    mask = keys != EMPTY_KEY
    if min_score is not None:
        mask &= scores[score_word] >= min_score
    pos = mask.nonzero().squeeze(1)
    return ExportResult(keys[pos], scores[:, pos], pos + begin)


def clear(index: TableIndex, table_id: int | None = None) -> None:
    """Empty one table (or all of them) in place."""
    tables = range(index.num_tables) if table_id is None else [table_id]
    for t in tables:
        lo, hi = index.slot_range(t)
        index.keys[lo:hi] = EMPTY_KEY
        index.digests[lo:hi] = 0
        index.scores[:, lo:hi] = 0
        index.sizes[t] = 0


def rehash(
    index: TableIndex, table_id: int, new_capacity: int
) -> tuple[TableIndex, torch.Tensor, torch.Tensor]:
    """A new index where table ``table_id`` has ``new_capacity`` slots and all its keys.

    The keys are re-inserted with their scores in ascending old-slot order; the other tables
    are copied unchanged (their victim ranks too; table ``table_id``'s are zero: its caller
    sets them again before an op that may evict). Doubling the capacity can never overflow a
    bucket.

    Args:
        index: the index (unchanged).
        table_id: the table to resize.
        new_capacity: its new slot count, a multiple of its bucket width.

    Returns:
        ``(new_index, old_slots, new_slots)``: ``(n,)`` int64 each; the row of old slot
        ``old_slots[i]`` belongs at ``new_slots[i]``.

    Raises:
        ValueError: ``new_capacity`` is invalid, or too small to hold every key.
    """
    lo, hi = index.slot_range(table_id)
    capacities = list(index.capacities)
    capacities[table_id] = new_capacity
    new = TableIndex.create(
        capacities,
        index.bucket_width_list,
        index.policy_list,
        index.device,
        score_words=index.score_words,
        ranked=index.ranked_list or None,
    )
    copy_ranks = index.ranks_victims and index.victim_rank.numel() == index.keys.numel()
    for t in range(index.num_tables):
        if t == table_id:
            continue
        src, dst = index.slot_range(t), new.slot_range(t)
        new.keys[dst[0] : dst[1]] = index.keys[src[0] : src[1]]
        new.digests[dst[0] : dst[1]] = index.digests[src[0] : src[1]]
        new.scores[:, dst[0] : dst[1]] = index.scores[:, src[0] : src[1]]
        if copy_ranks:
            new.victim_rank[dst[0] : dst[1]] = index.victim_rank[src[0] : src[1]]
    new.sizes.copy_(index.sizes)
    new.sizes[table_id] = 0
    moved = export(index, table_id)
    ids = torch.full_like(moved.keys, table_id)
    result = insert_or_assign(new, moved.keys, ids, moved.scores, check=False)
    if bool((result.status != InsertStatus.INSERTED).any()):
        raise ValueError(
            f"new_capacity={new_capacity}: table {table_id}'s {moved.keys.numel()} keys do not "
            f"all fit (capacity was {hi - lo})"
        )
    return new, moved.slots, result.slots


def timestamp(device: torch.device | str | torch.Tensor, count: int = 1) -> torch.Tensor:
    """``(count,)`` int64 nanoseconds now, one reading in every element: the device's global
    timer on CUDA, a monotonic clock on the CPU. Stays on the device (no sync).

    Args:
        device: the device, or any tensor on it (saves making one).
        count: copies of the reading.

    Raises:
        ValueError: ``count`` < 1.
    """
    like = device if isinstance(device, torch.Tensor) else torch.empty(0, device=device)
    now: torch.Tensor = torch.ops.demb.table_timestamp(like, count)
    return now
