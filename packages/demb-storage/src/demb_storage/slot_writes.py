"""Writing keys at given slots of a :class:`~demb_storage.ScoredHashTable` (a replayed delta:
every key lands in the slot it held in its source table, so the target's layout becomes the
source's).

A key can live only in its home bucket (:func:`demb_planner.home_slots`; computed here on the
index's device by :func:`home_buckets`), so each slot is checked against its key's home bucket
before anything is written: :meth:`SlotWrites.check`
validates a whole batch, :meth:`SlotWrites.apply` then writes it. A key that sits elsewhere in
the target (it moved in the source) is removed from its old slot; whatever key occupied a
written slot is replaced (the source replaced it too).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from demb_kernels import delta_ops
from demb_kernels import table as ops
from demb_kernels.ops import hash64
from demb_kernels.table import EMPTY_KEY, TableIndex
from demb_planner import DIGEST_MODULUS, TABLE_HASH_SEED

from demb_storage._errors import TableConfigError

if TYPE_CHECKING:
    from demb_storage.scored_table import ScoredHashTable

__all__ = [
    "SlotWriteBatch",
    "SlotWrites",
    "batch_checks",
    "clear_slots",
    "home_buckets",
    "write_ops",
]

_LOW63 = (1 << 63) - 1
_PAIR_SHIFT = 52
"""Where a table id goes in the word its (key, table) pair is mixed into: ``key ^ (table <<
52)`` (SlotWriteBatch.check; table ids taken modulo 2048, so no bit leaves the word)."""


def home_buckets(
    keys: torch.Tensor, capacity: int | torch.Tensor, width: int | torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Home bucket (``(n,)`` int64) and digest (``(n,)`` uint8) of ``(n,)`` int64 ``keys`` in a
    table of ``capacity`` slots and ``width``-slot buckets, on the keys' device: the rule of
    :func:`demb_planner.home_slots` (``h = fmix64(u ^ TABLE_HASH_SEED)``, bucket ``(h %
    capacity) // width``, digest ``1 + (h >> 56) % 127``) in int64 torch ops, the unsigned
    ``h`` held in its int64 bits. ``capacity`` and ``width`` may be ``(n,)`` int64 tensors,
    each key's own table's."""
    seed = TABLE_HASH_SEED - (1 << 64) if TABLE_HASH_SEED >= 1 << 63 else TABLE_HASH_SEED
    h = hash64(keys ^ seed)
    half = (h >> 1) & _LOW63  # h // 2, unsigned
    position = ((half % capacity) * 2 + (h & 1)) % capacity
    digest = 1 + ((h >> 56) & 0xFF) % DIGEST_MODULUS
    return torch.div(position, width, rounding_mode="floor"), digest.to(torch.uint8)


def _repeats(values: torch.Tensor) -> torch.Tensor:
    """Whether ``values`` holds a value twice (a ``()`` bool tensor, no sync)."""
    ordered = torch.sort(values).values
    return (ordered[1:] == ordered[:-1]).any()


def _failed_checks(
    keys: torch.Tensor,
    slots: torch.Tensor,
    capacity: int | torch.Tensor,
    width: int | torch.Tensor,
    bucket: torch.Tensor,
    distinct_keys: torch.Tensor,
    distinct_slots: torch.Tensor,
) -> list[bool]:
    """The checks of slot writes, read back at once (one sync): the empty key, a repeated key
    (a repeat in ``distinct_keys``), a slot outside its table, a repeated slot (a repeat in
    ``distinct_slots``), a slot outside its key's home ``bucket``. ``capacity`` and ``width``
    per table or per entry."""
    flags = torch.zeros(5, dtype=torch.bool, device=keys.device)
    if keys.numel():
        flags[0] = (keys == EMPTY_KEY).any()
        flags[1] = _repeats(distinct_keys)
        flags[2] = ((slots < 0) | (slots >= capacity)).any()
        flags[3] = _repeats(distinct_slots)
        flags[4] = (bucket != torch.div(slots, width, rounding_mode="floor")).any()
    return [bool(f) for f in flags.tolist()]


