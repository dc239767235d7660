"""The ``Storage`` interface: where the rows of one or more tables live, as a table's last tier.

A storage holds, for each ``(table id, key)`` entry of tables ``0 .. T-1``, a value row
``[embedding | optimizer state]`` of the table's :class:`RowLayout` and ``W`` int64 score
words (:attr:`Storage.score_words`, the same for every table). Every method is batched:

- ``keys``: ``(N,)`` int64; ``table_ids``: ``(N,)`` int64 table of each key, or one ``int``
  for the whole batch.
- The tables of one call must share one row width and dtype (their rows come back as one
  ``(N, width)`` tensor); call once per group of tables otherwise (:class:`StorageBatchError`).
- ``values``: ``(N, width)`` rows, converted to the tables' dtype; ``scores``: ``(W, N)`` int64
  score words (the layout of the index words of :class:`~demb_storage.ScoredHashTable`).
- Results are on :attr:`Storage.device` (the CPU for host and external storages).

Implementations: :class:`~demb_storage.DynamicEmbeddingTable` (a
:class:`~demb_storage.ScoredHashTable` on its device, the default),
:class:`~demb_storage.RocksDBStorage` (an SSD tier, the ``ssd`` extra), and a dict-backed demo
in the tests (``PyDictStorage``). See docs/storage.md.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import NamedTuple, Self

import torch

from demb_storage._errors import StorageBatchError, TableConfigError
from demb_storage.storage_results import (
    EvictedEntries,
    FoundEntries,
    InsertedEntries,
    MemoryUsage,
    RowLayout,
    StorageExport,
)

__all__ = [
    "DEFAULT_CHUNK_ROWS",
    "Storage",
    "StorageBatch",
]

DEFAULT_CHUNK_ROWS = 65536
"""Rows per chunk of :meth:`Storage.export_chunks` unless told."""


def _repeats(keys: torch.Tensor, table_ids: torch.Tensor, tables: int) -> bool:
    """Whether a ``(table, key)`` pair appears twice (one sync): sorted by key, then stably by
    table, equal pairs are neighbours."""
    order = torch.argsort(keys, stable=True)
    if tables > 1:
        order = order[torch.argsort(table_ids[order], stable=True)]
    k, t = keys[order], table_ids[order]
    return bool(((k[1:] == k[:-1]) & (t[1:] == t[:-1])).any())


class StorageBatch(NamedTuple):
    """A checked batch of entries (see :meth:`Storage.checked_batch`)."""

    keys: torch.Tensor
    """``(N,)`` int64 on the storage's device."""
    table_ids: torch.Tensor
    """``(N,)`` int64 on the storage's device, each in ``[0, T)``."""
    tables: tuple[int, ...]
    """The distinct tables of the batch, ascending."""
    layout: RowLayout | None
    """The row layout the batch's tables share; None for an empty batch of no known table."""

    @property
    def width(self) -> int:
        """Elements per row of the batch (0 for an empty batch of no known table)."""
        return 0 if self.layout is None else self.layout.width

    @property
    def dtype(self) -> torch.dtype:
        """dtype of the batch's rows (float32 for an empty batch of no known table)."""
        return torch.float32 if self.layout is None else self.layout.dtype


