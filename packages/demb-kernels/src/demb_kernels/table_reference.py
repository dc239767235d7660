"""Pure-Python model of the fused scored hash table of ``docs/hash_table.md``, for tests.

:class:`TableModel` implements the algorithm of ``docs/hash_table.md`` literally,
on plain Python ints and lists, independent of the native kernels: the only shared piece is
:func:`demb_planner.home_slots` (home bucket and start position of a key), which is the single
definition of where a key lives. It keeps no digests (they are a kernel-side shortcut for
comparing keys and change no outcome).

Policies and statuses are plain ints (the values of ``ScorePolicy`` and ``InsertStatus``):
``TIMESTAMP=0, STEP=1, CUSTOMIZED=2, LFU=3, NO_EVICTION=4, TIMESTAMP_LFU=5`` and ``HIT=0,
INSERTED=1, EVICTED=2, FAILED=3``. Slots are table-local, ``bucket * bucket_width + i``.

Readings of the definition where it leaves a choice open:

* on a hit, a single-word policy writes score word 0 only; an inserted key of such a policy
  gets word 1 = 0 (so word 1 stays 0 unless insert_or_assign writes something else there);
  insert_or_assign stores the given words as they are;
* insert_or_assign processes the keys strictly in batch order within a bucket, and only keys
  touched so far are protected: a new key may evict a present key that comes later in the
  batch, which is then re-inserted when its turn comes;
* export keeps a slot when ``scores[score_word] >= min_score``;
* rehash into a table too small for the keys reports ``-1`` as the new slot of a key that
  did not fit (a doubled capacity never overflows).

A table may rank its victims by another order than its score words
(:meth:`TableModel.set_victim_order`, the model of ``TableIndex.victim_rank``): a function of a
candidate's slot and score words, evaluated when a victim is chosen.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import numpy as np
from demb_planner import BUCKET_ALIGNMENT, home_slots

__all__ = [
    "CUSTOMIZED",
    "EMPTY_KEY",
    "EVICTED",
    "FAILED",
    "HIT",
    "INSERTED",
    "LFU",
    "NO_EVICTION",
    "POLICIES",
    "SCORE_MAX",
    "STEP",
    "TIMESTAMP",
    "TIMESTAMP_LFU",
    "TableModel",
    "VictimOrder",
]

EMPTY_KEY = -1
"""Marks an empty slot; never a valid key."""

TIMESTAMP = 0
STEP = 1
CUSTOMIZED = 2
LFU = 3
NO_EVICTION = 4
TIMESTAMP_LFU = 5
POLICIES = (TIMESTAMP, STEP, CUSTOMIZED, LFU, NO_EVICTION, TIMESTAMP_LFU)
"""Every score policy, by value."""

HIT = 0
INSERTED = 1
EVICTED = 2
FAILED = 3

SCORE_MAX = 2**63 - 1
"""Frequencies saturate here."""

_INT64_MIN = -(2**63)

Slot: TypeAlias = tuple[int, list[int]] | None
"""An empty slot (``None``) or ``(key, score words)``."""

InsertOutcome: TypeAlias = tuple[list[int], list[int], list[int], list[list[int]]]
"""``(slots, status, victim_keys, victim_scores)``; ``victim_scores[i]`` holds ``W`` words."""

VictimOrder: TypeAlias = Callable[[int, list[int]], Any]
"""``(slot, score words) -> sort key`` of a victim candidate: the lowest key is evicted (ties
to the first in circular order). Keys of one table must be mutually comparable."""


def _int64(name: str, value: int) -> int:
    number = operator.index(value)
    if not _INT64_MIN <= number <= SCORE_MAX:
        raise ValueError(f"{name}={number}: outside int64")
    return number


def _positive(name: str, value: int) -> int:
    number = operator.index(value)
    if number <= 0:
        raise ValueError(f"{name}={number}: must be positive")
    return number


class TableModel:
    """The fused scored hash table of ``docs/hash_table.md``: ``T`` tables, ``W`` score words.

    Args:
        capacities: slots of each table, a positive multiple of its bucket width.
        bucket_widths: slots per bucket of each table, a positive multiple of 16.
        policies: the score policy of each table (ints, see the module docstring).
        score_words: ``W``, 1 or 2 (2 is required when some table is TIMESTAMP_LFU).

    Raises:
        ValueError: an argument is not as above.
    """

    def __init__(
        self,
        capacities: Sequence[int],
        bucket_widths: Sequence[int],
        policies: Sequence[int],
        score_words: int,
    ) -> None:
        if not len(capacities) == len(bucket_widths) == len(policies) >= 1:
            raise ValueError(
                "capacities, bucket_widths and policies must be non-empty and of one length"
            )
        self._widths = [_positive("bucket_width", w) for w in bucket_widths]
        self._capacities = [_positive("capacity", c) for c in capacities]
        self._policies = [operator.index(p) for p in policies]
        for width, capacity in zip(self._widths, self._capacities, strict=True):
            self._check_capacity(capacity, width)
        for policy in self._policies:
            if policy not in POLICIES:
                raise ValueError(f"policy={policy}: unknown")
        words = operator.index(score_words)
        if words not in (1, 2):
            raise ValueError(f"score_words={words}: must be 1 or 2")
        if words == 1 and TIMESTAMP_LFU in self._policies:
            raise ValueError("score_words=1: TIMESTAMP_LFU needs 2 score words")
        self._w = words
        self._slots: list[list[Slot]] = [[None] * c for c in self._capacities]
        self._where: list[dict[int, int]] = [{} for _ in self._capacities]
        self._orders: list[VictimOrder | None] = [None] * len(self._capacities)

    @staticmethod
    def _check_capacity(capacity: int, width: int) -> None:
        if width % BUCKET_ALIGNMENT:
            raise ValueError(f"bucket_width={width}: must be a multiple of {BUCKET_ALIGNMENT}")
        if capacity % width:
            raise ValueError(f"capacity={capacity}: must be a multiple of bucket_width={width}")

    # ------------------------------------------------------------------ properties

    @property
    def num_tables(self) -> int:
        """``T``, the number of tables."""
        return len(self._capacities)

    @property
    def score_words(self) -> int:
        """``W``, the score words per slot."""
        return self._w

    @property
    def capacities(self) -> tuple[int, ...]:
        """Slots of each table."""
        return tuple(self._capacities)

    @property
    def bucket_widths(self) -> tuple[int, ...]:
        """Slots per bucket of each table."""
        return tuple(self._widths)

    @property
    def policies(self) -> tuple[int, ...]:
        """Score policy of each table."""
        return tuple(self._policies)

    def set_victim_order(self, table_id: int, order: VictimOrder | None) -> None:
        """Rank table ``table_id``'s victims by ``order(slot, score words)`` (lowest first, ties
        to the first in circular order) instead of by score words; None restores the score
        words. The model of a ranked table of ``TableIndex`` (``order`` reading the ranks)."""
        self._orders[self._table(table_id)] = order

    # ------------------------------------------------------------------ validation

    def _table(self, table_id: int) -> int:
        t = operator.index(table_id)
        if not 0 <= t < self.num_tables:
            raise ValueError(f"table_id={t}: outside [0, {self.num_tables})")
        return t

    def _batch(
        self, keys: Sequence[int], table_ids: Sequence[int], counts: Sequence[int] | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        if len(table_ids) != len(keys):
            raise ValueError(f"{len(table_ids)} table ids for {len(keys)} keys")
        ks = [_int64("key", k) for k in keys]
        if EMPTY_KEY in ks:
            raise ValueError(f"the empty key {EMPTY_KEY} is not a valid key")
        ts = [self._table(t) for t in table_ids]
        if counts is None:
            cs = [1] * len(ks)
        else:
            if len(counts) != len(keys):
                raise ValueError(f"{len(counts)} counts for {len(keys)} keys")
            cs = [_int64("count", c) for c in counts]
            if any(c < 0 for c in cs):
                raise ValueError("counts must be >= 0")
        return ks, ts, cs

    def _score_args(self, score_args: Sequence[int]) -> list[int]:
        if len(score_args) != self.num_tables:
            raise ValueError(f"{len(score_args)} score args for {self.num_tables} tables")
        return [_int64("score_arg", a) for a in score_args]

    # ------------------------------------------------------------------ internals

    def _homes(self, keys: list[int], table_ids: list[int]) -> list[tuple[int, int]]:
        """``(home bucket, start position)`` of each key in its table."""
        homes = [(0, 0)] * len(keys)
        for t in set(table_ids):
            index = [i for i, tid in enumerate(table_ids) if tid == t]
            where = home_slots(
                np.array([keys[i] for i in index], dtype=np.int64),
                self._capacities[t],
                self._widths[t],
            )
            for i, bucket, start in zip(
                index, where.bucket.tolist(), where.start.tolist(), strict=True
            ):
                homes[i] = (int(bucket), int(start))
        return homes

    def _touch(self, t: int, old: list[int] | None, score_arg: int, count: int) -> list[int]:
        """The score words of a touched key: ``old`` is ``None`` for an inserted key."""
        policy = self._policies[t]
        if policy in (LFU, TIMESTAMP_LFU):
            freq = count if old is None else min(old[0] + count, SCORE_MAX)
            first = [freq, score_arg] if policy == TIMESTAMP_LFU else [freq]
        else:
            first = [score_arg]
        if old is None:
            return (first + [0] * self._w)[: self._w]
        return first + old[len(first) :]

    def _place(self, t: int, bucket: int, start: int, protected: set[int]) -> tuple[int, int, Slot]:
        """Where a missing key goes: ``(slot, status, evicted slot content)``; slot -1: FAILED.

        The first empty slot in the key's circular order, else (not under NO_EVICTION) the
        unprotected slot with the smallest score tuple (or victim order, where the table has
        one), ties to the first in circular order.
        """
        width = self._widths[t]
        table = self._slots[t]
        order = [bucket * width + (start + j) % width for j in range(width)]
        for slot in order:
            if table[slot] is None:
                return slot, INSERTED, None
        if self._policies[t] == NO_EVICTION:
            return -1, FAILED, None
        ranking = self._orders[t]
        best = -1
        best_score: Any = None
        for slot in order:
            content = table[slot]
            if slot in protected or content is None:
                continue
            score = tuple(content[1]) if ranking is None else ranking(slot, list(content[1]))
            if best < 0 or score < best_score:
                best, best_score = slot, score
        if best < 0:
            return -1, FAILED, None
        victim = table[best]
        assert victim is not None
        del self._where[t][victim[0]]
        return best, EVICTED, victim

    def _store(self, t: int, slot: int, key: int, scores: list[int]) -> None:
        self._slots[t][slot] = (key, scores)
        self._where[t][key] = slot

    def _empty_outcome(self, n: int) -> InsertOutcome:
        return [-1] * n, [FAILED] * n, [EMPTY_KEY] * n, [[0] * self._w for _ in range(n)]

    # ------------------------------------------------------------------ operations

    def lookup(
        self,
        keys: Sequence[int],
        table_ids: Sequence[int],
        score_args: Sequence[int] | None = None,
        counts: Sequence[int] | None = None,
    ) -> list[int]:
        """The slot of each key or -1; with ``score_args`` every found key is touched.

        Duplicates each apply their count. ``counts`` is unused without ``score_args``.
        """
        ks, ts, cs = self._batch(keys, table_ids, counts)
        args = None if score_args is None else self._score_args(score_args)
        out = []
        for key, t, count in zip(ks, ts, cs, strict=True):
            slot = self._where[t].get(key, -1)
            if slot >= 0 and args is not None:
                content = self._slots[t][slot]
                assert content is not None
                self._store(t, slot, key, self._touch(t, content[1], args[t], count))
            out.append(slot)
        return out

    def find_or_insert(
        self,
        keys: Sequence[int],
        table_ids: Sequence[int],
        score_args: Sequence[int],
        counts: Sequence[int] | None = None,
    ) -> InsertOutcome:
        """Phase A (hits, touched and protected), then phase B (misses, in batch order).

        Returns:
            ``(slots, status, victim_keys, victim_scores)``, ``victim_scores[i]`` the ``W``
            words of the key evicted by key ``i`` (zeros unless ``status[i] == EVICTED``).
        """
        ks, ts, cs = self._batch(keys, table_ids, counts)
        args = self._score_args(score_args)
        slots, status, victim_keys, victim_scores = self._empty_outcome(len(ks))
        protected: list[set[int]] = [set() for _ in range(self.num_tables)]
        missing = []
        for i, (key, t) in enumerate(zip(ks, ts, strict=True)):  # phase A
            slot = self._where[t].get(key, -1)
            if slot < 0:
                missing.append(i)
                continue
            content = self._slots[t][slot]
            assert content is not None
            self._store(t, slot, key, self._touch(t, content[1], args[t], cs[i]))
            protected[t].add(slot)
            slots[i], status[i] = slot, HIT
        homes = self._homes([ks[i] for i in missing], [ts[i] for i in missing])
        for i, (bucket, start) in zip(missing, homes, strict=True):  # phase B
            key, t = ks[i], ts[i]
            slot = self._where[t].get(key, -1)
            if slot >= 0:  # inserted by an earlier key of this phase
                content = self._slots[t][slot]
                assert content is not None
                self._store(t, slot, key, self._touch(t, content[1], args[t], cs[i]))
                slots[i], status[i] = slot, HIT
                continue
            slot, status[i], victim = self._place(t, bucket, start, protected[t])
            if slot < 0:
                continue
            if victim is not None:
                victim_keys[i], victim_scores[i] = victim[0], list(victim[1])
            self._store(t, slot, key, self._touch(t, None, args[t], cs[i]))
            protected[t].add(slot)
            slots[i] = slot
        return slots, status, victim_keys, victim_scores

    def insert_or_assign(
        self, keys: Sequence[int], table_ids: Sequence[int], scores: Sequence[Sequence[int]]
    ) -> InsertOutcome:
        """Every key in batch order: a present key gets ``scores[i]``, a missing one is inserted.

        Args:
            keys: the keys.
            table_ids: table of each key.
            scores: ``scores[i]``, the ``W`` score words of key ``i``.

        Returns:
            As :meth:`find_or_insert` (a present key is a HIT).
        """
        ks, ts, _ = self._batch(keys, table_ids)
        if len(scores) != len(ks):
            raise ValueError(f"{len(scores)} score rows for {len(ks)} keys")
        words = []
        for row in scores:
            if len(row) != self._w:
                raise ValueError(f"a score row of {len(row)} words, the index has {self._w}")
            words.append([_int64("score", s) for s in row])
        slots, status, victim_keys, victim_scores = self._empty_outcome(len(ks))
        protected: list[set[int]] = [set() for _ in range(self.num_tables)]
        homes = self._homes(ks, ts)
        for i, (key, t) in enumerate(zip(ks, ts, strict=True)):
            slot = self._where[t].get(key, -1)
            if slot >= 0:
                status[i] = HIT
            else:
                slot, status[i], victim = self._place(t, *homes[i], protected[t])
                if slot < 0:
                    continue
                if victim is not None:
                    victim_keys[i], victim_scores[i] = victim[0], list(victim[1])
            self._store(t, slot, key, list(words[i]))
            protected[t].add(slot)
            slots[i] = slot
        return slots, status, victim_keys, victim_scores

    def erase(self, keys: Sequence[int], table_ids: Sequence[int]) -> list[int]:
        """Remove each present key; its former slot, or -1 (absent, or a later duplicate)."""
        ks, ts, _ = self._batch(keys, table_ids)
        out = []
        for key, t in zip(ks, ts, strict=True):
            slot = self._where[t].pop(key, -1)
            if slot >= 0:
                self._slots[t][slot] = None
            out.append(slot)
        return out

    def export(
        self,
        table_id: int,
        begin: int = 0,
        end: int | None = None,
        min_score: int | None = None,
        score_word: int = 0,
    ) -> tuple[list[int], list[list[int]], list[int]]:
        """The occupied slots of ``[begin, end)`` in ascending order, optionally filtered.

        Returns:
            ``(keys, scores, slots)``; ``scores[j]`` is the ``W`` words of ``keys[j]``. With
            ``min_score`` only slots with ``scores[score_word] >= min_score`` are kept.
        """
        t = self._table(table_id)
        capacity = self._capacities[t]
        stop = capacity if end is None else operator.index(end)
        begin = operator.index(begin)
        if not 0 <= begin <= stop <= capacity:
            raise ValueError(f"slot range [{begin}, {stop}) not inside [0, {capacity})")
        if not 0 <= score_word < self._w:
            raise ValueError(f"score_word={score_word}: the index has {self._w} words")
        keys, scores, slots = [], [], []
        for slot in range(begin, stop):
            content = self._slots[t][slot]
            if content is None:
                continue
            if min_score is not None and content[1][score_word] < min_score:
                continue
            keys.append(content[0])
            scores.append(list(content[1]))
            slots.append(slot)
        return keys, scores, slots

    def sizes(self) -> list[int]:
        """Occupied slots of each table."""
        return [len(where) for where in self._where]

    def clear(self, table_id: int | None = None) -> None:
        """Empty one table, or all of them."""
        tables = range(self.num_tables) if table_id is None else [self._table(table_id)]
        for t in tables:
            self._slots[t] = [None] * self._capacities[t]
            self._where[t] = {}

    def rehash(self, table_id: int, new_capacity: int) -> tuple[list[int], list[int]]:
        """Resize table ``table_id`` in place: its keys re-inserted in ascending old-slot order.

        Returns:
            ``(old_slots, new_slots)`` of every key (new slot -1 for a key that did not fit,
            only possible when the capacity shrinks).
        """
        t = self._table(table_id)
        capacity = _positive("new_capacity", new_capacity)
        self._check_capacity(capacity, self._widths[t])
        keys, scores, old_slots = self.export(t)
        self._capacities[t] = capacity
        self.clear(t)
        new_slots, _, _, _ = self.insert_or_assign(keys, [t] * len(keys), scores)
        return old_slots, new_slots

    def snapshot(self, table_id: int) -> dict[int, tuple[int, tuple[int, ...]]]:
        """``key -> (slot, score words)`` of every key of the table."""
        t = self._table(table_id)
        out = {}
        for slot, content in enumerate(self._slots[t]):
            if content is not None:
                out[content[0]] = (slot, tuple(content[1]))
        return out
