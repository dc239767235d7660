"""``DynamicEmbeddingTable``: a :class:`~demb_storage.ScoredHashTable` seen through the
:class:`~demb_storage.Storage` interface, the default storage (the spec's name for it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import torch
from demb_kernels import table as ops
from demb_kernels.table import InsertStatus

from demb_storage._errors import TableConfigError
from demb_storage._failures import count_failed
from demb_storage.mixed_rows import read_mixed, write_mixed
from demb_storage.options import TableConfig
from demb_storage.scored_table import ScoredHashTable
from demb_storage.storage import DEFAULT_CHUNK_ROWS, Storage, StorageBatch
from demb_storage.storage_results import (
    EvictedEntries,
    FoundEntries,
    InsertedEntries,
    MemoryUsage,
    RowLayout,
    StorageExport,
)

__all__ = ["DynamicEmbeddingTable", "LocatedEntries"]


@dataclasses.dataclass(frozen=True)
class LocatedEntries:
    """What :meth:`DynamicEmbeddingTable.locate` returns for ``N`` keys."""

    batch: StorageBatch
    """The checked batch."""
    found: torch.Tensor
    """``(N,)`` bool, True where the key is stored."""
    scores: torch.Tensor
    """``(W, N)`` int64 score words; zeros where not found."""
    slots: torch.Tensor
    """``(N,)`` int64 each key's slot in its table, -1 where not found."""