class Storage(abc.ABC):
    """Rows and scores of ``T`` tables, keyed by ``(table id, key)``; a table's last tier.

    Subclasses implement :meth:`find`, :meth:`insert`, :meth:`erase`, :meth:`export_chunks`,
    :meth:`size` and :meth:`memory_usage`, and may override :meth:`close`. The base class keeps
    the layouts and names and checks batches (:meth:`checked_batch`, :meth:`checked_rows`).

    Contract every implementation keeps (tests/test_storage_contract.py checks it):

    - :meth:`insert` stores each row (overwriting a present key's row and scores) unless the
      storage has no room for it; to make room it may evict keys of the call's tables that are
      not in the call, and reports them with their rows and scores.
    - :meth:`find` returns what the last insert of a key stored, until the key is erased or
      evicted; it changes nothing (no score is touched).
    - :meth:`export_chunks` yields every stored entry of a table once (in an order of the
      storage's choosing) while the storage is not modified.

    Args:
        layouts: one :class:`RowLayout` per table.
        score_words: ``W``, int64 score words stored per entry: 1 or 2.
        names: the tables' names, for errors (default: ``tables[t]``).
        device: where the storage's results are.

    Raises:
        TableConfigError: no table, a layout that is not a valid :class:`RowLayout`, bad
            ``score_words`` or ``names``; the option is prefixed by the table's name.
    """

    def __init__(
        self,
        layouts: Sequence[RowLayout],
        *,
        score_words: int = 1,
        names: Sequence[str] | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if not layouts:
            raise TableConfigError("layouts", layouts, "a storage needs at least one table")
        if names is not None and len(names) != len(layouts):
            raise TableConfigError("names", names, f"expected one name per table ({len(layouts)})")
        default = [f"tables[{t}]" for t in range(len(layouts))]
        self._names = tuple(default if names is None else (str(n) for n in names))
        for t, layout in enumerate(layouts):
            if not isinstance(layout, RowLayout):
                raise TableConfigError(f"{self._names[t]}.layout", layout, "not a RowLayout")
            layout.check(self._names[t])
        if isinstance(score_words, bool) or score_words not in (1, 2):
            raise TableConfigError("score_words", score_words, "must be 1 or 2")
        self._layouts = tuple(layouts)
        self._score_words = int(score_words)
        self._device = torch.device(device)

    # ----------------------------------------------------------------------------- layout
    @property
    def num_tables(self) -> int:
        """``T``."""
        return len(self._layouts)

    @property
    def score_words(self) -> int:
        """``W``: int64 score words stored per entry."""
        return self._score_words

    @property
    def device(self) -> torch.device:
        """Where results (found rows, exports, evictions) are."""
        return self._device

    @property
    def names(self) -> tuple[str, ...]:
        """The tables' names (``tables[t]`` for tables given none)."""
        return self._names

    def layout(self, table_id: int) -> RowLayout:
        """The row layout of table ``table_id``."""
        return self._layouts[self._table(table_id)]

    def embedding_dim(self, table_id: int) -> int:
        """Embedding columns of a row of table ``table_id``."""
        return self.layout(table_id).dim

    def width(self, table_id: int) -> int:
        """Elements per row of table ``table_id`` (embedding + optimizer state)."""
        return self.layout(table_id).width

    def check_layouts(
        self,
        layouts: Sequence[RowLayout],
        *,
        score_words: int | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        """Check that this storage can be the last tier of tables of ``layouts`` (and
        ``score_words``, when given): same number of tables, same width and dtype each.

        Raises:
            TableConfigError: the first table that disagrees, named (``names``, else this
                storage's names), with both layouts.
        """
        kind = type(self).__name__
        if len(layouts) != self.num_tables:
            raise TableConfigError(
                "external_storage",
                kind,
                f"holds {self.num_tables} tables, the tables using it are {len(layouts)}",
            )
        for t, want in enumerate(layouts):
            have = self._layouts[t]
            if (have.width, have.dtype) != (want.width, want.dtype):
                name = names[t] if names is not None else self._names[t]
                raise TableConfigError(
                    f"{name}.external_storage",
                    kind,
                    f"holds rows of {have.describe()}, the table needs {want.describe()}",
                )
        if score_words is not None and score_words != self._score_words:
            raise TableConfigError(
                "external_storage",
                kind,
                f"stores {self._score_words} score words per key, the tables need {score_words}",
            )

    # ----------------------------------------------------------------------------- interface
    @abc.abstractmethod
    def find(self, keys: torch.Tensor, table_ids: torch.Tensor | int) -> FoundEntries:
        """Look keys up; nothing changes.

        Args:
            keys: ``(N,)`` int64.
            table_ids: ``(N,)`` int64 table of each key (tables of one row layout), or one table.

        Returns:
            :class:`FoundEntries`: ``found`` ``(N,)`` bool, ``values`` ``(N, width)`` in the
            tables' dtype (zeros where not found), ``scores`` ``(W, N)`` int64 (zeros where not
            found).

        Raises:
            StorageBatchError: a malformed batch.
        """

    @abc.abstractmethod
    def insert(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor | int,
        values: torch.Tensor,
        scores: torch.Tensor,
    ) -> InsertedEntries:
        """Insert entries or overwrite them (rows and scores).

        Args:
            keys: ``(N,)`` int64, unique per table within the call.
            table_ids: ``(N,)`` int64 table of each key (tables of one row layout), or one table.
            values: ``(N, width)`` floating rows, converted to the tables' dtype.
            scores: ``(W, N)`` int64 score words.

        Returns:
            :class:`InsertedEntries`: which keys were new, which were stored, and the entries
            evicted to make room (none for a storage without a capacity limit).

        Raises:
            StorageBatchError: a malformed batch, or a key twice in one table.
        """

    @abc.abstractmethod
    def erase(self, keys: torch.Tensor, table_ids: torch.Tensor | int) -> int:
        """Remove entries; returns how many were present (a key given twice counts once)."""

    @abc.abstractmethod
    def export_chunks(
        self, table_id: int, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> Iterator[StorageExport]:
        """Every entry of table ``table_id``, in non-empty chunks of at most ``chunk_rows`` rows
        (``chunk_rows`` slots for a slot-addressed storage). The storage must not be modified
        while the iterator is open."""

    @abc.abstractmethod
    def size(self, table_id: int) -> int:
        """Entries of table ``table_id``."""

    @abc.abstractmethod
    def memory_usage(self) -> MemoryUsage:
        """Bytes this storage holds, per kind of memory."""

    # ----------------------------------------------------------------------------- derived
    def export(self, table_id: int) -> StorageExport:
        """Every entry of table ``table_id`` at once (:meth:`export_chunks` concatenated)."""
        chunks = list(self.export_chunks(table_id))
        if not chunks:
            return self.empty_export(table_id)
        return StorageExport(
            torch.cat([c.keys for c in chunks]),
            torch.cat([c.values for c in chunks]),
            torch.cat([c.scores for c in chunks], dim=1),
        )

    def import_(
        self, table_id: int, keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor
    ) -> InsertedEntries:
        """Insert an export of table ``table_id`` (``(n,)`` keys, ``(n, width)`` rows, ``(W, n)``
        scores): :meth:`insert` of one table."""
        return self.insert(keys, self._table(table_id), values, scores)

    def close(self) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Release what the storage holds open (files, handles); the default does nothing."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # ----------------------------------------------------------------------------- helpers
    def checked_batch(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor | int,
        tables: Sequence[int] | None = None,
    ) -> StorageBatch:
        """``keys`` and ``table_ids`` checked and moved to :attr:`device` (one sync).

        ``tables``: the distinct tables of the ids, when the caller knows them (a caching
        table's storage group): the ids are then trusted to be among them and only the tables
        are checked (no sync).

        Raises:
            StorageBatchError: keys not ``(N,)`` int64, table ids not ``(N,)`` integers or one
                integer in ``[0, T)``, or tables of different row layouts in one batch.
        """
        if not isinstance(keys, torch.Tensor) or keys.dim() != 1 or keys.dtype != torch.int64:
            got = (tuple(keys.shape), keys.dtype) if isinstance(keys, torch.Tensor) else keys
            raise StorageBatchError("keys", f"expected an (N,) int64 tensor, got {got!r}")
        keys = keys.to(self._device)
        if not isinstance(table_ids, torch.Tensor):
            t = self._table(table_ids)
            ids = torch.full_like(keys, t)
            return StorageBatch(keys, ids, (t,), self._layouts[t])
        if table_ids.shape != keys.shape or table_ids.is_floating_point() or table_ids.is_complex():
            raise StorageBatchError(
                "table_ids",
                f"expected {tuple(keys.shape)} integers, got {tuple(table_ids.shape)} "
                f"{table_ids.dtype}",
            )
        ids = table_ids.to(self._device, torch.int64)
        if tables is None:
            tables = torch.unique(ids).tolist()
        tables = tuple(sorted(int(t) for t in tables))
        bad = [t for t in tables if not 0 <= t < self.num_tables]
        if bad:
            raise StorageBatchError(
                "table_ids", f"table id {bad[0]} out of range for {self.num_tables} tables"
            )
        if not tables:
            return StorageBatch(keys, ids, (), None)
        first = self._layouts[tables[0]]
        for t in tables[1:]:
            other = self._layouts[t]
            if (other.width, other.dtype) != (first.width, first.dtype):
                raise StorageBatchError(
                    "table_ids",
                    f"{self._names[tables[0]]} ({first.describe()}) and {self._names[t]} "
                    f"({other.describe()}) in one call: their rows differ; call once per table",
                )
        return StorageBatch(keys, ids, tables, first)

    def checked_rows(
        self,
        batch: StorageBatch,
        values: torch.Tensor,
        scores: torch.Tensor,
        distinct: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``values`` as ``(N, width)`` rows of the batch's dtype and ``scores`` as ``(W, N)``
        int64, both on :attr:`device`, for an insert of ``batch`` with keys unique per table
        (``distinct``: the caller vouches for that; not checked, no sync).

        Raises:
            StorageBatchError: wrong shapes or dtypes, or a key twice in one table.
        """
        n = batch.keys.shape[0]
        label = self._label(batch)
        if not isinstance(values, torch.Tensor) or not values.is_floating_point():
            got = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
            raise StorageBatchError("values", f"expected floating rows for {label}, got {got}")
        empty = batch.layout is None and values.dim() == 2 and n == values.shape[0] == 0
        if values.shape != (n, batch.width) and not empty:
            raise StorageBatchError(
                "values",
                f"expected ({n}, {batch.width}) rows for {label}, got {tuple(values.shape)}",
            )
        if not isinstance(scores, torch.Tensor) or scores.dtype != torch.int64:
            got = scores.dtype if isinstance(scores, torch.Tensor) else type(scores).__name__
            raise StorageBatchError("scores", f"expected int64 score words, got {got}")
        if scores.shape != (self._score_words, n):
            raise StorageBatchError(
                "scores",
                f"expected ({self._score_words}, {n}) score words, got {tuple(scores.shape)}",
            )
        if n > 1 and not distinct and _repeats(batch.keys, batch.table_ids, len(batch.tables)):
            raise StorageBatchError("keys", f"a key appears twice in one insert ({label})")
        rows = values.to(self._device, batch.dtype).contiguous()
        return rows, scores.to(self._device).contiguous()

    def empty_found(self, batch: StorageBatch) -> FoundEntries:
        """A :class:`FoundEntries` of ``batch`` with nothing found."""
        n = batch.keys.shape[0]
        return FoundEntries(
            torch.zeros(n, dtype=torch.bool, device=self._device),
            torch.zeros((n, batch.width), dtype=batch.dtype, device=self._device),
            torch.zeros((self._score_words, n), dtype=torch.int64, device=self._device),
        )

    def no_evictions(self, batch: StorageBatch) -> EvictedEntries:
        """An :class:`EvictedEntries` with no entry, in ``batch``'s row layout."""
        empty = torch.empty(0, dtype=torch.int64, device=self._device)
        return EvictedEntries(
            empty,
            empty.clone(),
            torch.empty((0, batch.width), dtype=batch.dtype, device=self._device),
            torch.empty((self._score_words, 0), dtype=torch.int64, device=self._device),
        )

    def empty_export(self, table_id: int) -> StorageExport:
        """A :class:`StorageExport` of table ``table_id`` with no entry."""
        layout = self.layout(table_id)
        return StorageExport(
            torch.empty(0, dtype=torch.int64, device=self._device),
            torch.empty((0, layout.width), dtype=layout.dtype, device=self._device),
            torch.empty((self._score_words, 0), dtype=torch.int64, device=self._device),
        )

    def checked_export(self, table_id: int, chunk_rows: int) -> int:
        """``table_id`` of an :meth:`export_chunks` call, checked with its ``chunk_rows``.

        Raises:
            StorageBatchError: a table id out of range, or ``chunk_rows`` not a positive
                integer.
        """
        if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
            raise StorageBatchError(
                "chunk_rows", f"expected a positive integer, got {chunk_rows!r}"
            )
        return self._table(table_id)

    def _table(self, table_id: int) -> int:
        """``table_id`` checked: an integer in ``[0, T)``."""
        if isinstance(table_id, bool) or not isinstance(table_id, int):
            raise StorageBatchError("table_id", f"expected an integer, got {table_id!r}")
        if not 0 <= table_id < self.num_tables:
            raise StorageBatchError(
                "table_id", f"table id {table_id} out of range for {self.num_tables} tables"
            )
        return table_id

    def _label(self, batch: StorageBatch) -> str:
        """The batch's tables, named, for messages."""
        return ", ".join(self._names[t] for t in batch.tables) or "no table"
