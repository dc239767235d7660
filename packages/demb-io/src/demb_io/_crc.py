"""The CRC-32 of each :data:`CRC_BLOCK`-byte block of a file: computed from a file just written,
and checked against a meta's list. Blocks are read through a read-only memory map, so a block
costs its checksum and no copy; blocks are checksummed on worker threads, several at once and
beside other work (a read, an fsync).

The checksum is zlib's CRC-32 (``zlib.crc32``, which releases the GIL). With the ``crc`` extra
installed (python-isal) the same values come from ISA-L's ``crc32``, several times faster
(19 GB/s against 3 GB/s on the project's CPU VM): formats and files are the same either way.
"""

from __future__ import annotations

import mmap
import os
import zlib
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from demb_io._errors import FormatError
from demb_io.meta import CRC_BLOCK, FileEntry

__all__ = ["BlockChecks", "block_crcs", "check_crcs", "crc32", "crc32_backend"]

crc32: Callable[[memoryview], int]
"""``crc32(data)``: zlib's CRC-32 of a buffer, from ISA-L when the ``crc`` extra is installed."""
try:
    from isal.isal_zlib import crc32
except ImportError:  # numpy and demb-planner only: zlib's own
    crc32 = zlib.crc32


def crc32_backend() -> str:
    """``"isal"`` or ``"zlib"``: where :func:`crc32` comes from."""
    return "zlib" if crc32 is zlib.crc32 else "isal"


_INLINE_BYTES = 1 << 20
"""Files of at most this many bytes in all are checksummed on the calling thread (starting
worker threads would cost more than the checksums)."""


def _blocks(path: Path, size: int) -> list[memoryview]:
    """The file's first ``size`` bytes as its :data:`CRC_BLOCK`-byte blocks, mapped read-only
    (none for an empty file)."""
    if size == 0:
        return []
    with open(path, "rb") as f:
        view = memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))
    return [view[start : start + CRC_BLOCK] for start in range(0, size, CRC_BLOCK)]


def _pool(workers: int) -> ThreadPoolExecutor:
    """Worker threads for checksums: ``workers``, at most one per CPU."""
    return ThreadPoolExecutor(max_workers=max(1, min(workers, os.cpu_count() or 1)))


def _expected(path: Path, part: str, entry: FileEntry, size: int) -> tuple[int, ...]:
    assert entry.crc32 is not None
    blocks = -(-size // CRC_BLOCK)
    if blocks != len(entry.crc32):
        raise FormatError(path, part, f"{blocks} blocks, the meta lists {len(entry.crc32)}")
    return entry.crc32


def _compare(path: Path, part: str, block: int, got: int, want: int) -> None:
    if got != want:
        raise FormatError(
            path, part, f"CRC-32 of block {block} is {got:#010x}, the meta says {want:#010x}"
        )


def block_crcs(path: Path, size: int, workers: int = 2) -> list[int]:
    """The CRC-32 of each :data:`CRC_BLOCK`-byte block of the file's first ``size`` bytes, read
    through a memory map (its pages, no copy), several blocks at once."""
    blocks = _blocks(path, size)
    if len(blocks) <= 1:  # a small file: no threads to start
        return [crc32(b) for b in blocks]
    with _pool(workers) as pool:
        return list(pool.map(crc32, blocks))


class BlockChecks:
    """The CRC-32 checks of several files' blocks, running on worker threads (one per CPU, at
    most ``workers``) from the moment it is made, blocks in the order a chunked read needs them
    (by their position in their file). :meth:`wait` returns once the blocks a read used are
    checked, so a reader that reads a chunk and then waits overlaps checking with reading.

    Use as a context manager: leaving it stops the checks not started.
    """

    def __init__(self, files: list[tuple[str, Path, FileEntry]], workers: int = 2) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._files: dict[str, tuple[Path, tuple[int, ...]]] = {}
        self._futures: dict[str, list[Future[int]]] = {}
        self._checked: dict[str, int] = {}
        tasks: list[tuple[float, int, str, memoryview]] = []  # (place in file, file, ...)
        for order, (part, path, entry) in enumerate(files):
            if entry.crc32 is None:
                continue
            size = path.stat().st_size
            self._files[part] = (path, _expected(path, part, entry, size))
            self._futures[part] = []
            self._checked[part] = 0
            for k, block in enumerate(_blocks(path, size)):
                tasks.append((k * CRC_BLOCK / size, order, part, block))
        if sum(len(t[3]) for t in tasks) <= _INLINE_BYTES:  # small: checked here, no threads
            for _, _, part, block in tasks:
                done: Future[int] = Future()
                done.set_result(crc32(block))
                self._futures[part].append(done)
            return
        self._pool = _pool(workers)
        for _, _, part, block in sorted(tasks, key=lambda t: t[:2]):
            self._futures[part].append(self._pool.submit(crc32, block))

    def wait(self, part: str, end: int | None = None) -> None:
        """Wait for the checks of ``part``'s blocks that start below byte ``end`` (all without
        ``end``); a part without CRCs passes.

        Raises:
            FormatError: a block whose CRC-32 differs, naming the file, the part and the block.
        """
        if part not in self._files:
            return
        path, want = self._files[part]
        futures = self._futures[part]
        block = self._checked[part]
        while block < len(futures) and (end is None or block * CRC_BLOCK < end):
            _compare(path, part, block, futures[block].result(), want[block])
            block += 1
        self._checked[part] = block

    def __enter__(self) -> BlockChecks:
        return self

    def __exit__(self, *_: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


def check_crcs(path: Path, part: str, entry: FileEntry) -> None:
    """Check a file's blocks against ``entry.crc32``, several blocks at once (one per CPU).

    Raises:
        FormatError: the first block whose CRC-32 differs, naming the file and the part.
    """
    if entry.crc32 is None:
        return
    size = path.stat().st_size
    if size <= CRC_BLOCK:  # one block at most: checked here, no threads to start
        expected = _expected(path, part, entry, size)
        for block, (data, want) in enumerate(zip(_blocks(path, size), expected, strict=True)):
            _compare(path, part, block, crc32(data), want)
        return
    with BlockChecks([(part, path, entry)], workers=os.cpu_count() or 1) as checks:
        checks.wait(part)
