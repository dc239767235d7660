"""The index of fused scored hash tables: plain tensors, as defined in docs/hash_table.md.

:class:`TableIndex` holds ``T`` logical tables (keys, digests, score words, per-table layout);
:class:`ScorePolicy` and :class:`InsertStatus` are the codes the kernels use. The ops are in
:mod:`demb_kernels.table`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from demb_planner import BUCKET_ALIGNMENT

from demb_kernels import memory

__all__ = [
    "EMPTY_KEY",
    "ExportResult",
    "InsertResult",
    "InsertStatus",
    "ScorePolicy",
    "TableIndex",
]

EMPTY_KEY = -1
"""The key of an empty slot (all ones); never a valid key."""

_MAX_BUCKET_WIDTH = 2**31 - 1


class ScorePolicy(enum.IntEnum):
    """How a table scores the keys a batch touches (see docs/hash_table.md)."""

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


def _no_ranks() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass
class TableIndex:
    """The index of ``T`` fused tables: plain tensors on one device (see docs/hash_table.md).

    Build one with :meth:`create`. The ops mutate it in place, except :func:`rehash`, which
    returns a new one.

    A table may *rank its victims* (``ranked``): find_or_insert and insert_or_assign then evict
    from its full buckets the unprotected slot with the lowest :attr:`victim_rank`, ties to the
    first in the key's circular order, instead of the lowest score words. The ops never write
    the ranks: the caller sets them (for every slot of such a table) before each op that may
    evict, e.g. from a function of each slot's score words. Since an op never evicts a slot it
    touched, ranks computed before the op rank every victim candidate of the op exactly.
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
    victim_rank: torch.Tensor = field(default_factory=_no_ranks)
    """``(S,)`` int64 per-slot victim rank, read for the slots of ranked tables (the lowest is
    evicted first); ``(0,)`` when no table ranks its victims."""
    ranked: torch.Tensor = field(default_factory=_no_ranks)
    """``(T,)`` int64, 1 where the table ranks its victims by :attr:`victim_rank`; ``(0,)``
    when none does."""
    ranked_list: tuple[bool, ...] = ()
    """Per table, whether it ranks its victims (host copy; ``()`` when none does)."""

    def __post_init__(self) -> None:
        dev = self.keys.device
        if self.victim_rank.numel() == 0 and self.victim_rank.device != dev:
            self.victim_rank = self.victim_rank.to(dev)
        if self.ranked.numel() == 0 and self.ranked.device != dev:
            self.ranked = self.ranked.to(dev)

    @classmethod
    def create(
        cls,
        capacities: Sequence[int],
        bucket_widths: Sequence[int],
        policies: Sequence[ScorePolicy | int],
        device: torch.device | str = "cpu",
        score_words: int | None = None,
        ranked: Sequence[bool] | None = None,
    ) -> TableIndex:
        """An empty index.

        Args:
            capacities: ``T`` slot counts, each a positive multiple of its bucket width.
            bucket_widths: ``T`` bucket widths, multiples of 16 (below ``2**31``).
            policies: ``T`` :class:`ScorePolicy` values.
            device: where the index lives.
            score_words: 1 or 2 score words per slot; default 2 when a policy is
                TIMESTAMP_LFU, else 1.
            ranked: ``T`` flags, True where the table ranks its victims by
                :attr:`victim_rank` (then ``(S,)`` zeros at creation); default none.

        Raises:
            ValueError: a capacity, bucket width, policy, ``score_words`` or ``ranked`` is
                invalid (the message names it).
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
            if width % BUCKET_ALIGNMENT or width > _MAX_BUCKET_WIDTH:
                raise ValueError(
                    f"bucket_widths[{t}]={width}: must be a multiple of "
                    f"{BUCKET_ALIGNMENT} below 2**31"
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
        flags = _ranked_flags(ranked, len(capacities))
        total = sum(capacities)
        dev = torch.device(device)
        offsets = [0]
        for cap in capacities:
            offsets.append(offsets[-1] + cap)
        i64 = torch.int64
        return cls(
            keys=memory.full((total,), EMPTY_KEY, dtype=i64, device=dev),
            digests=memory.full((total,), 0, dtype=torch.uint8, device=dev),
            scores=memory.full((words, total), 0, dtype=i64, device=dev),
            slot_offsets=torch.tensor(offsets, dtype=i64, device=dev),
            bucket_widths=torch.tensor(list(bucket_widths), dtype=i64, device=dev),
            policies=torch.tensor([int(p) for p in parsed], dtype=i64, device=dev),
            sizes=torch.zeros(len(capacities), dtype=i64, device=dev),
            capacities=tuple(capacities),
            bucket_width_list=tuple(bucket_widths),
            policy_list=tuple(parsed),
            victim_rank=torch.zeros(total if any(flags) else 0, dtype=i64, device=dev),
            ranked=torch.tensor(
                [int(f) for f in flags] if any(flags) else [], dtype=i64, device=dev
            ),
            ranked_list=flags if any(flags) else (),
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

    @property
    def ranks_victims(self) -> bool:
        """Whether some table ranks its victims by :attr:`victim_rank`."""
        return any(self.ranked_list)

    def _ranks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(victim_rank, ranked)`` for an inserting op, checked on the host (no sync).

        Raises:
            ValueError: some table ranks its victims and :attr:`victim_rank` is not ``(S,)``
                int64 on the index's device, or :attr:`ranked` is not ``(T,)``.
        """
        if not self.ranks_victims:
            return self.victim_rank, self.ranked
        slots = self.keys.shape[0]
        rank = self.victim_rank
        if rank.dtype != torch.int64 or rank.shape != (slots,) or rank.device != self.device:
            raise ValueError(
                f"victim_rank: tables {[t for t, r in enumerate(self.ranked_list) if r]} rank "
                f"their victims, so it must be ({slots},) int64 on {self.device}, got "
                f"{tuple(rank.shape)} {rank.dtype} on {rank.device}"
            )
        if self.ranked.shape != (self.num_tables,) or len(self.ranked_list) != self.num_tables:
            raise ValueError(
                f"ranked: must be ({self.num_tables},) with one host flag per table, got "
                f"{tuple(self.ranked.shape)} and {len(self.ranked_list)} flags"
            )
        return rank, self.ranked

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        return (
            self.keys,
            self.digests,
            self.scores,
            self.slot_offsets,
            self.bucket_widths,
            self.policies,
        )


def _ranked_flags(ranked: Sequence[bool] | None, num_tables: int) -> tuple[bool, ...]:
    """``T`` host flags of :meth:`TableIndex.create`'s ``ranked`` (all False for None)."""
    if ranked is None:
        return (False,) * num_tables
    flags = tuple(ranked)
    if len(flags) != num_tables or not all(isinstance(f, bool) for f in flags):
        raise ValueError(f"ranked={ranked!r}: must be {num_tables} bools, one per table")
    return flags
