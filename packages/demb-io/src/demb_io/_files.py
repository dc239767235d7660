"""Raw files of a shard or delta: appended arrays with a running CRC-32, rows read back."""

from __future__ import annotations

import functools
import io
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Protocol

import numpy as np
import numpy.typing as npt

from demb_io._crc import block_crcs
from demb_io._errors import FormatError
from demb_io.dtypes import storage_dtype
from demb_io.meta import FileEntry

__all__ = [
    "KEY",
    "PartWriter",
    "RowFile",
    "RowMeta",
    "check_arrays",
    "read_rows",
    "row_layout",
    "row_shapes",
]


KEY = np.dtype("<i8")
"""Keys, scores, slots and counters: int64, little-endian."""

_ADVISE = hasattr(os, "posix_fadvise")  # Linux and most Unix; not macOS or Windows
_PREADV = hasattr(os, "preadv")  # Linux and BSDs
_SPLIT = 8 << 20
"""A read of at least this many bytes goes to the disk as two halves at once (two requests in
flight keep a disk read steady where one alternates between fast and slow)."""


@functools.cache
def _readers(pid: int) -> ThreadPoolExecutor:
    """The two threads that read a big read's halves in process ``pid`` (made on first use; a
    forked child makes its own)."""
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="demb-io-read")


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Bytes read into ``view`` from ``offset`` (fewer only at the end of the file)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            break
        done += got
    return done


def _read_at(fd: int, view: memoryview, offset: int) -> int:
    """Bytes read into ``view`` from ``offset``: a big read in two halves on two threads."""
    if len(view) < _SPLIT:
        return _pread_full(fd, view, offset)
    half = len(view) // 2 // 4096 * 4096
    parts = [(view[:half], offset), (view[half:], offset + half)]
    got = list(_readers(os.getpid()).map(lambda part: _pread_full(fd, *part), parts))
    return got[0] + got[1] if got[0] == half else got[0]


class RowMeta(Protocol):
    """What a shard's or a delta table's meta says about its row-aligned parts."""

    @property
    def embedding_dim(self) -> int: ...
    @property
    def embedding_dtype(self) -> str: ...
    @property
    def state_width(self) -> int: ...
    @property
    def optim_state_dtype(self) -> str | None: ...
    @property
    def num_scores(self) -> int: ...


def row_layout(meta: RowMeta) -> dict[str, tuple[int, np.dtype[np.generic]]]:
    """Per row-aligned part (``keys``, ``values``, ``scores``, and ``state`` when the meta
    has one): values per row and storage dtype."""
    layout: dict[str, tuple[int, np.dtype[np.generic]]] = {
        "keys": (1, KEY),
        "values": (meta.embedding_dim, storage_dtype(meta.embedding_dtype)),
        "scores": (meta.num_scores, KEY),
    }
    if meta.state_width:
        assert meta.optim_state_dtype is not None
        layout["state"] = (meta.state_width, storage_dtype(meta.optim_state_dtype))
    return layout


def row_shapes(meta: RowMeta, n: int) -> dict[str, tuple[tuple[int, ...], np.dtype[np.generic]]]:
    """The arrays of ``n`` rows: ``keys`` ``(n,)``, the other parts ``(n, width)``."""
    return {
        part: ((n,) if part == "keys" else (n, width), dtype)
        for part, (width, dtype) in row_layout(meta).items()
    }


def check_arrays(
    owner: str,
    arrays: object,
    expected: dict[str, tuple[tuple[int, ...], np.dtype[np.generic]]],
) -> None:
    """Each named attribute of ``arrays`` has the expected shape and dtype (any byte order:
    writers store little-endian).

    Raises:
        ValueError: naming ``owner`` and the array.
    """
    for name, (shape, dtype) in expected.items():
        a = getattr(arrays, name)
        if a is None or a.shape != shape or a.dtype.newbyteorder("<") != dtype:
            got = None if a is None else (a.shape, str(a.dtype))
            raise ValueError(f"{owner}: {name} must be {shape} {dtype}, got {got}")


class PartWriter:
    """Appends arrays to one file. On close the file is fsynced and, meanwhile, the CRC-32 of
    each :data:`CRC_BLOCK` bytes is computed from the file's own pages (memory-mapped: what
    was written, without a copy), so checksumming overlaps the flush to disk instead of the
    writes, and the caller may reuse an array's memory as soon as :meth:`write` returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.bytes = 0

    def write(self, array: npt.NDArray[np.generic]) -> None:
        little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))  # the format's
        data = little.reshape(-1).view(np.uint8).data
        self.file.write(data)
        self.bytes += len(data)

    def abort(self) -> None:
        """Close the file unfinished (no fsync, no CRCs): its folder is being dropped."""
        self.file.close()

    def close(self) -> FileEntry:
        """Flush and fsync the file, with its block CRC-32s; the file is closed either way."""
        try:
            self.file.flush()
            with ThreadPoolExecutor(max_workers=1) as flusher:
                synced = flusher.submit(os.fsync, self.file.fileno())
                crcs = block_crcs(self.path, self.bytes)
                synced.result()
        finally:
            self.file.close()
        return FileEntry(self.path.name, self.bytes, tuple(crcs))


class RowFile:
    """A file of ``width``-wide rows open for a chunked read: one descriptor for the whole read,
    advised sequential, so the kernel's readahead follows it from chunk to chunk (a file opened
    anew per chunk starts its readahead over each time)."""

    def __init__(self, path: Path, width: int, dtype: np.dtype[np.generic]) -> None:
        self.path = path
        self.width = width
        self.dtype = dtype
        self.row_bytes = width * dtype.itemsize
        self.file: io.FileIO = open(path, "rb", buffering=0)  # noqa: SIM115 (closed in close())
        if _ADVISE:
            os.posix_fadvise(self.file.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def read(
        self,
        begin: int,
        count: int,
        out: npt.NDArray[np.generic] | None = None,
        ahead: int = 0,
    ) -> npt.NDArray[np.generic]:
        """Rows ``[begin, begin + count)`` as ``(count, width)`` (into ``out[:count]`` when
        given: a reused buffer of at least ``count`` rows). With ``ahead``, the next ``ahead``
        rows are then asked of the disk in the background (``posix_fadvise(WILLNEED)``, where
        the system has it): a chunked read's next chunk loads while the caller uses this one.

        Raises:
            FormatError: the file ends first (naming it).
        """
        array = np.empty((count, self.width), dtype=self.dtype) if out is None else out[:count]
        view = array.reshape(-1).view(np.uint8).data
        if _PREADV:
            got = _read_at(self.file.fileno(), view, begin * self.row_bytes)
        else:
            self.file.seek(begin * self.row_bytes)
            got = self.file.readinto(view) or 0
        if ahead and _ADVISE:
            start, size = (begin + count) * self.row_bytes, ahead * self.row_bytes
            os.posix_fadvise(self.file.fileno(), start, size, os.POSIX_FADV_WILLNEED)
        if got != array.nbytes:
            raise FormatError(
                self.path, "", f"truncated while reading rows {begin}..{begin + count}"
            )
        return array

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> RowFile:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def read_rows(
    path: Path,
    begin: int,
    count: int,
    width: int,
    dtype: np.dtype[np.generic],
    out: npt.NDArray[np.generic] | None = None,
) -> npt.NDArray[np.generic]:
    """Rows ``[begin, begin + count)`` of a file of ``width``-wide rows, as ``(count, width)``
    (into ``out[:count]`` when given), in one read (:class:`RowFile` for a chunked one)."""
    with RowFile(path, width, dtype) as f:
        return f.read(begin, count, out)
