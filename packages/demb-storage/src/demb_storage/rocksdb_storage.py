"""``RocksDBStorage``: a :class:`~demb_storage.Storage` in one RocksDB on local disk (an SSD
tier under host memory, the way FBGEMM's SSD tables use RocksDB), through ``rocksdict``.

``rocksdict`` is the ``ssd`` extra of demb-storage (``pip install 'demb-storage[ssd]'``); it is
imported when a storage is built, not with this module.

Layout on disk: one entry per ``(table id, key)``. The RocksDB key is 12 bytes, the table id as
a big-endian uint32 then the key as a big-endian uint64 with its sign bit flipped (so a table's
entries are contiguous and in signed key order). The value is the row's bytes (``width``
elements of the table's dtype) then the ``W`` int64 score words, both in the host's byte order.
The database is a scratch tier: a storage starts empty and is not reopened (a checkpoint goes
through :meth:`~demb_storage.Storage.export`).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from demb_storage._errors import StorageClosedError, StorageError, TableConfigError
from demb_storage.storage import DEFAULT_CHUNK_ROWS, Storage
from demb_storage.storage_results import (
    FoundEntries,
    InsertedEntries,
    MemoryUsage,
    RowLayout,
    StorageExport,
)

if TYPE_CHECKING:
    import rocksdict

__all__ = ["RocksDBStorage"]

_KEY = np.dtype([("table", ">u4"), ("key", ">u8")])
"""The RocksDB key of an entry: 12 bytes."""
_SIGN = np.uint64(1 << 63)
_PROBE = ".demb-write-probe"


def _rocksdict() -> ModuleType:
    """The ``rocksdict`` module, or an ImportError that names the extra to install."""
    try:
        return importlib.import_module("rocksdict")
    except ImportError as err:
        raise ImportError(
            "RocksDBStorage needs rocksdict, the 'ssd' extra of demb-storage: install "
            "'demb-storage[ssd]' (in this workspace: uv sync --extra ssd, or the dev group)"
        ) from err


def _encode_keys(keys: torch.Tensor, table_ids: torch.Tensor) -> list[bytes]:
    """12-byte RocksDB keys of ``(N,)`` int64 ``keys`` of tables ``table_ids`` (CPU)."""
    packed = np.empty(keys.shape[0], dtype=_KEY)
    packed["table"] = table_ids.numpy()
    packed["key"] = keys.numpy().view(np.uint64) ^ _SIGN
    raw = packed.tobytes()
    size = _KEY.itemsize
    return [raw[i : i + size] for i in range(0, len(raw), size)]


def _decode_keys(raw: list[bytes]) -> torch.Tensor:
    """``(n,)`` int64 keys of 12-byte RocksDB keys."""
    packed = np.frombuffer(b"".join(raw), dtype=_KEY)
    return torch.from_numpy((packed["key"] ^ _SIGN).astype(np.uint64).view(np.int64).copy())


def _get_many(db: rocksdict.Rdict, names: list[bytes]) -> list[bytes | None]:
    """One multi-get: the stored value of each key, None where it is absent."""
    got = db.get(cast("list[str | int | float | bytes | bool]", names))
    return cast("list[bytes | None]", got)


def _packed(part: torch.Tensor) -> torch.Tensor:
    """A copy of ``part`` in fresh, packed row-major memory (aligned for a view as a wider
    dtype; ``clone`` and ``contiguous`` may keep the strides or offset of a one-row slice)."""
    return torch.empty(part.shape, dtype=part.dtype).copy_(part)


def _dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:  # a file RocksDB removed meanwhile
                continue
    return total


class RocksDBStorage(Storage):
    """``T`` tables in one RocksDB at ``path``: no capacity limit, evicts nothing.

    Every call is one batched multi-get and (for writes) one WriteBatch; results are on the
    CPU. :meth:`size` is kept exactly (an insert reads which keys were present first).
    :meth:`memory_usage` reports the directory's bytes as ``external`` and RocksDB's memtables
    and block cache as ``host``. Close it (:meth:`close`, or use it as a context manager).

    Args:
        path: a directory for the database, created if missing; it must be writable and hold
            no RocksDB unless ``overwrite``.
        layouts: one :class:`RowLayout` per table.
        score_words: ``W``, int64 score words per entry (1 or 2).
        names: the tables' names, for errors.
        overwrite: destroy a RocksDB found at ``path`` first (else it is an error).

    Raises:
        TableConfigError: ``path`` cannot be created or written, holds a database (without
            ``overwrite``), or RocksDB cannot open it; a layout is invalid. The message names
            the tables.
        ImportError: rocksdict is not installed (the ``ssd`` extra).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        layouts: Sequence[RowLayout],
        *,
        score_words: int = 1,
        names: Sequence[str] | None = None,
        overwrite: bool = False,
    ) -> None:
        super().__init__(layouts, score_words=score_words, names=names, device="cpu")
        rd = _rocksdict()
        self.path = Path(path)
        self._sizes = [0] * self.num_tables
        self._db: rocksdict.Rdict | None = None
        self._check_path(overwrite)
        options = rd.Options(raw_mode=True)
        options.create_if_missing(True)
        try:
            if overwrite:
                rd.Rdict.destroy(str(self.path), options)
            self._db = rd.Rdict(str(self.path), options)
        except Exception as err:  # rocksdict raises plain Exceptions
            raise TableConfigError(
                "path", str(self.path), f"RocksDB cannot open it for {self._tables()}: {err}"
            ) from err
        self._rd = rd

    # ----------------------------------------------------------------------------- interface
    def find(self, keys: torch.Tensor, table_ids: torch.Tensor | int) -> FoundEntries:
        """See :meth:`Storage.find`: one multi-get."""
        batch = self.checked_batch(keys, table_ids)
        out = self.empty_found(batch)
        if not batch.tables:
            return out
        got = _get_many(self._db_open(), _encode_keys(batch.keys, batch.table_ids))
        hits = [(i, v) for i, v in enumerate(got) if v is not None]
        if hits:
            rows, scores = self._decode_values(batch.layout, [v for _, v in hits])
            where = torch.tensor([i for i, _ in hits], dtype=torch.int64)
            out.found[where] = True
            out.values[where] = rows
            out.scores[:, where] = scores
        return out

    def insert(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor | int,
        values: torch.Tensor,
        scores: torch.Tensor,
    ) -> InsertedEntries:
        """See :meth:`Storage.insert`: one multi-get (which keys are new) and one WriteBatch;
        every entry is stored, none evicted."""
        batch = self.checked_batch(keys, table_ids)
        rows, scores = self.checked_rows(batch, values, scores)
        n = batch.keys.shape[0]
        db = self._db_open()
        if n == 0:
            none = torch.zeros(0, dtype=torch.bool)
            return InsertedEntries(none, none.clone(), self.no_evictions(batch))
        names = _encode_keys(batch.keys, batch.table_ids)
        new = [v is None for v in _get_many(db, names)]
        data = self._encode_values(rows, scores)
        writes = self._rd.WriteBatch(raw_mode=True)
        for name, value in zip(names, data, strict=True):
            writes.put(name, value)
        db.write(writes)
        for t, fresh in zip(batch.table_ids.tolist(), new, strict=True):
            self._sizes[t] += fresh
        return InsertedEntries(
            torch.tensor(new, dtype=torch.bool),
            torch.ones(n, dtype=torch.bool),
            self.no_evictions(batch),
        )

    def erase(self, keys: torch.Tensor, table_ids: torch.Tensor | int) -> int:
        """See :meth:`Storage.erase`: one multi-get and one WriteBatch of deletes."""
        batch = self.checked_batch(keys, table_ids)
        if not batch.tables:
            return 0
        db = self._db_open()
        names = _encode_keys(batch.keys, batch.table_ids)
        present: dict[bytes, int] = {}
        for name, value, t in zip(
            names, _get_many(db, names), batch.table_ids.tolist(), strict=True
        ):
            if value is not None:
                present[name] = t
        if not present:
            return 0
        deletes = self._rd.WriteBatch(raw_mode=True)
        for name, t in present.items():
            deletes.delete(name)
            self._sizes[t] -= 1
        db.write(deletes)
        return len(present)

    def export_chunks(
        self, table_id: int, chunk_rows: int = DEFAULT_CHUNK_ROWS
    ) -> Iterator[StorageExport]:
        """See :meth:`Storage.export_chunks`: in ascending (signed) key order, from one
        RocksDB iterator (a consistent view of the database when the iteration starts)."""
        return self._chunks(self.checked_export(table_id, chunk_rows), chunk_rows)

    def size(self, table_id: int) -> int:
        """See :meth:`Storage.size`."""
        return self._sizes[self._table(table_id)]

    def memory_usage(self) -> MemoryUsage:
        """``external``: the database directory's bytes; ``host``: RocksDB's memtables and
        block cache."""
        db = self._db_open()
        host = 0
        for prop in ("rocksdb.cur-size-all-mem-tables", "rocksdb.block-cache-usage"):
            host += db.property_int_value(prop) or 0
        return MemoryUsage(host=host, external=_dir_bytes(self.path))

    def close(self) -> None:
        """Close the database (flushing it); later calls raise :class:`StorageClosedError`.
        Closing twice is allowed."""
        if self._db is not None:
            db, self._db = self._db, None
            db.close()

    # ----------------------------------------------------------------------------- internals
    def _tables(self) -> str:
        return "tables " + ", ".join(repr(n) for n in self.names)

    def _check_path(self, overwrite: bool) -> None:
        """Create ``path`` and write a probe file in it; refuse a database unless
        ``overwrite``."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            probe = self.path / _PROBE
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            raise TableConfigError(
                "path", str(self.path), f"not a writable directory for {self._tables()}: {err}"
            ) from err
        if not overwrite and (self.path / "CURRENT").exists():
            raise TableConfigError(
                "path",
                str(self.path),
                f"already holds a RocksDB; {self._tables()} start empty: pass overwrite=True "
                "to destroy it, or choose another directory",
            )

    def _db_open(self) -> rocksdict.Rdict:
        if self._db is None:
            raise StorageClosedError(f"RocksDBStorage at {self.path} ({self._tables()}) is closed")
        return self._db

    def _encode_values(self, rows: torch.Tensor, scores: torch.Tensor) -> list[bytes]:
        """Per entry, its row's bytes then its score words' bytes."""
        n = rows.shape[0]
        row_bytes = rows.contiguous().reshape(-1).view(torch.uint8).reshape(n, -1)
        score_bytes = scores.t().contiguous().reshape(-1).view(torch.uint8).reshape(n, -1)
        raw = torch.cat([row_bytes, score_bytes], dim=1).numpy()
        return [row.tobytes() for row in raw]

    def _decode_values(
        self, layout: RowLayout | None, data: list[bytes]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(n, width)`` rows and ``(W, n)`` int64 scores of stored values."""
        assert layout is not None  # a batch with entries has a layout
        size = layout.row_bytes + 8 * self.score_words
        joined = bytearray(b"".join(data))
        if len(joined) != size * len(data):
            raise StorageError(
                f"RocksDBStorage at {self.path}: a stored value is not {size} bytes (a "
                "database written with another layout?)"
            )
        raw = torch.frombuffer(joined, dtype=torch.uint8).reshape(len(data), size)
        rows = _packed(raw[:, : layout.row_bytes]).view(layout.dtype)
        scores = _packed(raw[:, layout.row_bytes :]).view(torch.int64).t()
        return rows, scores

    def _chunks(self, t: int, chunk_rows: int) -> Iterator[StorageExport]:
        db = self._db_open()
        layout = self.layout(t)
        prefix = int(t).to_bytes(4, "big")
        it = db.iter()
        it.seek(prefix + bytes(8))
        while it.valid():
            names: list[bytes] = []
            data: list[bytes] = []
            while it.valid() and len(names) < chunk_rows:
                name = it.key()
                if name[:4] != prefix:
                    break
                names.append(name)
                data.append(it.value())
                it.next()
            if not names:
                return
            rows, scores = self._decode_values(layout, data)
            yield StorageExport(_decode_keys(names), rows, scores.contiguous())
            if len(names) < chunk_rows:
                return
