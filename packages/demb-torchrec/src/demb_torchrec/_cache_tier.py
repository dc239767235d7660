"""The model-level side of a module's caching tables (:class:`CacheTier`): flushing the
caches, reading ahead the next batch's storage rows (``prefetch``), and what checkpoints,
erases, memory and statistics read of the storage tier (docs/tiers.md)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from demb_kernels.launched import dedup_launch, live_unique
from demb_kernels.table import EMPTY_KEY
from demb_storage import DynamicEmbeddingTable, MemoryUsage, TableExport

from demb_torchrec._cache import STAT_NAMES, CacheLookups
from demb_torchrec._cache_groups import Located, Staged, fit_words
from demb_torchrec._dedup import dedup_bags
from demb_torchrec._prefetch_bound import PrefetchBound
from demb_torchrec._state import Bags

__all__ = ["CacheTier"]


class CacheTier(CacheLookups):
    """The storage tier of a module's caching tables: its lookups
    (:class:`~demb_torchrec._cache.CacheLookups`) and the calls below."""

    @functools.cached_property
    def _bounds(self) -> PrefetchBound:
        """The bound of a prefetch that waits on nothing (CUDA, every storage a
        :class:`DynamicEmbeddingTable`, whose search reads on the device)."""
        storages = (g.storage for g in self.groups)
        cuda = self._state.device.type == "cuda"
        return PrefetchBound(cuda and all(isinstance(x, DynamicEmbeddingTable) for x in storages))

    def prefetch(self, bags: Bags, forward_stream: torch.cuda.Stream | None = None) -> None:
        """Read ahead the storage rows of ``bags``' keys that the caches miss, for the next
        forward (which then reads them from the device instead of the storage; an entry the
        storage changes, evicts or erases meanwhile is read again). The caches and the scores
        do not change.

        On CUDA the caches are searched on the current stream and the storage is searched and
        its rows read on the side stream, after the current stream's work so far; the call
        returns without waiting for any of it: the rest of the step, and the next forward
        until it places the rows, overlap the reads. The first prefetch (and every one over a
        storage other than a :class:`DynamicEmbeddingTable`) waits for the caches' search
        once; the others stage at most twice as many keys as the last prefetch found missing
        (:class:`~demb_torchrec._prefetch_bound.PrefetchBound`): what does not fit is read by
        the forward, as without prefetch.
        ``forward_stream``: the CUDA stream the next forward runs on, when another one than
        the current (the staged rows are kept for it)."""
        s = self._state
        picked = self._bounded_picks(bags) if self._bounds.ready() else self._picks(bags)
        self.staged = [None] * len(self.groups)  # a later prefetch replaces an earlier one
        reads = self.reads
        later = forward_stream or reads.training_stream()
        with reads.side():
            found: list[tuple[Located, torch.Tensor] | None] = []
            for group, (k, i) in zip(self.groups, picked, strict=True):
                if k.numel() == 0:
                    found.append(None)
                    continue
                located = group.locate(k, i, vouched=True)
                # keys not stored stay as the empty key, which matches no key later: no
                # compaction (it would wait on the device)
                stored = torch.where(located.found, k, EMPTY_KEY)
                reads.made_for([stored, located.words], later)
                reads.hold([k, i, *located.inputs, *group.buffers()])
                found.append((located, stored))
            reads.mark_keys()
            for g, entry in enumerate(found):
                if entry is not None:
                    located, stored = entry
                    rows = located.read().to(s.device, non_blocking=True)
                    reads.made_for([rows], later)
                    self.staged[g] = Staged(stored, picked[g][1], rows, located.words)

    def _picks(self, bags: Bags) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group, the keys (and module tables) of the batch's unique keys of its tables
        that the caches miss: the batch deduplicated with a sync, the misses compacted (one
        more); their count sets the next prefetch's bound."""
        s = self._state
        batch = dedup_bags(s, bags)
        keys, ids = batch.keys, batch.tables
        absent = self._cached[ids] & (s.tables.find(keys, ids, check=False) < 0)
        positions = absent.nonzero().squeeze(1)
        self._bounds.learn(int(positions.shape[0]))
        one = len(self.groups) == 1
        wanted = [  # per group, its keys and tables (the split waits here, not on the side)
            (positions if one else positions[g.member[ids[positions]]]) for g in self.groups
        ]
        return [(keys[p], ids[p]) for p in wanted]

    def _bounded_picks(self, bags: Bags) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`_picks` without waiting on the device (CUDA): the dedup leaves its sizes on
        the device, the misses are gathered into :attr:`_bounds`' bound of entries (those past
        it left out, empty-key entries where fewer), each group's others set to the empty key
        of one of its tables (which matches nothing in the storage and is staged as
        nothing)."""
        s = self._state
        launched = dedup_launch(
            bags.indices,
            bags.offsets,
            s.feature_tables,
            s.num_tables,
            bags.batch_size,
            None,
            s.key_bits[0],
            0,
            False,
        )
        live, keys, ids = live_unique(launched)
        absent = live & self._cached[ids] & (s.tables.find(keys, ids, check=False) < 0)
        keys, ids = self._bounds.gather(absent, keys, ids)
        picks = []
        for g in self.groups:  # entries of other tables (or none): the empty key of one of its
            mine = g.member[ids]  # tables (a storage checks table ids, even of empty keys)
            picks.append((torch.where(mine, keys, EMPTY_KEY), torch.where(mine, ids, g.tables[0])))
        return picks

    def flush(self) -> None:
        """Write every cached row (and every pending overflow row) to the storage and empty
        the caches: the storage then holds each key of the caching tables."""
        self._write_live()
        tables = self._state.tables
        for group in self.groups:
            for t in group.tables:
                ex = tables.export(t)
                words = tables.index.scores[:, tables.index.slot_range(t)[0] + ex.slots]
                self._insert(group, ex.keys, torch.full_like(ex.keys, t), ex.values, words)
                tables.clear(t)

    def settle(self) -> None:
        """Write the overflow rows of forwards still pending to the storage (before anything
        reads the storage whole: a dump, a load, a flush)."""
        self._write_live()

    def assign(self, t: int, keys: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
        """Insert or overwrite ``(n,)`` keys of caching table ``t`` in its storage with their
        ``(W, n)`` index score words and ``(n, width)`` rows; the cache's copies of them are
        erased first (the tiers stay exclusive)."""
        tables = self._state.tables
        keys = keys.to(tables.device)
        ids = torch.full_like(keys, t)
        tables.erase(keys, ids)
        self._insert(self._group(t), keys, ids, rows, words, written=False)

    def rows_of(self, t: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n,)`` bool held and ``(n, width)`` rows (zeros where not held) of ``(n,)``
        distinct keys of caching table ``t`` in either tier, on the module's device."""
        self._write_live()
        tables = self._state.tables
        keys = keys.to(tables.device)
        ids = torch.full_like(keys, t)
        slots = tables.find(keys, ids)
        rows = tables.read(t, slots)  # zeros for slot -1
        held = slots >= 0
        below = (~held).nonzero().squeeze(1)
        found, stored, _ = self._group(t).find(keys[below], ids[below])
        rows[below[found].to(rows.device)] = stored[found.to(stored.device)].to(rows)
        held[below[found]] = True
        return held, rows

    def erase(self, t: int, keys: torch.Tensor, record: bool) -> int:
        """Remove ``(n,)`` keys of caching table ``t`` from both tiers; with ``record``, keep
        those the storage held in the table's erased keys (the cache records its own).
        Returns how many the storage held."""
        self._write_live()
        group = self._group(t)
        keys = keys.to(self._state.device)
        ids = torch.full_like(keys, t)
        held = group.find(keys, ids)[0]
        self._changed(group, keys, ids)  # a prefetch's copies of them go too
        removed = group.erase(keys, ids)
        if record and removed:
            gone = keys[held]
            self._state.tables.erased_keys.add(gone, torch.full_like(gone, t))
        return removed

    def storage_chunks(self, t: int, chunk_rows: int) -> Iterator[TableExport]:
        """The entries of caching table ``t`` in its storage, in chunks of at most
        ``chunk_rows``: keys and score columns in its ``score_strategy`` order on the module's
        device, slots -1 (the storage's are not the table's), rows as the storage holds them."""
        below = self.below[t]
        assert below is not None
        tables = self._state.tables
        width = tables.index.score_words
        columns = list(tables.configs[t].score_layout.index_words)
        for chunk in below.storage.export_chunks(below.table_id, chunk_rows):
            keys = chunk.keys.to(tables.device)
            words = fit_words(chunk.scores, width).to(tables.device)
            yield TableExport(keys, words[columns].t(), torch.full_like(keys, -1), chunk.values)

    def export(self, t: int, min_score: int | None = None) -> TableExport:
        """Every entry of caching table ``t`` in both tiers (the cache's first): keys, score
        columns in its ``score_strategy`` order, slots (the cache's; -1 for the storage's)
        and rows; ``min_score``: only the entries whose threshold column (the timestamp of a
        compound strategy) is at least that (an incremental dump's)."""
        self._write_live()
        tables = self._state.tables
        parts = [tables.export(t, min_score=min_score)]
        column = tables.configs[t].score_layout.threshold_column
        for chunk in self.storage_chunks(t, 1 << 20):
            if min_score is None:
                parts.append(chunk)
                continue
            keep = (chunk.scores[:, column] >= min_score).nonzero().squeeze(1)
            parts.append(
                TableExport(
                    chunk.keys[keep],
                    chunk.scores[keep],
                    chunk.slots[keep],
                    chunk.values[keep.to(chunk.values.device)],
                )
            )
        rows = parts[0].values.device
        return TableExport(
            torch.cat([p.keys for p in parts]),
            torch.cat([p.scores for p in parts]),
            torch.cat([p.slots for p in parts]),
            torch.cat([p.values.to(rows) for p in parts]),
        )

    def clear_storage(self, t: int) -> None:
        """Remove every entry of caching table ``t`` from its storage (and what a prefetch
        read ahead)."""
        self.reads.await_keys()
        self.reads.await_rows()
        self.staged = [None] * len(self.groups)
        below = self.below[t]
        assert below is not None
        keys = [c.keys for c in below.storage.export_chunks(below.table_id)]
        if keys:
            below.storage.erase(torch.cat(keys), below.table_id)

    def storage_memory(self, t: int) -> MemoryUsage:
        """Bytes caching table ``t``'s rows take in its storage: its slots and rows in a
        :class:`~demb_storage.DynamicEmbeddingTable`; an equal share of another storage's
        usage among the module's tables that use it."""
        below = self.below[t]
        assert below is not None
        storage = below.storage
        if isinstance(storage, DynamicEmbeddingTable):
            table = storage.table
            index = table.index
            lo, hi = index.slot_range(below.table_id)
            parts = [index.keys[lo:hi], index.digests[lo:hi], index.scores[:, lo:hi]]
            rows = table.configs[below.table_id].device_rows
            values = MemoryUsage.of_values(table.values[below.table_id], rows)
            return MemoryUsage.of_tensors(parts) + values
        sharing = sum(1 for b in self.below if b is not None and b.storage is storage)
        usage = storage.memory_usage()
        return MemoryUsage(
            usage.device // sharing, usage.host // sharing, usage.external // sharing
        )

    def read_stats(self, reset: bool = True) -> list[dict[str, int]]:
        """Per table, the :data:`STAT_NAMES` counts since the last read (zeros for a table
        without caching)."""
        rows: list[list[int]] = self.stats.tolist()
        if reset:
            self.stats.zero_()
        return [dict(zip(STAT_NAMES, r, strict=True)) for r in rows]
