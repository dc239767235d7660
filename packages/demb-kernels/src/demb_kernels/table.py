"""The scored hash table's index and its ops (``demb::table_*``), as defined in HASH_TABLE.md.

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

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)

__all__ = [
    "BUCKET_WIDTH_ALIGNMENT",
    "EMPTY_KEY",
    "ExportResult",
    "InsertResult",
    "InsertStatus",
    "ScorePolicy",
    "TableIndex",
    "clear",
    "erase",
    "export",
    "find_or_insert",
    "insert_or_assign",
    "lookup",
    "rehash",
    "timestamp",
]

EMPTY_KEY = -1
"""The key of an empty slot (all ones); never a valid key."""

BUCKET_WIDTH_ALIGNMENT = 16
"""Bucket widths are multiples of this (demb_planner.BUCKET_ALIGNMENT)."""

_MAX_BUCKET_WIDTH = 2**31 - 1


class ScorePolicy(enum.IntEnum):
    """How a table scores the keys a batch touches (see HASH_TABLE.md)."""

    TIMESTAMP = 0
    """Score = the batch's timestamp (``score_args[t]``)."""
    STEP = 1
    """Score = the table's step (``score_args[t]``)."""
    CUSTOMIZED = 2
    """Score = the caller's score (``score_args[t]``)."""
    LFU = 3
    """Score = accumulated frequency (``counts``, 1 per occurrence by default)."""
    NO_EVICTION = 4
    """Score = the batch's timestamp; full buckets never evict (the insert fails)."""
    TIMESTAMP_LFU = 5
    """Two words ``[frequency, timestamp]``: evicts the least frequent, then the oldest."""


class InsertStatus(enum.IntEnum):
    """Per-key outcome of :func:`find_or_insert` and :func:`insert_or_assign`."""

    HIT = 0
    INSERTED = 1
    EVICTED = 2
    FAILED = 3


class InsertResult(NamedTuple):
    """Per-key results of :func:`find_or_insert` / :func:`insert_or_assign`."""

    slots: torch.Tensor
    """``(N,)`` int64 table-local slot, -1 where the insert failed."""
    status: torch.Tensor
    """``(N,)`` int64 :class:`InsertStatus`."""
    victim_keys: torch.Tensor
    """``(N,)`` int64 the key evicted for key ``i`` (status EVICTED), else -1."""
    victim_scores: torch.Tensor
    """``(W, N)`` int64 the evicted key's score words, else 0."""


class ExportResult(NamedTuple):
    """Occupied slots of one table (see :func:`export`), in ascending slot order."""

    keys: torch.Tensor
    """``(n,)`` int64."""
    scores: torch.Tensor
    """``(W, n)`` int64."""
    slots: torch.Tensor
    """``(n,)`` int64 table-local slots."""


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")
    return value


