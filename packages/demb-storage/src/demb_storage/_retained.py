"""Keys that left a :class:`~demb_storage.ScoredHashTable`, kept for a caller to drain: the keys
its inserts evicted (tables retaining evictions) and the keys an erase asked to record.

Recording never syncs: a batch appends its keys (``-1`` where nothing is recorded) and their
tables as they are on the device; the buffer is compacted (one sync) once it holds many parts,
and :meth:`KeyBuffer.pop` reads one table's keys out.
"""

from __future__ import annotations

import torch
from demb_kernels.table import EMPTY_KEY

__all__ = ["KeyBuffer"]

_COMPACT_PARTS = 64
"""Parts appended before the buffer compacts them into one (dropping the unrecorded slots)."""


class KeyBuffer:
    """Recorded ``(key, table, slot)`` triples of ``T`` tables, on one device (the slot the key
    left, where the recorder knows it, else -1)."""

    def __init__(self, num_tables: int) -> None:
        self.num_tables = num_tables
        self._keys: list[torch.Tensor] = []
        self._tables: list[torch.Tensor] = []
        self._slots: list[torch.Tensor] = []

    def add(
        self, keys: torch.Tensor, table_ids: torch.Tensor, slots: torch.Tensor | None = None
    ) -> None:
        """Record ``(N,)`` int64 ``keys`` of tables ``table_ids`` (``-1``: nothing recorded at
        that position), optionally with the ``(N,)`` int64 slots they left; no sync."""
        if keys.numel() == 0:
            return
        self._keys.append(keys)
        self._tables.append(table_ids)
        self._slots.append(torch.full_like(keys, -1) if slots is None else slots)
        if len(self._keys) >= _COMPACT_PARTS:
            self._compact()

    def _compact(self) -> None:
        keys, tables, slots = torch.cat(self._keys), torch.cat(self._tables), torch.cat(self._slots)
        kept = keys != EMPTY_KEY
        self._keys, self._tables, self._slots = [keys[kept]], [tables[kept]], [slots[kept]]

    def __len__(self) -> int:
        """Recorded pairs (duplicates included; one sync)."""
        if not self._keys:
            return 0
        return int(sum(int((k != EMPTY_KEY).sum()) for k in self._keys))

    def pop(self, table_id: int) -> torch.Tensor:
        """``(n,)`` int64 the distinct keys recorded for table ``table_id``, ascending, on the
        host; they leave the buffer (the other tables' stay)."""
        return self.pop_with_slots(table_id)[0]

    def pop_with_slots(self, table_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`pop`, and beside each key the slot it left when it was recorded last
        (``(n,)`` int64 on the host, -1 where unknown)."""
        empty = torch.zeros(0, dtype=torch.int64)
        if not self._keys:
            return empty, empty
        self._compact()
        keys, tables, slots = self._keys[0], self._tables[0], self._slots[0]
        mine = tables == table_id
        self._keys, self._tables, self._slots = [keys[~mine]], [tables[~mine]], [slots[~mine]]
        keys, slots = keys[mine], slots[mine]
        distinct, inverse = torch.unique(keys, return_inverse=True)
        order = torch.arange(keys.numel(), device=keys.device)
        last = torch.full_like(distinct, -1).scatter_reduce(0, inverse, order, "amax")
        return distinct.cpu(), slots[last].cpu()

    def clear(self) -> None:
        """Forget every recorded key."""
        self._keys, self._tables, self._slots = [], [], []
