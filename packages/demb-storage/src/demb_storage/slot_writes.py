"""Writing keys at given slots of a :class:`~demb_storage.ScoredHashTable` (a replayed delta:
every key lands in the slot it held in its source table, so the target's layout becomes the
source's).

A key can live only in its home bucket (:func:`demb_planner.home_slots`), so each slot is
checked against its key's home bucket before anything is written: :meth:`SlotWrites.check`
validates a whole batch, :meth:`SlotWrites.apply` then writes it. A key that sits elsewhere in
the target (it moved in the source) is removed from its old slot; whatever key occupied a
written slot is replaced (the source replaced it too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from demb_kernels import table as ops
from demb_kernels.table import EMPTY_KEY
from demb_planner import home_slots

from demb_storage._errors import TableConfigError

if TYPE_CHECKING:
    from demb_storage.scored_table import ScoredHashTable

__all__ = ["SlotWrites", "clear_slots"]


class SlotWrites:
    """A checked batch of ``(key, slot)`` writes into one table (build with :meth:`check`).

    Attributes:
        table_id: the table.
        keys: ``(n,)`` int64 on the index device.
        slots: ``(n,)`` int64 table-local slots on the index device.
        digests: ``(n,)`` uint8 each key's digest, on the index device.
    """

    def __init__(
        self,
        table: ScoredHashTable,
        table_id: int,
        keys: torch.Tensor,
        slots: torch.Tensor,
        digests: torch.Tensor,
    ) -> None:
        self.table = table
        self.table_id = table_id
        self.keys = keys
        self.slots = slots
        self.digests = digests

    @classmethod
    def check(
        cls, table: ScoredHashTable, table_id: int, keys: torch.Tensor, slots: torch.Tensor
    ) -> SlotWrites:
        """Validate writing ``(n,)`` int64 ``keys`` at ``(n,)`` int64 table-local ``slots``;
        nothing is written.

        Raises:
            TableConfigError: shapes or dtypes are wrong; a key is the empty key or repeated; a
                slot is repeated, outside the table, or not in its key's home bucket.
        """
        capacity = table.capacity(table_id)
        width = table.index.bucket_width_list[table_id]
        if keys.dtype != torch.int64 or slots.dtype != torch.int64:
            raise TableConfigError("keys/slots", (keys.dtype, slots.dtype), "must be int64")
        if keys.dim() != 1 or keys.shape != slots.shape:
            raise TableConfigError(
                "slots", tuple(slots.shape), f"must be 1-D like keys {tuple(keys.shape)}"
            )
        k = keys.cpu().numpy()
        s = slots.cpu().numpy()
        if (k == EMPTY_KEY).any():
            raise TableConfigError("keys", EMPTY_KEY, "the empty key cannot be written")
        if np.unique(k).size != k.size:
            raise TableConfigError("keys", "repeated keys", "each key is written once")
        if s.size and (s.min() < 0 or s.max() >= capacity):
            bad = int(s[(s < 0) | (s >= capacity)][0])
            raise TableConfigError("slot_index", bad, f"outside the table's {capacity} slots")
        if np.unique(s).size != s.size:
            raise TableConfigError("slot_index", "repeated slots", "each slot is written once")
        home = home_slots(k, capacity, width)
        wrong = home.bucket != s // width
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise TableConfigError(
                "slot_index",
                int(s[i]),
                f"key {int(k[i])} lives in bucket {int(home.bucket[i])} of a {capacity}-slot "
                f"table with {width}-slot buckets, not in bucket {int(s[i]) // width}",
            )
        device = table.device
        return cls(
            table,
            table_id,
            torch.from_numpy(k).to(device),
            torch.from_numpy(s).to(device),
            torch.from_numpy(home.digest).to(device),
        )

    def apply(self, words: torch.Tensor) -> torch.Tensor:
        """Write the keys at their slots with index score ``words`` (``(W, n)`` int64, the
        index's words).

        A key found at another slot of the table is removed from it first; a key already at
        its slot keeps its row. Value rows are not touched (the caller writes them).

        Returns:
            ``(n,)`` bool on the index device: the slot held another key (or none) before, so
            its value row is not this key's.
        """
        index = self.table.index
        t = self.table_id
        lo = index.slot_range(t)[0]
        g = self.slots + lo
        before = index.keys[g]
        taken_over = before != self.keys
        ids = torch.full_like(self.keys, t)
        found = ops.find(index, self.keys, ids, check=False)
        moved = (found >= 0) & (found != self.slots)
        old = found[moved] + lo
        index.keys[old] = EMPTY_KEY
        index.digests[old] = 0
        index.scores[:, old] = 0
        filled = (index.keys[g] == EMPTY_KEY).sum()
        index.keys[g] = self.keys
        index.digests[g] = self.digests
        index.scores[:, g] = words.to(index.scores.device)
        index.sizes[t] += filled - moved.sum()
        return taken_over


def clear_slots(table: ScoredHashTable, table_id: int, slots: torch.Tensor) -> int:
    """Empty table-local ``slots`` (``(m,)`` int64, distinct, within the table) of table
    ``table_id``, whatever keys they hold; value rows are left as they are.

    Returns:
        How many of them held a key.

    Raises:
        TableConfigError: a slot outside the table or repeated.
    """
    capacity = table.capacity(table_id)
    s = slots.cpu()
    if s.numel() and (int(s.min()) < 0 or int(s.max()) >= capacity):
        raise TableConfigError("erased_slot_index", "a slot", f"outside [0, {capacity})")
    if torch.unique(s).numel() != s.numel():
        raise TableConfigError("erased_slot_index", "repeated slots", "each slot once")
    index = table.index
    g = s.to(index.device) + index.slot_range(table_id)[0]
    held = index.keys[g] != EMPTY_KEY
    index.keys[g] = EMPTY_KEY
    index.digests[g] = 0
    index.scores[:, g] = 0
    removed = held.sum()
    index.sizes[table_id] -= removed
    return int(removed)