@dataclass
class TableIndex:
    """The index of ``T`` fused tables: plain tensors on one device (see HASH_TABLE.md).

    Build one with :meth:`create`. The ops mutate it in place, except :func:`rehash`, which
    returns a new one.
    """

    keys: torch.Tensor
    """``(S,)`` int64, :data:`EMPTY_KEY` in empty slots."""
    digests: torch.Tensor
    """``(S,)`` uint8, 0 in empty slots."""
    scores: torch.Tensor
    """``(W, S)`` int64 score words."""
    slot_offsets: torch.Tensor
    """``(T + 1,)`` int64: table ``t``'s global slots are ``[offsets[t], offsets[t + 1])``."""
    bucket_widths: torch.Tensor
    """``(T,)`` int64."""
    policies: torch.Tensor
    """``(T,)`` int64 :class:`ScorePolicy`."""
    sizes: torch.Tensor
    """``(T,)`` int64 occupied slots per table."""
    capacities: tuple[int, ...]
    """Slots per table (host copy)."""
    bucket_width_list: tuple[int, ...]
    """Bucket width per table (host copy)."""
    policy_list: tuple[ScorePolicy, ...]
    """Policy per table (host copy)."""

    @classmethod
    def create(
        cls,
        capacities: Sequence[int],
        bucket_widths: Sequence[int],
        policies: Sequence[ScorePolicy | int],
        device: torch.device | str = "cpu",
        score_words: int | None = None,
    ) -> TableIndex:
        """An empty index.

        Args:
            capacities: ``T`` slot counts, each a positive multiple of its bucket width.
            bucket_widths: ``T`` bucket widths, multiples of 16 (below ``2**31``).
            policies: ``T`` :class:`ScorePolicy` values.
            device: where the index lives.
            score_words: 1 or 2 score words per slot; default 2 when a policy is
                TIMESTAMP_LFU, else 1.

        Raises:
            ValueError: a capacity, bucket width, policy or ``score_words`` is invalid (the
                message names it).
        """
        if not (len(capacities) == len(bucket_widths) == len(policies) >= 1):
            raise ValueError(
                "capacities, bucket_widths and policies must have one entry per table (>= 1), "
                f"got {len(capacities)}, {len(bucket_widths)}, {len(policies)}"
            )
        parsed: list[ScorePolicy] = []
        per_table = zip(capacities, bucket_widths, policies, strict=True)
        for t, (cap, width, policy) in enumerate(per_table):
            _positive(f"bucket_widths[{t}]", width)
            _positive(f"capacities[{t}]", cap)
            if width % BUCKET_WIDTH_ALIGNMENT or width > _MAX_BUCKET_WIDTH:
                raise ValueError(
                    f"bucket_widths[{t}]={width}: must be a multiple of "
                    f"{BUCKET_WIDTH_ALIGNMENT} below 2**31"
                )
            if cap % width:
                raise ValueError(
                    f"capacities[{t}]={cap}: must be a multiple of its bucket width {width}"
                )
            try:
                parsed.append(ScorePolicy(policy))
            except ValueError:
                raise ValueError(f"policies[{t}]={policy!r}: not a ScorePolicy") from None
        needs_two = ScorePolicy.TIMESTAMP_LFU in parsed
        words = (2 if needs_two else 1) if score_words is None else score_words
        if words not in (1, 2) or (needs_two and words != 2):
            raise ValueError(
                f"score_words={score_words!r}: must be 1 or 2, and 2 with TIMESTAMP_LFU tables"
            )
        total = sum(capacities)
        dev = torch.device(device)
        offsets = [0]
        for cap in capacities:
            offsets.append(offsets[-1] + cap)
        i64 = torch.int64
        return cls(
            keys=torch.full((total,), EMPTY_KEY, dtype=i64, device=dev),
            digests=torch.zeros(total, dtype=torch.uint8, device=dev),
            scores=torch.zeros((words, total), dtype=i64, device=dev),
            slot_offsets=torch.tensor(offsets, dtype=i64, device=dev),
            bucket_widths=torch.tensor(list(bucket_widths), dtype=i64, device=dev),
            policies=torch.tensor([int(p) for p in parsed], dtype=i64, device=dev),
            sizes=torch.zeros(len(capacities), dtype=i64, device=dev),
            capacities=tuple(capacities),
            bucket_width_list=tuple(bucket_widths),
            policy_list=tuple(parsed),
        )

    @property
    def num_tables(self) -> int:
        """``T``."""
        return len(self.capacities)

    @property
    def score_words(self) -> int:
        """``W``, score words per slot."""
        return int(self.scores.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the index lives."""
        return self.keys.device

    def slot_range(self, table_id: int) -> tuple[int, int]:
        """Global slots ``[begin, end)`` of table ``table_id``."""
        if not 0 <= table_id < self.num_tables:
            raise ValueError(f"table_id={table_id}: out of range for {self.num_tables} tables")
        begin = sum(self.capacities[:table_id])
        return begin, begin + self.capacities[table_id]

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.keys,
            self.digests,
            self.scores,
            self.slot_offsets,
            self.bucket_widths,
            self.policies,
        )


def _batch(
    index: TableIndex, keys: torch.Tensor, table_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("keys", keys), ("table_ids", table_ids)):
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be int64 or int32, got {t.dtype}")
        if t.device != index.device:
            raise ValueError(f"{name} is on {t.device}, the index on {index.device}")
    return keys.to(torch.int64), table_ids.to(torch.int64)


def _check_data(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    counts: torch.Tensor | None,
    check: bool,
) -> None:
    """Data checks for non-CPU devices (the CPU kernels check for free)."""
    if not check or index.device.type == "cpu" or keys.numel() == 0:
        return
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


def lookup(
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
    keys, table_ids = _batch(index, keys, table_ids)
    _check_data(index, keys, table_ids, counts, check)
    slots: torch.Tensor = torch.ops.demb.table_lookup(
        *index._tensors(), keys, table_ids, score_args, counts
    )
    return slots


def find_or_insert(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    score_args: torch.Tensor,
    counts: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> InsertResult:
    """Find each key, inserting the missing ones (evicting in full buckets); see HASH_TABLE.md.

    Keys present before the call are hits and are protected for the whole batch; missing keys
    are inserted bucket by bucket in batch order; duplicates map to one slot. No key of the
    batch evicts another key of the batch: a bucket with no unprotected slot left fails the
    insert (status FAILED, slot -1), as does a full NO_EVICTION bucket.

    Args:
        index: the index (mutated).
        keys: ``(N,)`` int64 keys.
        table_ids: ``(N,)`` int64 table of each key.
        score_args: ``(T,)`` int64 batch score per table.
        counts: ``(N,)`` int64 frequency of each key for LFU words (default 1 each).
        check: check the data on CUDA (one sync).

    Returns:
        :class:`InsertResult`.
    """
    keys, table_ids = _batch(index, keys, table_ids)
    _check_data(index, keys, table_ids, counts, check)
    out = torch.ops.demb.table_find_or_insert(
        *index._tensors(), index.sizes, keys, table_ids, score_args, counts
    )
    return InsertResult(*out)


def insert_or_assign(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    scores: torch.Tensor,
    *,
    check: bool = True,
) -> InsertResult:
    """Insert each key or overwrite its scores, bucket by bucket in batch order.

    Args:
        index: the index (mutated).
        keys: ``(N,)`` int64 keys.
        table_ids: ``(N,)`` int64 table of each key.
        scores: ``(W, N)`` int64 score words to store (the last duplicate wins).
        check: check the data on CUDA (one sync).

    Returns:
        :class:`InsertResult`; present keys are HIT.
    """
    keys, table_ids = _batch(index, keys, table_ids)
    _check_data(index, keys, table_ids, None, check)
    out = torch.ops.demb.table_insert_or_assign(
        *index._tensors(), index.sizes, keys, table_ids, scores
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
    keys, table_ids = _batch(index, keys, table_ids)
    _check_data(index, keys, table_ids, None, check)
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
    are copied unchanged. Doubling the capacity can never overflow a bucket.

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
    )
    for t in range(index.num_tables):
        if t == table_id:
            continue
        src, dst = index.slot_range(t), new.slot_range(t)
        new.keys[dst[0] : dst[1]] = index.keys[src[0] : src[1]]
        new.digests[dst[0] : dst[1]] = index.digests[src[0] : src[1]]
        new.scores[:, dst[0] : dst[1]] = index.scores[:, src[0] : src[1]]
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


def timestamp(device: torch.device | str) -> torch.Tensor:
    """``(1,)`` int64 nanoseconds now: the device's global timer on CUDA, a monotonic clock on
    the CPU. Stays on the device (no sync)."""
    like = torch.empty(0, device=torch.device(device))
    now: torch.Tensor = torch.ops.demb.table_timestamp(like)
    return now


def _fake_insert(
    keys: torch.Tensor, words: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = keys.shape[0]
    return (
        keys.new_empty((n,)),
        keys.new_empty((n,)),
        keys.new_empty((n,)),
        keys.new_empty((words, n)),
    )


@torch.library.register_fake("demb::table_lookup")  # type: ignore[untyped-decorator]
def _lookup_fake(*args: torch.Tensor | None) -> torch.Tensor:
    keys = args[6]
    assert keys is not None
    return keys.new_empty(keys.shape)


@torch.library.register_fake("demb::table_find_or_insert")  # type: ignore[untyped-decorator]
def _find_or_insert_fake(
    *args: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    scores, keys = args[2], args[7]
    assert scores is not None
    assert keys is not None
    return _fake_insert(keys, scores.shape[0])


@torch.library.register_fake("demb::table_insert_or_assign")  # type: ignore[untyped-decorator]
def _insert_or_assign_fake(
    *args: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _fake_insert(args[7], args[2].shape[0])


@torch.library.register_fake("demb::table_erase")  # type: ignore[untyped-decorator]
def _erase_fake(*args: torch.Tensor) -> torch.Tensor:
    return args[7].new_empty(args[7].shape)


@torch.library.register_fake("demb::table_timestamp")  # type: ignore[untyped-decorator]
def _timestamp_fake(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty((1,), dtype=torch.int64)