class DynamicEmbeddingTable(Storage):
    """The tables of a :class:`~demb_storage.ScoredHashTable` as a :class:`Storage`.

    Rows live in the table's value buffers (device, or pinned host for a hybrid table); the
    scores are the index's score words (``W = table.index.score_words``; a compound
    ``(TIMESTAMP, LFU)`` table stores ``[frequency, timestamp]``). Results are on the index's
    device. Capacity is the table's: an insert grows a table up to its ``max_capacity`` (without
    limit for NO_EVICTION), then evicts from full buckets by score, and reports the evicted
    entries; a key that finds no slot is not stored (``stored`` False) and is handled per the
    table's safe-check mode.

    Args:
        table: the tables (shared, not copied: the storage and its owner see the same rows).
        names: the tables' names, for errors.
    """

    def __init__(self, table: ScoredHashTable, *, names: Sequence[str] | None = None) -> None:
        if not isinstance(table, ScoredHashTable):
            raise TableConfigError("table", type(table).__name__, "not a ScoredHashTable")
        super().__init__(
            [RowLayout.of(c) for c in table.configs],
            score_words=table.index.score_words,
            names=names,
            device=table.device,
        )
        self.table = table

    @classmethod
    def create(
        cls,
        tables: Sequence[TableConfig],
        device: torch.device | str = "cpu",
        *,
        value_device: torch.device | str | None = None,
        names: Sequence[str] | None = None,
    ) -> DynamicEmbeddingTable:
        """A new :class:`~demb_storage.ScoredHashTable` of ``tables`` on ``device`` (rows on
        ``value_device``, default ``device``) as a storage."""
        return cls(
            ScoredHashTable(tables, device, value_device=value_device, names=names), names=names
        )

    # ----------------------------------------------------------------------------- interface
    def find(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor | int,
        *,
        tables: Sequence[int] | None = None,
    ) -> FoundEntries:
        """See :meth:`Storage.find`; no score is touched. ``tables``: the distinct tables of
        ``table_ids`` when the caller knows them and has checked the batch (a caching table's
        storage group): nothing is checked again and nothing waits on the device."""
        located = self.locate(keys, table_ids, tables=tables)
        if not located.batch.tables:
            return self.empty_found(located.batch)
        return FoundEntries(located.found, self.read_located(located), located.scores)

    def locate(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor | int,
        *,
        tables: Sequence[int] | None = None,
    ) -> LocatedEntries:
        """:meth:`find` without reading the rows: which keys are stored, their score words and
        where their rows are, for :meth:`read_located` (which may run later, on another CUDA
        stream, while nothing writes the table). ``tables``: as :meth:`find`."""
        batch = self.checked_batch(keys, table_ids, tables)
        if not batch.tables:
            empty = self.empty_found(batch)
            return LocatedEntries(batch, empty.found, empty.scores, torch.full_like(batch.keys, -1))
        slots = self.table.find(batch.keys, batch.table_ids, check=tables is None)
        found = slots >= 0
        index = self.table.index
        where = torch.where(found, index.slot_offsets[batch.table_ids] + slots, 0)
        scores = torch.where(found, index.scores[:, where], 0)
        return LocatedEntries(batch, found, scores, slots)

    def read_located(self, located: LocatedEntries) -> torch.Tensor:
        """``(N, width)`` rows of ``located``'s entries (zeros where not stored), read without
        waiting on the device."""
        if not located.batch.tables:
            return self.empty_found(located.batch).values
        return self._read(located.batch, located.slots)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the table's index and rows live in: a reader on another CUDA stream
        holds them until it is done (a growing table replaces them)."""
        index = self.table.index
        tensors = [getattr(index, f.name) for f in dataclasses.fields(index)]
        return [x for x in tensors if isinstance(x, torch.Tensor)] + list(self.table.values)

    def insert(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor | int,
        values: torch.Tensor,
        scores: torch.Tensor,
        *,
        tables: Sequence[int] | None = None,
    ) -> InsertedEntries:
        """See :meth:`Storage.insert`: the table's ``insert_or_assign`` with rows, reporting the
        keys it evicted (their rows read before the new rows are written). ``tables``: as
        :meth:`find` (the caller also vouches that no key repeats in a table)."""
        vouched = tables is not None
        batch = self.checked_batch(keys, table_ids, tables)
        rows, scores = self.checked_rows(batch, values, scores, distinct=vouched)
        if not batch.tables:
            none = torch.zeros(0, dtype=torch.bool, device=self.device)
            return InsertedEntries(none, none.clone(), self.no_evictions(batch))
        table = self.table
        # Present keys first: an overwrite never evicts and protects its slot, so the new keys
        # after it evict only keys outside the call.
        order = torch.argsort(
            (table.find(batch.keys, batch.table_ids, check=not vouched) < 0).to(torch.int8),
            stable=True,
        )
        keys, ids = batch.keys[order], batch.table_ids[order]
        rows, scores = rows[order], scores[:, order]
        table.grow_for(keys, ids, check=not vouched)  # as ScoredHashTable.insert_or_assign
        table.rank_victims(table.next_score_args())  # nothing unless a table has score_function
        result = ops.insert_or_assign(table.index, keys, ids, scores, check=not vouched)
        status = result.status
        table.record_evictions(ids, status, result.victim_keys)
        table.outcomes.add(ids, status)
        gone = (status == InsertStatus.EVICTED).nonzero().squeeze(1)
        victims = StorageBatch(result.victim_keys[gone], ids[gone], batch.tables, batch.layout)
        evicted = EvictedEntries(
            victims.keys,
            victims.table_ids,
            self._read(victims, result.slots[gone]),  # before the new rows overwrite them
            result.victim_scores[:, gone],
        )
        write_mixed(table.values, ids, result.slots, rows, batch.tables)
        table.record_failures(count_failed(ids, status, self.num_tables), int(keys.shape[0]))
        new = torch.empty_like(status, dtype=torch.bool)
        new[order] = (status == InsertStatus.INSERTED) | (status == InsertStatus.EVICTED)
        stored = torch.empty_like(new)
        stored[order] = status != InsertStatus.FAILED
        return InsertedEntries(new, stored, evicted)

    def erase(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor | int,
        *,
        tables: Sequence[int] | None = None,
    ) -> int:
        """See :meth:`Storage.erase` (rows of erased keys are left as they are); ``tables``: as
        :meth:`find`."""
        batch = self.checked_batch(keys, table_ids, tables)
        if not batch.tables:
            return 0
        freed = self.table.erase(batch.keys, batch.table_ids, check=tables is None)
        return int((freed >= 0).sum())

    def export_chunks(
        self, table_id: int, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> Iterator[StorageExport]:
        """See :meth:`Storage.export_chunks`: slot ranges of ``chunk_rows`` slots in ascending
        order, with the index's score words."""
        return self._chunks(self.checked_export(table_id, chunk_rows), chunk_rows)

    def _chunks(self, t: int, chunk_rows: int) -> Iterator[StorageExport]:
        capacity = self.table.capacity(t)
        for begin in range(0, capacity, chunk_rows):
            ex = ops.export(self.table.index, t, begin, min(begin + chunk_rows, capacity))
            if ex.keys.numel():
                rows = self.table.read(t, ex.slots).to(self.device)
                yield StorageExport(ex.keys, rows, ex.scores)

    def size(self, table_id: int) -> int:
        """See :meth:`Storage.size`."""
        return self.table.size(self._table(table_id))

    def memory_usage(self) -> MemoryUsage:
        """The index's tensors and the value rows, on the device or on the host (a hybrid
        table's rows past its ``device_rows`` on the host)."""
        index = self.table.index
        tensors = [getattr(index, f.name) for f in dataclasses.fields(index)]
        used = MemoryUsage.of_tensors([x for x in tensors if isinstance(x, torch.Tensor)])
        for values, config in zip(self.table.values, self.table.configs, strict=True):
            used = used + MemoryUsage.of_values(values, config.device_rows)
        return used

    # ----------------------------------------------------------------------------- internals
    def _read(self, batch: StorageBatch, slots: torch.Tensor) -> torch.Tensor:
        """``(n, width)`` rows of ``batch``'s entries at their ``(n,)`` slots (-1: zeros)."""
        if not batch.tables:
            return torch.zeros((0, 0), dtype=torch.float32, device=self.device)
        rows = read_mixed(self.table.values, batch.table_ids, slots, batch.tables)
        return rows.to(self.device)