def _raise(
    bad: list[bool],
    keys: torch.Tensor,
    slots: torch.Tensor,
    bucket: torch.Tensor,
    capacity: int,
    width: int,
) -> None:
    """The error of the first failed check (``bad``: the flags of :meth:`SlotWrites.check`)."""
    if bad[0]:
        raise TableConfigError("keys", EMPTY_KEY, "the empty key cannot be written")
    if bad[1]:
        raise TableConfigError("keys", "repeated keys", "each key is written once")
    if bad[2]:
        out = slots[(slots < 0) | (slots >= capacity)]
        raise TableConfigError("slot_index", int(out[0]), f"outside the table's {capacity} slots")
    if bad[3]:
        raise TableConfigError("slot_index", "repeated slots", "each slot is written once")
    i = int(torch.nonzero(bucket != torch.div(slots, width, rounding_mode="floor"))[0, 0])
    raise TableConfigError(
        "slot_index",
        int(slots[i]),
        f"key {int(keys[i])} lives in bucket {int(bucket[i])} of a {capacity}-slot table with "
        f"{width}-slot buckets, not in bucket {int(slots[i]) // width}",
    )


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
        nothing is written. The checks run on the index's device (one sync).

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
        device = table.device
        k = keys.to(device, non_blocking=True)
        s = slots.to(device, non_blocking=True)
        bucket, digest = home_buckets(k, capacity, width)
        bad = _failed_checks(k, s, capacity, width, bucket, k, s)
        if any(bad):
            _raise(bad, k, s, bucket, capacity, width)
        return cls(table, table_id, k, s, digest)

    def apply(self, words: torch.Tensor) -> torch.Tensor:
        """Write the keys at their slots with index score ``words`` (``(W, n)`` int64, the
        index's words).

        A key found at another slot of the table is removed from it first; a key already at
        its slot keeps its row. Value rows are not touched (the caller writes them).

        Returns:
            ``(n,)`` bool on the index device: the slot held another key (or none) before, so
            its value row is not this key's.
        """
        t = self.table_id
        lo = self.table.index.slot_range(t)[0]
        ids = torch.full_like(self.keys, t)
        return _write(self.table, ids, self.keys, self.slots, lo, self.digests, words)


def _write(
    table: ScoredHashTable,
    ids: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    lo: int | None,
    digests: torch.Tensor,
    words: torch.Tensor,
) -> torch.Tensor:
    """Write ``(n,)`` keys of tables ``ids`` at their table-local ``slots`` (``lo``: the
    tables' first global slot when all are one table's, else None); see
    :meth:`SlotWrites.apply`. The tables' slot ranges are disjoint, so a batch of several
    tables writes as its tables one after another."""
    index = table.index
    if index.keys.device.type == "cpu":  # one pass of a CPU kernel
        return delta_ops.slot_writes_apply(index, keys, ids, slots, digests, words)
    first = index.slot_offsets[ids] if lo is None else lo
    return write_ops(index, ids, keys, slots, first, digests, words)


def write_ops(
    index: TableIndex,
    ids: torch.Tensor,
    keys: torch.Tensor,
    slots: torch.Tensor,
    lo: int | torch.Tensor,
    digests: torch.Tensor,
    words: torch.Tensor,
) -> torch.Tensor:
    """:func:`~demb_kernels.delta_ops.slot_writes_apply` in tensor ops (what CUDA runs),
    ``lo`` each entry's table's first global slot."""
    g = slots + lo
    taken_over = index.keys[g] != keys
    found = ops.find(index, keys, ids, check=False)
    moved = (found >= 0) & (found != slots)
    old = (found + lo)[moved]
    index.keys[old] = EMPTY_KEY
    index.digests[old] = 0
    index.scores[:, old] = 0
    filled = index.keys[g] == EMPTY_KEY
    index.keys[g] = keys
    index.digests[g] = digests
    index.scores[:, g] = words.to(index.scores.device)
    n = index.sizes.shape[0]
    gained = torch.bincount(ids[filled], minlength=n)
    index.sizes += gained - torch.bincount(ids[moved], minlength=n)
    return taken_over


