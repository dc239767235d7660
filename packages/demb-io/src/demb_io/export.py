"""Exports of a checkpoint table (every rank) to ``.npz`` or Parquet, streamed: the table is read
chunk by chunk and memory holds one chunk. The result is written next to the target and renamed
over it once complete, so a failed export leaves no partial file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from demb_io.checkpoint import Checkpoint
from demb_io.dtypes import to_float32

__all__ = ["export_npz", "export_parquet"]

_CHUNK_ROWS = 1 << 18


def _chunks(
    source: str | Path, collection: str, table: str, float32: bool, chunk_rows: int
) -> Iterator[dict[str, npt.NDArray[np.generic]]]:
    """The table's rows as named arrays, a chunk at a time: ``keys``, ``scores``, ``values``
    and ``state`` (float32, or as stored), and ``admit_keys`` / ``admit_counts`` when a chunk
    carries admission counters."""
    for meta, rows in Checkpoint(source).iter_table(collection, table, chunk_rows):
        arrays: dict[str, npt.NDArray[np.generic]] = {"keys": rows.keys, "scores": rows.scores}
        values = rows.values
        arrays["values"] = to_float32(values, meta.embedding_dtype) if float32 else values
        if rows.state is not None:
            assert meta.optim_state_dtype is not None
            state = rows.state
            arrays["state"] = to_float32(state, meta.optim_state_dtype) if float32 else state
        if rows.admit_keys is not None and rows.admit_counts is not None:
            arrays["admit_keys"], arrays["admit_counts"] = rows.admit_keys, rows.admit_counts
        yield arrays


class _Column:
    """One exported array, appended chunk by chunk to a raw file."""

    def __init__(self, path: Path, like: npt.NDArray[np.generic]) -> None:
        self.path = path
        self.dtype = like.dtype
        self.tail = like.shape[1:]
        self.rows = 0
        self._file = open(path, "wb")  # noqa: SIM115 (closed by finish)

    def append(self, array: npt.NDArray[np.generic]) -> None:
        self._file.write(np.ascontiguousarray(array, dtype=self.dtype).data)
        self.rows += int(array.shape[0])

    def finish(self) -> None:
        self._file.close()

    def store(self, archive: zipfile.ZipFile, name: str) -> None:
        """Add the array as member ``name.npy`` (an ``.npy`` header, then the raw file)."""
        header = {
            "descr": np.lib.format.dtype_to_descr(self.dtype),
            "fortran_order": False,
            "shape": (self.rows, *self.tail),
        }
        with (
            archive.open(f"{name}.npy", "w", force_zip64=True) as member,
            open(self.path, "rb") as raw,
        ):
            np.lib.format.write_array_header_2_0(member, header)
            while block := raw.read(1 << 24):
                member.write(block)


@contextlib.contextmanager
def _landing(target: Path) -> Iterator[Path]:
    """A scratch file beside ``target`` to write the export into: renamed over ``target`` when
    the block ends cleanly, removed otherwise."""
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    out = Path(name)
    try:
        yield out
        os.replace(out, target)
    finally:
        out.unlink(missing_ok=True)


def export_npz(
    source: str | Path,
    collection: str,
    table: str,
    target: str | Path,
    *,
    float32: bool = True,
    chunk_rows: int = _CHUNK_ROWS,
) -> None:
    """Save a table's rows (every rank) as an ``.npz``: ``keys``, ``values`` (float32, or the
    stored words with ``float32=False``), ``scores``, and ``state`` / ``admit_keys`` /
    ``admit_counts`` when present. Streamed: each array goes to a scratch file beside the
    target, chunk by chunk, and the archive is then assembled from them."""
    target = Path(target)
    with (
        _landing(target) as out,
        tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp,
    ):
        columns: dict[str, _Column] = {}
        try:
            for arrays in _chunks(source, collection, table, float32, chunk_rows):
                for name, array in arrays.items():
                    if name not in columns:
                        columns[name] = _Column(Path(tmp) / name, array)
                    columns[name].append(array)
        finally:
            for column in columns.values():
                column.finish()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, column in columns.items():
                column.store(archive, name)


def export_parquet(
    source: str | Path,
    collection: str,
    table: str,
    target: str | Path,
    *,
    float32: bool = True,
    chunk_rows: int = _CHUNK_ROWS,
) -> None:
    """Save a table's rows (every rank) as a Parquet file, one row per key: ``key``, ``values``
    (a fixed-size list of float32, or of the stored words with ``float32=False``), ``scores``
    (a list of int64), and ``state`` when present; one row group per chunk read. Needs the
    ``parquet`` extra (pyarrow).

    Raises:
        ImportError: pyarrow is not installed (``pip install demb-io[parquet]``).
    """
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as err:
        raise ImportError(
            "export to parquet needs pyarrow: pip install 'demb-io[parquet]'"
        ) from err

    def rows_of(a: npt.NDArray[np.generic]) -> object:
        flat = pa.array(np.ascontiguousarray(a).reshape(-1))
        return pa.FixedSizeListArray.from_arrays(flat, a.shape[1])

    with _landing(Path(target)) as out:
        writer: Any = None
        try:
            for arrays in _chunks(source, collection, table, float32, chunk_rows):
                columns = {"key": pa.array(arrays["keys"])}
                for name in ("values", "scores", "state"):
                    if name in arrays:
                        columns[name] = rows_of(arrays[name])
                batch = pa.table(columns)
                if writer is None:  # the first chunk (maybe of an empty shard) sets the schema
                    writer = pq.ParquetWriter(str(out), batch.schema)
                if batch.num_rows:
                    writer.write_table(batch)
        finally:
            if writer is not None:
                writer.close()
