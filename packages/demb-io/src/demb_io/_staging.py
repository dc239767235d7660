"""Atomic directory commits shared by the checkpoint and delta writers: a staging directory
beside the target, files and folders fsynced, a marker file written last, then one rename or
exchange; and the marker check of their readers."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import uuid
from pathlib import Path

from demb_io._errors import FormatError

__all__ = [
    "MARKER",
    "commit_directory",
    "commit_staged",
    "read_marker",
    "staging_path",
    "write_synced",
]

MARKER = "FORMAT"
"""The file that marks a committed directory: ``<format> <version>``."""

_RENAME_EXCHANGE = 2  # renameat2 flag: swap two paths atomically (Linux >= 3.15)
_AT_FDCWD = -100


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (renameat2 RENAME_EXCHANGE); False where the system
    cannot."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    ok = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    return bool(ok == 0)


def commit_directory(staged: Path, target: Path) -> None:
    """Make ``staged`` (complete, fsynced) the directory at ``target``, atomically: at every
    moment ``target`` is the old checkpoint or the new one. A missing target is a rename; an
    existing one is swapped with ``renameat2(RENAME_EXCHANGE)`` and then deleted. Where the
    system has no exchange, the old directory is first renamed aside (``<target>.old-<id>``), so
    a crash between the two renames leaves it there, whole."""
    if not target.exists():
        os.rename(staged, target)
        _fsync_dir(target.parent)
        return
    if _exchange(staged, target):
        _fsync_dir(target.parent)
        shutil.rmtree(staged)  # now the old checkpoint
        return
    aside = target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(target, aside)
    os.rename(staged, target)
    _fsync_dir(target.parent)
    shutil.rmtree(aside)


def staging_path(target: Path) -> Path:
    """A fresh ``<target>.tmp-<id>`` beside ``target`` (not created)."""
    return target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:12]}")


def write_synced(path: Path, text: str) -> None:
    """Write a text file and fsync it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit_staged(staged: Path, target: Path, marker: str) -> None:
    """Finish a staging directory (its ``MARKER`` holding ``marker``, every folder fsynced)
    and make it ``target`` (:func:`commit_directory`)."""
    write_synced(staged / MARKER, f"{marker}\n")
    for folder in [p for p in staged.iterdir() if p.is_dir()] + [staged]:
        _fsync_dir(folder)
    commit_directory(staged, target)


def read_marker(directory: Path, marker: str, what: str) -> None:
    """Check that ``directory`` is a committed ``what`` whose marker reads ``marker``.

    Raises:
        FormatError: no readable marker, or another format or version.
    """
    path = directory / MARKER
    try:
        text = path.read_bytes().decode("ascii").split()
    except (OSError, UnicodeDecodeError) as err:
        raise FormatError(path, "", f"not a committed demb {what} ({err})") from err
    if text != marker.split():
        raise FormatError(path, "", f"expected '{marker}'")
