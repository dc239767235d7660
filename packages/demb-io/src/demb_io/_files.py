"""Raw files of a shard or delta: appended arrays with a running CRC-32, rows read back."""

from __future__ import annotations

import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np
import numpy.typing as npt

from demb_io._errors import FormatError
from demb_io.meta import FileEntry

__all__ = ["PartWriter", "file_crc32", "read_rows"]

_READ_BLOCK = 1 << 24  # bytes per read while checking a CRC


class PartWriter:
    """Appends arrays to one file, counting bytes and the CRC-32 as it goes. The CRC of a block
    is computed on a worker thread while the block is written (both release the GIL), in
    order, so checksumming costs no time beside the write."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.bytes = 0
        self.crc = 0
        self._crc_worker = ThreadPoolExecutor(max_workers=1)  # one worker: CRCs in order
        self._pending: list[Future[None]] = []

    def _add_crc(self, data: memoryview) -> None:
        self.crc = zlib.crc32(data, self.crc)

    def write(self, array: npt.NDArray[np.generic]) -> None:
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8).data
        self._pending.append(self._crc_worker.submit(self._add_crc, data))
        self.file.write(data)
        self.bytes += len(data)
        if len(self._pending) > 2:  # bounded: the blocks in flight stay referenced until done
            self._pending.pop(0).result()

    def close(self) -> FileEntry:
        for pending in self._pending:
            pending.result()
        self._crc_worker.shutdown()
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return FileEntry(self.path.name, self.bytes, self.crc)


def read_rows(
    path: Path,
    begin: int,
    count: int,
    width: int,
    dtype: np.dtype[np.generic],
    out: npt.NDArray[np.generic] | None = None,
) -> npt.NDArray[np.generic]:
    """Rows ``[begin, begin + count)`` of a file of ``width``-wide rows, as ``(count, width)``
    (into ``out[:count]`` when given: a reused buffer of at least ``count`` rows)."""
    array = np.empty((count, width), dtype=dtype) if out is None else out[:count]
    with open(path, "rb", buffering=0) as f:
        f.seek(begin * width * dtype.itemsize)
        got = f.readinto(array.reshape(-1).view(np.uint8).data)
    if got != array.nbytes:
        raise FormatError(path, "", f"truncated while reading rows {begin}..{begin + count}")
    return array


def file_crc32(path: Path) -> int:
    """The CRC-32 of a whole file, read in blocks."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            crc = zlib.crc32(block, crc)
    return crc