class SlotWriteBatch:
    """Checked ``(key, slot)`` writes into several tables of one table set, checked and applied
    in one pass each (the per-table :class:`SlotWrites` costs a few dozen small ops a table).

    Attributes:
        bounds: each part's first entry in the batch, then the batch's length (``len(parts) +
            1`` ints).
        slots: ``(n,)`` int64 table-local slots of every part, on the index device.
    """

    def __init__(
        self,
        table: ScoredHashTable,
        ids: torch.Tensor,
        keys: torch.Tensor,
        slots: torch.Tensor,
        digests: torch.Tensor,
        bounds: list[int],
    ) -> None:
        self.table = table
        self.ids = ids
        self.keys = keys
        self.slots = slots
        self.digests = digests
        self.bounds = bounds

    @classmethod
    def check(
        cls,
        table: ScoredHashTable,
        parts: Sequence[tuple[int, torch.Tensor, torch.Tensor]],
        *,
        checked: bool = False,
    ) -> SlotWriteBatch | None:
        """Validate ``parts``, ``(table_id, keys, slots)`` with ``(n_i,)`` int64 keys and
        table-local slots, each table once, as :meth:`SlotWrites.check` validates one (one
        sync for all). Returns None when some check fails (or may have: see the repeated-key
        check): :meth:`SlotWrites.check` of each part then names the failure, or passes them
        all, and ``checked=True`` builds the batch without checking again. Nothing is
        written."""
        ids_list = [t for t, _, _ in parts]
        if len(set(ids_list)) != len(ids_list):
            raise TableConfigError("table_id", ids_list, "each table once in a batch")
        for table_id, k, s in parts:
            table.capacity(table_id)  # checks the table id
            if k.dtype != torch.int64 or s.dtype != torch.int64:
                return None
            if k.dim() != 1 or k.shape != s.shape:
                return None
        device = table.device
        index = table.index
        counts = [int(k.shape[0]) for _, k, _ in parts]
        bounds = [0, *itertools.accumulate(counts)]
        keys = torch.cat([k.to(device) for _, k, _ in parts])
        slots = torch.cat([s.to(device) for _, _, s in parts])
        if device.type == "cpu":  # one pass of a CPU kernel (the ids without a tensor op)
            ids = torch.from_numpy(np.repeat(np.asarray(ids_list, dtype=np.int64), counts))
            digests, flags = delta_ops.slot_writes_check(index, keys, ids, slots)
        else:
            per_part = torch.tensor(counts, device=device)
            ids = torch.repeat_interleave(torch.tensor(ids_list, device=device), per_part)
            digests, flags = batch_checks(index, keys, ids, slots, flags=not checked)
        if not checked and any(flags):
            return None
        return cls(table, ids, keys, slots, digests, bounds)

    def part(self, i: int) -> slice:
        """The entries of part ``i`` in the batch."""
        return slice(self.bounds[i], self.bounds[i + 1])

    def apply(self, words: torch.Tensor) -> torch.Tensor:
        """Write every part (``words``: ``(W, n)`` int64 index score words, in batch order);
        returns ``(n,)`` bool, as :meth:`SlotWrites.apply`."""
        return _write(self.table, self.ids, self.keys, self.slots, None, self.digests, words)


def batch_checks(
    index: TableIndex,
    keys: torch.Tensor,
    ids: torch.Tensor,
    slots: torch.Tensor,
    *,
    flags: bool = True,
) -> tuple[torch.Tensor, list[bool]]:
    """:func:`~demb_kernels.delta_ops.slot_writes_check` in tensor ops (what CUDA runs; one
    sync): ``(N,)`` uint8 digests of ``(N,)`` int64 ``keys`` of tables ``ids`` written at
    table-local ``slots``, and the five flags (none computed when not ``flags``). A key twice
    in one table is found as its (key, table) pair mixed into one word repeating: two pairs
    may also mix alike, a false alarm (the tables' own checks then decide)."""
    device = keys.device
    capacity = index.slot_offsets[ids + 1] - index.slot_offsets[ids]
    width = torch.tensor(index.bucket_width_list, device=device)[ids]
    bucket, digest = home_buckets(keys, capacity, width)
    if not flags:
        return digest, []
    pairs = keys ^ ((ids % 2048) << _PAIR_SHIFT)
    global_slots = slots + index.slot_offsets[ids]  # the tables' ranges are disjoint
    return digest, _failed_checks(keys, slots, capacity, width, bucket, pairs, global_slots)


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
