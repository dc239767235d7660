"""The storages under a module's caching tables, seen from the module: one
:class:`StorageGroup` per storage and row layout, so that a step reads and writes every table
of a storage in one call (docs/tiers.md)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch
from demb_kernels.table import EMPTY_KEY
from demb_storage import DynamicEmbeddingTable, Storage, TableConfig

__all__ = [
    "Located",
    "Staged",
    "StorageGroup",
    "StorageSlot",
    "fit_words",
    "match_pairs",
    "storage_groups",
]


@dataclass(frozen=True)
class StorageSlot:
    """Where a caching table's rows live below the cache: ``storage``, as its table
    ``table_id``."""

    storage: Storage
    table_id: int


class Staged(NamedTuple):
    """A group's storage entries read ahead by ``prefetch`` for the next forward."""

    keys: torch.Tensor
    """``(n,)`` int64 on the module's device."""
    ids: torch.Tensor
    """``(n,)`` int64 their module tables."""
    rows: torch.Tensor
    """``(n, width)`` their rows, on the module's device."""
    words: torch.Tensor
    """``(W, n)`` their index score words."""

    def without(self, keys: torch.Tensor, ids: torch.Tensor, tables: Sequence[int]) -> Staged:
        """The entries other than the ``(key, table)`` pairs given (their storage copies
        changed): those become the empty key, which matches no key (nothing compacted, nothing
        waits on the device)."""
        gone = match_pairs(keys, ids, self.keys, self.ids, tables) >= 0
        return self._replace(keys=torch.where(gone, EMPTY_KEY, self.keys))


class Located(NamedTuple):
    """A group's storage entries of some keys, their rows still to read."""

    found: torch.Tensor
    """``(n,)`` bool on the module's device."""
    words: torch.Tensor
    """``(W, n)`` index score words (zeros where not found)."""
    read: Callable[[], torch.Tensor]
    """Reads the ``(n, width)`` rows (zeros where not found) on the storage's device."""
    inputs: tuple[torch.Tensor, ...]
    """The tensors :attr:`read` reads besides the storage's own."""


def match_pairs(
    have_keys: torch.Tensor,
    have_ids: torch.Tensor,
    keys: torch.Tensor,
    ids: torch.Tensor,
    tables: Sequence[int],
) -> torch.Tensor:
    """``(n,)`` int64: for each ``(keys[i], ids[i])``, its position among the pairs
    ``(have_keys, have_ids)`` (distinct), or -1; only tables ``tables`` are looked at.

    One sort of both sides by (table, key, side) and a scan, nothing that waits on the device:
    a pair present on both sides sorts after its match."""
    n, m = have_keys.shape[0], keys.shape[0]
    out = torch.full((m + 1,), -1, dtype=torch.int64, device=keys.device)
    if n == 0 or m == 0:
        return out[:m]
    all_keys = torch.cat([have_keys, keys])
    all_ids = torch.cat([have_ids.to(keys.device), ids])
    # stable sorts, least significant first: side (already: haves, then the others), key, table
    order = torch.argsort(all_keys, stable=True)
    order = order[torch.argsort(all_ids[order], stable=True)]
    k, t = all_keys[order], all_ids[order]
    # a run is a (table, key) pair; its entries are its haves, then its others
    start = torch.ones_like(k, dtype=torch.bool)
    start[1:] = (k[1:] != k[:-1]) | (t[1:] != t[:-1])
    run = torch.cumsum(start, 0) - 1
    at = torch.arange(n + m, device=keys.device)
    first = torch.zeros(n + m + 1, dtype=torch.int64, device=keys.device)
    first.scatter_(0, torch.where(start, run, n + m), at)  # each run's first entry
    head = order[first[run]]  # the run's first entry: a have when the run has one
    matched = (order >= n) & (head < n)
    matched &= torch.isin(t, torch.tensor(list(tables), device=keys.device))
    # unmatched entries write -1 into the spare last element
    out.scatter_(0, torch.where(matched, order - n, m), torch.where(matched, head, -1))
    return out[:m]


def fit_words(words: torch.Tensor, width: int) -> torch.Tensor:
    """``(W, n)`` score words cut or zero-padded to ``width`` words."""
    if words.shape[0] == width:
        return words
    if words.shape[0] > width:
        return words[:width]
    pad = torch.zeros((width - words.shape[0], words.shape[1]), dtype=words.dtype)
    return torch.cat([words, pad.to(words.device)])


