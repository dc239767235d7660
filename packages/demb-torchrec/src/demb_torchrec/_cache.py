"""Caching tables (``caching=True``): the module's table is a cache sized by the table's device
budget over a :class:`~demb_storage.Storage` that holds every other row (docs/tiers.md).

The tiers are exclusive: a key is in the cache or in the storage, never both. A training
forward finds its unique keys in the cache; the missing ones are looked up in the storage, then
every key goes through the cache's ``find_or_insert``. A key found in the storage moves into the
cache with its row, optimizer state and scores (LFU counts add up); what the cache evicts for
it is written back to the storage, and what the storage evicts is gone (recorded under
``RETAIN_KEY``). A key whose cache bucket is full of this batch's keys *overflows*: it is trained
in a scratch row past the cache's slots and written back to the storage after its backward.
An eval forward reads both tiers and inserts nowhere. :class:`CacheLookups` does it for the
module's caching tables; the module's other tables run as before in the same batch.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from demb_kernels.init_rows import NewRowsArgs, init_new_rows
from demb_kernels.table import EMPTY_KEY, InsertStatus, ScorePolicy
from demb_storage import (
    InsertOutcome,
)
from demb_storage.mixed_rows import read_mixed, write_mixed
from demb_storage.table_counts import per_table_counts
from torch.autograd.function import FunctionCtx

from demb_torchrec._cache_groups import (
    Staged,
    StorageGroup,
    StorageSlot,
    match_pairs,
    storage_groups,
)
from demb_torchrec._dedup import DedupedBatch, dedup_bags
from demb_torchrec._side_reads import SideReads
from demb_torchrec._state import Bags, ForwardState

__all__ = ["STAT_NAMES", "CacheLookups", "StorageSlot"]

STAT_NAMES = (
    "cache_hits",
    "storage_hits",
    "misses",
    "write_backs",
    "overflows",
    "evictions",
    "prefetched",
)
"""Per caching table, what ``CacheTier.read_stats`` counts: keys found in the cache, keys
found in the storage, new keys, rows written back to the storage, keys trained outside the
cache (their bucket was full of the batch's keys), keys the storage evicted, and the storage
hits whose rows ``prefetch`` had read ahead."""

_COUNTS_WORD = (ScorePolicy.LFU, ScorePolicy.TIMESTAMP_LFU)
"""The policies whose index score word 0 counts accesses."""

Fetched = list[tuple[StorageGroup, torch.Tensor, torch.Tensor, torch.Tensor]]
"""The storage's entries of some of a batch's keys, per storage group: the group, the found
keys' positions in the batch ``(n,)``, their rows ``(n, width)`` and index score words
``(W, n)``."""


Overflow = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""A forward's overflow entries: ``(n,)`` keys, their ``(n,)`` caching tables, their scratch
rows (row ``rows[i]`` of the forward's buffer of table ``ids[i]``) and ``(W, n)`` score
words."""


@dataclass(eq=False)
class _Pending:
    """A forward's overflow rows, to write back to the storage (:data:`Overflow`; None: a
    forward without overflow), read from ``buffers``, the value buffers of that forward."""

    buffers: list[torch.Tensor]
    entries: Overflow | None = None
    graph_alive: bool = False
    """A backward may still update the rows (its autograd graph exists)."""


class _GraphToken:
    """Held by a step's autograd graph only: when the graph goes, so does the token."""


class _WriteBackAfter(torch.autograd.Function):
    """Identity on the trigger; its backward, which runs after the step's update, writes the
    step's overflow rows back to the storage."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, trigger: torch.Tensor, tier: CacheLookups, pending: _Pending
    ) -> torch.Tensor:
        token = _GraphToken()
        ctx.tier, ctx.pending, ctx.token = tier, pending, token  # type: ignore[attr-defined]
        pending.graph_alive = True
        weakref.finalize(token, tier.graph_freed, pending)
        return trigger.view_as(trigger)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.tier.write_back(ctx.pending, release=True)  # type: ignore[attr-defined]
        return grad, None, None


class CacheLookups:
    """The lookups of a module's caching tables over their storage tier (the model-level
    calls are :class:`~demb_torchrec._cache_tier.CacheTier`'s).

    Args:
        state: the module's forward state (its ``tables`` are the caches).
        below: per table, its :class:`StorageSlot`, or None for a table without caching.
        eval_rows: :func:`~demb_kernels.init_rows.new_rows_args` of the tables' eval
            initializers (the rows an eval forward reads for keys in neither tier).
        retains: per table, whether it records the keys its last tier evicts.
    """

    def __init__(
        self,
        state: ForwardState,
        below: Sequence[StorageSlot | None],
        eval_rows: NewRowsArgs,
        retains: Sequence[bool],
    ) -> None:
        self._state = state
        tables = state.tables
        device = state.device
        self.below = list(below)
        self.groups = storage_groups(below, tables.configs, device, tables.index.score_words)
        self._cached = torch.tensor([b is not None for b in below], device=device)
        self._eval_rows = eval_rows
        policies = [c.score_layout.policy for c in tables.configs]
        counting = [p in _COUNTS_WORD for p in policies]
        self._counts = torch.tensor(counting, device=device)
        """``(T,)`` bool: the tables whose score word 0 counts accesses."""
        self._any_counts = any(counting)
        compound = [p is ScorePolicy.TIMESTAMP_LFU for p in policies]
        self._compound = torch.tensor(compound, device=device)
        """``(T,)`` bool: the tables whose score word 1 is the batch's timestamp."""
        self._caps = torch.tensor(
            [tables.capacity(t) for t in range(state.num_tables)], device=device
        )
        """``(T,)`` each cache's slots (fixed: a cache never grows)."""
        self._retains = torch.tensor(list(retains), device=device)
        self._ends = [0] * state.num_tables
        self._live: list[_Pending] = []
        self.stats = torch.zeros((state.num_tables, len(STAT_NAMES)), dtype=torch.int64)
        self.stats = self.stats.to(device)
        """``(T, 7)`` int64 :data:`STAT_NAMES` counts since the last read."""
        self.base_trigger = state.trigger
        self.staged: list[Staged | None] = [None] * len(self.groups)
        """Per group, the storage entries ``prefetch`` read for the next forward (each dropped
        when the storage's copy changes), or None."""
        self.reads = SideReads(device)
        """Where the storage's rows are read (a stream of their own on CUDA), and what the
        training stream waits for."""

    # ----------------------------------------------------------------------------- lookups
    def train_lookup(
        self, bags: Bags, grad: bool
    ) -> tuple[DedupedBatch, torch.Tensor, torch.Tensor, None]:
        """A training forward's lookup (the ``Found`` of
        :class:`~demb_torchrec._find_or_insert.FindOrInsert`): every caching key ends with a
        cache slot or a scratch row and a status of HIT (its row is set) or INSERTED (its row
        was initialized), except a key neither tier holds that its admitter rejects (slot -1,
        as in any table: its row comes from the strategy's initializer); the other tables'
        keys as a plain ``find_or_insert`` leaves them."""
        s = self._state
        tables = s.tables
        s.trigger = self.base_trigger
        self._write_live()
        scores = tables.next_score_args()
        batch = dedup_bags(s, bags)
        keys, ids = batch.keys, batch.tables
        counts = batch.occurrence_counts()
        cached = self._cached[ids]
        absent = tables.find(keys, ids, check=False) < 0
        fetched = self._fetch(keys, ids, (cached & absent).nonzero().squeeze(1))
        rejected: torch.Tensor | None = None
        inserted = keys
        if s.admission is not None:  # a key is missing when neither tier holds it
            missing = absent.clone()
            for _, p, _, _ in fetched:
                missing[p] = False
            rejected = s.admission.rejected(keys, ids, counts, missing)
            s.rejected[0] = rejected
            # a rejected key stays in the batch as the empty key, which the insert skips (slot
            # -1, status HIT: nothing to initialize)
            inserted = torch.where(rejected, EMPTY_KEY, keys)
        outcome = tables.find_or_insert(
            inserted, ids, counts=counts, return_evicted=True, zero_new_rows=False,
            check=False, count_failures=False, score_args=scores, skips=rejected is not None,
        )  # fmt: skip
        slots, status = outcome.slots.clone(), outcome.status
        for group, p, _, _ in fetched:  # found keys that got a cache slot moved up
            up = p[slots[p] >= 0]
            self._changed(group, keys[up], ids[up])
            group.erase(keys[up], ids[up], vouched=True)
        overflow = (cached & (status == InsertStatus.FAILED)).nonzero().squeeze(1)
        self._spill(outcome, keys[overflow], ids[overflow])
        pending = _Pending(list(tables.values))
        self._reserve(ids, slots, overflow, pending)
        found = torch.zeros_like(cached)
        stored = torch.zeros((tables.index.score_words, keys.shape[0]), dtype=torch.int64)
        stored = stored.to(keys.device)
        for _, p, _, words in fetched:
            found[p] = True
            stored[:, p] = words.to(stored.device)
        hit = status == InsertStatus.HIT
        new = cached & ~found & ~hit
        code = torch.where(new, int(InsertStatus.INSERTED), int(InsertStatus.HIT))
        status = torch.where(cached, code, status)
        init_new_rows(tables.values, slots, keys, ids, status, s.new_rows)
        self._place(ids, slots, fetched)
        held = cached & hit if rejected is None else cached & hit & ~rejected
        self._count(ids, [held, found, new], overflow)
        if overflow.numel():
            self._pend(pending, batch, slots, overflow, counts, scores, stored)
            if grad:
                s.trigger = _WriteBackAfter.apply(self.base_trigger, self, pending)  # type: ignore[no-untyped-call]
            else:
                self.write_back(pending, release=True)
        else:
            self._release(pending)
        return batch, slots, status, None

    def eval_lookup(self, bags: Bags) -> tuple[DedupedBatch, torch.Tensor, None, None]:
        """An eval forward's lookup: keys missing in the cache read their storage row, or the
        eval initializer's, from scratch rows; nothing is inserted and no score changes."""
        s = self._state
        tables = s.tables
        self._write_live()
        s.rejected[0] = None  # eval admits nothing and rejects nothing
        batch = dedup_bags(s, bags)
        keys, ids = batch.keys, batch.tables
        slots = tables.find(keys, ids, check=False)
        missing = (slots < 0).nonzero().squeeze(1)
        pending = _Pending(list(tables.values))
        self._reserve(ids, slots, missing, pending)
        status = torch.full_like(keys, int(InsertStatus.HIT))
        status[missing] = int(InsertStatus.INSERTED)
        init_new_rows(tables.values, slots, keys, ids, status, self._eval_rows)
        self._place(ids, slots, self._fetch(keys, ids, missing[self._cached[ids[missing]]]))
        self._release(pending)
        return batch, slots, None, None

    # ----------------------------------------------------------------------------- flushing
    def write_back(self, pending: _Pending, *, release: bool = False) -> None:
        """Write a forward's overflow rows (read from that forward's buffers) to the storage;
        keys the cache holds by now (a later forward moved them up) are skipped. ``release``:
        its scratch rows are free again (its backward has run, or it has none)."""
        tables = self._state.tables
        if pending.entries is not None:
            for group in self.groups:
                keys, ids, rows, words = pending.entries
                if len(self.groups) > 1:  # this group's entries (one group: all of them)
                    mine = group.member[ids].nonzero().squeeze(1)
                    keys, ids, rows, words = keys[mine], ids[mine], rows[mine], words[:, mine]
                if keys.numel() == 0:
                    continue
                rows = read_mixed(pending.buffers, ids, rows, group.tables)
                outside = (tables.find(keys, ids, check=False) < 0).nonzero().squeeze(1)
                self._insert(group, keys[outside], ids[outside], rows[outside], words[:, outside])
        if release:
            self._release(pending)

    def graph_freed(self, pending: _Pending) -> None:
        """A step's autograd graph is gone: no backward will update its rows any more."""
        pending.graph_alive = False

    # ----------------------------------------------------------------------------- internals
    def _group(self, t: int) -> StorageGroup:
        return next(g for g in self.groups if t in g.tables)

    def _fetch(self, keys: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> Fetched:
        """The storage's entries of the keys at ``positions`` (of caching tables): those
        ``prefetch`` staged, the others found now (the staged entries are used up). Which keys
        are stored, and their words, are known on return; their rows are read on the side
        stream (:meth:`_place` and any write to the storage wait for them)."""
        reads = self.reads
        reads.await_keys()
        plans = []
        for g, group in enumerate(self.groups):
            # (the positions are of caching tables: one group holds them all)
            one = len(self.groups) == 1
            mine = positions if one else positions[group.member[ids[positions]]]
            if mine.numel() == 0:  # (its shape is known: the indexing synchronized)
                continue
            staged, at = self.staged[g], None
            if staged is not None:
                at = match_pairs(staged.keys, staged.ids, keys[mine], ids[mine], group.tables)
            rest = mine if at is None else mine[at < 0]
            located = group.locate(keys[rest], ids[rest], vouched=True)
            f = located.found.nonzero().squeeze(1)
            p, words, taken = rest[f], located.words[:, f], None
            if staged is not None and at is not None:
                hit = (at >= 0).nonzero().squeeze(1)
                used = at[hit]
                self._add(6, ids[mine[hit]])
                p = torch.cat([mine[hit], p])
                words = torch.cat([staged.words[:, used], words], dim=1)
                taken = (staged.rows, used)
            plans.append((group, p, words, located, f, taken))
        out: Fetched = []
        here = reads.training_stream()
        with reads.side():
            for group, p, words, located, f, taken in plans:
                rows = located.read()
                rows = rows[f.to(rows.device)].to(keys.device, non_blocking=True)
                if taken is not None:
                    rows = torch.cat([taken[0][taken[1]].to(rows.dtype), rows])
                reads.made_for([rows], here)
                reads.hold([f, *located.inputs, *group.buffers(), *(taken or ())])
                out.append((group, p, rows, words))
            reads.mark_rows()
        self.staged = [None] * len(self.groups)
        return out

    def _spill(self, outcome: InsertOutcome, alive: torch.Tensor, alive_ids: torch.Tensor) -> None:
        """Write what the cache evicted back to the storage (caching tables only). ``alive``:
        the batch's overflow keys (of tables ``alive_ids``), trained from scratch rows and
        written back after the step, so not gone if the storage evicts their old copy."""
        ev = outcome.evicted
        if ev is None or ev.keys.numel() == 0:
            return
        for group in self.groups:
            if group.whole:
                mine = torch.arange(ev.table_ids.shape[0], device=ev.table_ids.device)
            else:
                mine = group.member[ev.table_ids].nonzero().squeeze(1)
            # sorted by table, stably: each table's victims in the order of its entries, the
            # order of ev.values[t] (a bucket's entries keep their order: one table each)
            mine = mine[torch.argsort(ev.table_ids[mine], stable=True)]
            ids = ev.table_ids[mine]
            rows = torch.cat([ev.values[t] for t in group.tables])  # tables ascending
            words = ev.scores[mine].t()
            self._insert(group, ev.keys[mine], ids, rows, words, alive=(alive, alive_ids))

    def _insert(
        self,
        group: StorageGroup,
        keys: torch.Tensor,
        ids: torch.Tensor,
        rows: torch.Tensor,
        words: torch.Tensor,
        alive: tuple[torch.Tensor, torch.Tensor] | None = None,
        written: bool = True,
    ) -> None:
        """Insert entries of caching tables ``ids`` into ``group``'s storage: the step's own
        (distinct, checked keys, counted as written back) unless ``written=False`` (the caller's
        keys); count (and, under ``RETAIN_KEY``, record) what leaves the storage, except keys
        still ``alive`` in this step's scratch rows."""
        if written:
            self._add(3, ids)
        self._changed(group, keys, ids)
        gone, tables = group.insert(keys, ids, rows, words, vouched=written)
        self._changed(group, gone, tables)  # their storage copies are gone with them
        if alive is not None and alive[0].numel() and gone.numel():
            still = torch.zeros_like(gone, dtype=torch.bool)
            for t in group.tables:
                theirs = alive[0][alive[1] == t].to(gone.device)
                still |= (tables == t) & torch.isin(gone, theirs)
            gone, tables = gone[~still], tables[~still]
        self._add(5, tables)
        kept = torch.where(self._retains[tables], gone, -1)
        self._state.tables.evicted_keys.add(kept, tables)

    def _changed(self, group: StorageGroup, keys: torch.Tensor, ids: torch.Tensor) -> None:
        """The storage's copies of these entries change (called before the storage is
        written): drop them from the staged ones. The rows a forward is reading are read
        first (a write may reuse their slots); a prefetch's reads go on (what they read of
        these entries is dropped)."""
        self.reads.await_keys()
        self.reads.await_rows()
        g = self.groups.index(group)
        staged = self.staged[g]
        if staged is not None and keys.numel():
            self.staged[g] = staged.without(keys, ids, group.tables)

    def _add(self, column: int, ids: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Count each entry of tables ``ids`` (where ``mask``, when given) in :attr:`stats`'
        ``column`` (no sync)."""
        counts = per_table_counts(ids, self._state.num_tables, mask)
        self.stats[:, column] += counts.to(self.stats.device)

    def _reserve(
        self, ids: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, pending: _Pending
    ) -> None:
        """Give the keys at ``positions`` scratch rows past their table's slots (in place in
        ``slots``); a buffer too short grows (the forward's ``pending.buffers`` follow)."""
        self._live.append(pending)
        if positions.numel() == 0:
            return
        tables = self._state.tables
        sub = ids[positions]
        order = torch.argsort(sub, stable=True)  # by table; each table's keys in batch order
        per_table = per_table_counts(sub, self._state.num_tables)
        # Table t's k-th key gets row caps[t] + ends[t] + k; its keys start at ``begins[t]`` in
        # ``order`` (the host's ``ends`` copied without waiting on the device).
        ends = torch.tensor(self._ends, dtype=torch.int64).to(slots.device, non_blocking=True)
        begins = torch.cumsum(per_table, 0) - per_table
        shift = self._caps + ends - begins
        for t, n in enumerate(per_table.tolist()):
            if n == 0:
                continue
            start, cap = self._ends[t], tables.capacity(t)
            buf = tables.values[t]
            if buf.shape[0] < cap + start + n:
                grown = torch.zeros(
                    (cap + 2 * (start + n), buf.shape[1]), dtype=buf.dtype, device=buf.device
                )
                grown[: buf.shape[0]] = buf
                tables.values[t] = pending.buffers[t] = grown
            self._ends[t] = start + n
        sorted_ids = sub[order]
        rank = torch.arange(sub.shape[0], device=slots.device)  # position in ``order``
        slots[positions[order]] = shift[sorted_ids] + rank

    def _release(self, pending: _Pending) -> None:
        if pending in self._live:
            self._live.remove(pending)
        if not self._live:
            self._ends = [0] * len(self._ends)

    def _write_live(self) -> None:
        """Write the rows of earlier forwards still pending (their backward has not run, or
        never will); those whose graph is gone free their scratch rows."""
        for pending in list(self._live):
            self.write_back(pending, release=not pending.graph_alive)

    def _place(self, ids: torch.Tensor, slots: torch.Tensor, fetched: Fetched) -> None:
        """Write the found keys' storage rows at their slots; add their stored access counts
        to the cache's (a key that moves up keeps its count)."""
        self.reads.await_rows()
        tables = self._state.tables
        index = tables.index
        for group, p, rows, words in fetched:
            sub, at = ids[p], slots[p]
            write_mixed(tables.values, sub, at, rows, group.tables)
            if not self._any_counts:
                continue
            up = (self._counts[sub] & (at >= 0) & (at < self._caps[sub])).nonzero().squeeze(1)
            where = (index.slot_offsets[sub[up]] + at[up]).to(index.scores.device)
            index.scores[0].index_add_(0, where, words[0][up.to(words.device)].to(index.scores))

    def _pend(
        self,
        pending: _Pending,
        batch: DedupedBatch,
        slots: torch.Tensor,
        overflow: torch.Tensor,
        counts: torch.Tensor,
        scores: torch.Tensor,
        stored: torch.Tensor,
    ) -> None:
        """Record the overflow keys, their scratch rows and the score words the cache would
        have given them (the batch's score; LFU counts on top of the ``stored`` ones, the
        ``(W, U)`` words of the batch's keys found in the storage)."""
        index = self._state.tables.index
        sub = batch.tables[overflow]
        where = stored.device
        now = scores.to(where)[sub]
        frequency = counts[overflow].to(where) + stored[0, overflow]
        words = torch.zeros((index.score_words, overflow.shape[0]), dtype=torch.int64)
        words = words.to(where)
        words[0] = torch.where(self._counts[sub].to(where), frequency, now)
        if index.score_words > 1:  # (TIMESTAMP, LFU): the count, then the timestamp
            words[1] = torch.where(self._compound[sub].to(where), now, 0)
        pending.entries = (batch.keys[overflow], sub, slots[overflow], words)

    def _count(self, ids: torch.Tensor, masks: list[torch.Tensor], overflow: torch.Tensor) -> None:
        """Add the batch's cache hits, storage hits and new keys (``masks``) and overflows to
        :attr:`stats`."""
        for column, mask in enumerate(masks):
            self._add(column, ids, mask)
        self._add(4, ids[overflow])
