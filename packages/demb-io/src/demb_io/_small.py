"""Bounded reads of a checkpoint's small files (its ``FORMAT`` marker, its meta JSONs): only a
regular file, opened without blocking, at most a cap of bytes. A FIFO, a device, a folder or an
oversized file in their place is a :class:`FormatError`, never a hang or a ``MemoryError``."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from demb_io._errors import FormatError

__all__ = ["MARKER_BYTES", "META_BYTES", "read_small", "regular_size"]

MARKER_BYTES = 4096
"""The most a ``FORMAT`` marker holds."""
META_BYTES = 16 << 20
"""The most a meta JSON holds (a few KB in practice)."""


def regular_size(path: Path, part: str) -> int:
    """The size of the data file ``path`` (the ``part`` of a shard or delta), which must be a
    regular file (a symlink counts as what it points to).

    Raises:
        FormatError: it cannot be read, or is a folder, FIFO or device.
    """
    try:
        info = os.stat(path)
    except OSError as err:
        raise FormatError(path, part, f"cannot be read ({err.strerror or err})") from err
    if not stat.S_ISREG(info.st_mode):
        raise FormatError(path, part, "not a regular file")
    return info.st_size


def read_small(path: Path, limit: int) -> bytes:
    """The bytes of the small regular file ``path``.

    Raises:
        FormatError: it cannot be opened, is not a regular file (a folder, FIFO, device; a
            symlink counts as what it points to), or holds more than ``limit`` bytes.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens without a writer
    except OSError as err:
        raise FormatError(path, "", f"cannot be read ({err.strerror or err})") from err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FormatError(path, "", "not a regular file")
        if info.st_size > limit:
            raise FormatError(path, "", f"{info.st_size} bytes, more than the {limit} expected")
        chunks = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as err:
        raise FormatError(path, "", f"cannot be read ({err.strerror or err})") from err
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:  # grew since its size was read
        raise FormatError(path, "", f"more than the {limit} bytes expected")
    return data