class StorageGroup:
    """Caching tables of a module that share one storage and one row layout.

    Args:
        storage: the storage.
        members: ``(module table, storage table)`` pairs.
        num_tables: the module's ``T``.
        device: the module's index device (where results go).
        words: the module index's score words per key.
    """

    def __init__(
        self,
        storage: Storage,
        members: Sequence[tuple[int, int]],
        num_tables: int,
        device: torch.device,
        words: int,
    ) -> None:
        self.storage = storage
        self.tables = [t for t, _ in members]
        local = torch.full((num_tables,), -1, dtype=torch.int64)
        back = torch.full((storage.num_tables,), -1, dtype=torch.int64)
        for t, s in members:
            local[t], back[s] = s, t
        self.local = local.to(device)
        """``(T,)`` each module table's id in the storage (-1: not in this group)."""
        self.back = back.to(storage.device)
        """The module table of each storage table (-1: none of this group's)."""
        self.member = (local >= 0).to(device)
        """``(T,)`` bool: the module's tables in this group."""
        self.whole = bool((local >= 0).all())
        """Every table of the module is in this group."""
        self.device = device
        self.words = words
        self._vouched: dict[str, tuple[int, ...]] = {}
        """Keyword arguments of a :class:`DynamicEmbeddingTable` storage's calls: the storage
        tables of the group (the module checked its batches; the storage need not)."""
        if isinstance(storage, DynamicEmbeddingTable):
            self._vouched = {"tables": tuple(sorted(s for _, s in members))}

    def find(
        self, keys: torch.Tensor, ids: torch.Tensor, vouched: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(n,)`` bool found, ``(n, width)`` rows and ``(W, n)`` index score words of keys of
        the group's module tables ``ids`` (``vouched``: as :meth:`insert`); found and words on
        :attr:`device`."""
        where = self.storage.device
        vouch = self._vouched if vouched else {}
        got = self.storage.find(keys.to(where), self.local[ids].to(where), **vouch)
        return got.found.to(self.device), got.values, fit_words(got.scores, self.words)

    def locate(self, keys: torch.Tensor, ids: torch.Tensor, vouched: bool = False) -> Located:
        """:meth:`find` in two parts: which keys are stored and their score words now, their
        rows when :attr:`Located.read` is called (on a CUDA stream of the caller's choice, while
        nothing writes the storage). A storage other than a :class:`DynamicEmbeddingTable`
        reads its rows now."""
        storage = self.storage
        where = storage.device
        vouch = self._vouched if vouched else {}
        if isinstance(storage, DynamicEmbeddingTable):
            got = storage.locate(keys.to(where), self.local[ids].to(where), **vouch)
            words = fit_words(got.scores, self.words)
            inputs = (got.batch.keys, got.batch.table_ids, got.slots)
            read = partial(storage.read_located, got)
            return Located(got.found.to(self.device), words, read, inputs)
        found, rows, words = self.find(keys, ids, vouched)
        return Located(found, words, lambda: rows, ())

    def buffers(self) -> list[torch.Tensor]:
        """The tensors a :meth:`Located.read` of this group's storage reads (none for a
        storage that reads its rows in :meth:`locate`)."""
        if isinstance(self.storage, DynamicEmbeddingTable):
            return self.storage.buffers()
        return []

    def insert(
        self,
        keys: torch.Tensor,
        ids: torch.Tensor,
        rows: torch.Tensor,
        words: torch.Tensor,
        vouched: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Insert or overwrite entries of module tables ``ids`` with their rows and ``(W, n)``
        index score words (``vouched``: the module's own entries, distinct and checked; a
        :class:`DynamicEmbeddingTable` storage then checks nothing again). Returns the keys that
        left the storage, and their module tables, on :attr:`device`: those it evicted and
        those it had no room for."""
        if keys.numel() == 0:
            empty = torch.zeros(0, dtype=torch.int64, device=self.device)
            return empty, empty
        s = self.storage
        where = s.device
        keys = keys.to(where)
        ids = ids.to(where)
        words = fit_words(words, s.score_words).to(where)
        vouch = self._vouched if vouched else {}
        done = s.insert(keys, self.local.to(where)[ids], rows.to(where), words, **vouch)
        unstored = (~done.stored).nonzero().squeeze(1)
        gone = torch.cat([done.evicted.keys, keys[unstored]])
        tables = torch.cat([self.back[done.evicted.table_ids], ids[unstored]])
        return gone.to(self.device), tables.to(self.device)

    def erase(self, keys: torch.Tensor, ids: torch.Tensor, vouched: bool = False) -> int:
        """Remove keys of module tables ``ids`` (``vouched``: as :meth:`insert`); returns how
        many were stored."""
        if keys.numel() == 0:
            return 0
        where = self.storage.device
        vouch = self._vouched if vouched else {}
        return self.storage.erase(keys.to(where), self.local[ids].to(where), **vouch)


def storage_groups(
    below: Sequence[StorageSlot | None],
    configs: Sequence[TableConfig],
    device: torch.device,
    words: int,
) -> list[StorageGroup]:
    """The caching tables' storages, grouped by storage object and row layout."""
    groups: dict[tuple[int, int, torch.dtype], list[tuple[int, int]]] = {}
    storages: dict[int, Storage] = {}
    for t, slot in enumerate(below):
        if slot is None:
            continue
        c = configs[t]
        storages[id(slot.storage)] = slot.storage
        groups.setdefault((id(slot.storage), c.width, c.dtype), []).append((t, slot.table_id))
    return [
        StorageGroup(storages[key[0]], members, len(below), device, words)
        for key, members in groups.items()
    ]
