"""``PyDictStorage``: the spec's demo of an external :class:`~demb_storage.Storage`, one Python
dict per table, for tests (and as the smallest example of the interface).

With ``capacity``, a table holds at most that many keys: a new key that finds its table full
evicts the entry with the lowest first score word (the oldest entry among equals) that is not a
key of the same call, or is not stored when every entry is one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from demb_storage import (
    EvictedEntries,
    FoundEntries,
    InsertedEntries,
    MemoryUsage,
    RowLayout,
    Storage,
    StorageExport,
)
from demb_storage.storage import DEFAULT_CHUNK_ROWS

__all__ = ["PyDictStorage"]

Entry = tuple[torch.Tensor, torch.Tensor]
"""``(width,)`` row and ``(W,)`` int64 score words."""


class PyDictStorage(Storage):
    """``T`` dicts ``key -> (row, scores)`` on the CPU.

    Args:
        layouts: one :class:`RowLayout` per table.
        score_words: ``W`` (1 or 2).
        names: the tables' names, for errors.
        capacity: most keys per table (default: no limit, nothing is evicted).
    """

    def __init__(
        self,
        layouts: Sequence[RowLayout],
        *,
        score_words: int = 1,
        names: Sequence[str] | None = None,
        capacity: int | None = None,
    ) -> None:
        super().__init__(layouts, score_words=score_words, names=names)
        self.capacity = capacity
        self.tables: list[dict[int, Entry]] = [{} for _ in layouts]

    def find(self, keys, table_ids) -> FoundEntries:
        batch = self.checked_batch(keys, table_ids)
        out = self.empty_found(batch)
        for i, (t, k) in enumerate(zip(batch.table_ids.tolist(), batch.keys.tolist(), strict=True)):
            entry = self.tables[t].get(k)
            if entry is not None:
                out.found[i] = True
                out.values[i] = entry[0]
                out.scores[:, i] = entry[1]
        return out

    def insert(self, keys, table_ids, values, scores) -> InsertedEntries:
        batch = self.checked_batch(keys, table_ids)
        rows, scores = self.checked_rows(batch, values, scores)
        n = batch.keys.shape[0]
        pairs = list(zip(batch.table_ids.tolist(), batch.keys.tolist(), strict=True))
        in_call = set(pairs)
        inserted = torch.zeros(n, dtype=torch.bool)
        stored = torch.zeros(n, dtype=torch.bool)
        gone: list[tuple[int, int, Entry]] = []
        for i, (t, k) in enumerate(pairs):
            table = self.tables[t]
            if k not in table and self.capacity is not None and len(table) >= self.capacity:
                victim = self._victim(t, in_call)
                if victim is None:
                    continue
                gone.append((t, victim, table.pop(victim)))
            inserted[i] = k not in table
            stored[i] = True
            table[k] = (rows[i].clone(), scores[:, i].clone())
        evicted = self.no_evictions(batch)
        if gone:
            evicted = EvictedEntries(
                torch.tensor([k for _, k, _ in gone], dtype=torch.int64),
                torch.tensor([t for t, _, _ in gone], dtype=torch.int64),
                torch.stack([e[0] for _, _, e in gone]),
                torch.stack([e[1] for _, _, e in gone], dim=1),
            )
        return InsertedEntries(inserted, stored, evicted)

    def _victim(self, t: int, in_call: set[tuple[int, int]]) -> int | None:
        candidates = [
            (int(e[1][0]), pos, k)
            for pos, (k, e) in enumerate(self.tables[t].items())
            if (t, k) not in in_call
        ]
        return min(candidates)[2] if candidates else None

    def erase(self, keys, table_ids) -> int:
        batch = self.checked_batch(keys, table_ids)
        removed = 0
        for t, k in zip(batch.table_ids.tolist(), batch.keys.tolist(), strict=True):
            removed += self.tables[t].pop(k, None) is not None
        return removed

    def export_chunks(
        self, table_id: int, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> Iterator[StorageExport]:
        items = list(self.tables[self.checked_export(table_id, chunk_rows)].items())
        for begin in range(0, len(items), chunk_rows):
            part = items[begin : begin + chunk_rows]
            yield StorageExport(
                torch.tensor([k for k, _ in part], dtype=torch.int64),
                torch.stack([e[0] for _, e in part]),
                torch.stack([e[1] for _, e in part], dim=1),
            )

    def size(self, table_id: int) -> int:
        return len(self.tables[self._table(table_id)])

    def memory_usage(self) -> MemoryUsage:
        host = sum(r.nbytes + s.nbytes for table in self.tables for r, s in table.values())
        return MemoryUsage(host=host)
