"""Atomic directory commits shared by the checkpoint and delta writers: a staging directory
beside the target, files and folders fsynced, a marker file written last, then one rename or
exchange; and the marker check of their readers."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from demb_io._errors import FormatError
from demb_io._small import MARKER_BYTES, read_small

__all__ = [
    "MARKER",
    "commit_directory",
    "commit_staged",
    "read_marker",
    "remove_stale_staging",
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


_STAGED = re.compile(r"\.(tmp|old)-([0-9a-f]{8})-(\d+)-(\d+)-[0-9a-f]+$")
"""A staging (``.tmp-``) or set-aside (``.old-``) folder's name tail: its writer's host,
process id and process start time, then a random part."""


_PROC = Path("/proc/self/stat").exists()
"""Whether this system says when a process started (Linux ``/proc``): without it no folder is
ever taken for stale."""


def _host() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, ``/proc``), or None when no such
    process runs (or ``/proc`` cannot say)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after the command's name


def _owner_tag() -> str:
    """This process's ``<host>-<pid>-<start time>``, as the folders it stages are named."""
    pid = os.getpid()
    return f"{_host()}-{pid}-{_start_time(pid) or 0}"


def _stale(folder: Path) -> bool:
    """Whether ``folder`` was staged (or set aside) by a writer on this host that no longer
    runs: its process is gone, or its id now belongs to a later process. Folders of other
    hosts, of live writers and of unknown owners are not stale."""
    found = _STAGED.search(folder.name)
    if not _PROC or found is None or found.group(2) != _host():
        return False
    started = _start_time(int(found.group(3)))
    return started is None or started != int(found.group(4))


def remove_stale_staging(target: Path) -> list[Path]:
    """Remove the staging and set-aside folders of ``target`` that killed writers left (see
    :func:`_stale`); the folders removed. A set-aside folder (the previous version, renamed
    aside where the system cannot exchange two paths) is removed only while ``target`` exists:
    a writer killed between its two renames left the previous version there alone."""
    removed = []
    patterns = [f"{target.name}.tmp-*"] + ([f"{target.name}.old-*"] if target.is_dir() else [])
    for pattern in patterns:
        for folder in target.parent.glob(pattern):
            if folder.is_dir() and not folder.is_symlink() and _stale(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


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
    aside = target.with_name(f"{target.name}.old-{_owner_tag()}-{uuid.uuid4().hex[:8]}")
    os.rename(target, aside)
    os.rename(staged, target)
    _fsync_dir(target.parent)
    shutil.rmtree(aside)


def staging_path(target: Path) -> Path:
    """A fresh ``<target>.tmp-<host>-<pid>-<start>-<id>`` beside ``target`` (not created),
    once the staging that killed writers of ``target`` left is removed
    (:func:`remove_stale_staging`)."""
    remove_stale_staging(target)
    return target.with_name(f"{target.name}.tmp-{_owner_tag()}-{uuid.uuid4().hex[:12]}")


def write_synced(path: Path, text: str) -> None:
    """Write a text file and fsync it."""
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def commit_staged(staged: Path, target: Path, marker: str) -> None:
    """Finish a staging directory (its ``MARKER`` holding ``marker``, every folder fsynced),
    make it ``target`` (:func:`commit_directory`), then remove what killed writers of
    ``target`` left (:func:`remove_stale_staging`)."""
    write_synced(staged / MARKER, f"{marker}\n")
    for folder in [p for p in staged.iterdir() if p.is_dir()] + [staged]:
        _fsync_dir(folder)
    commit_directory(staged, target)
    remove_stale_staging(target)  # with the target there, a killed commit's set-aside goes too


def read_marker(directory: Path, marker: str, what: str) -> list[str]:
    """Check that ``directory`` is a committed ``what`` whose marker starts with ``marker``
    (``<format> <version>``); the marker's words after it (a manifest's checksum, or none).

    Raises:
        FormatError: no readable marker, or another format or version.
    """
    path = directory / MARKER
    if _STAGED.search(directory.name):
        raise FormatError(
            directory, "", f"a writer's staging or set-aside folder, not a committed {what}"
        )
    try:
        text = read_small(path, MARKER_BYTES).decode("ascii").split()
    except (FormatError, UnicodeDecodeError) as err:
        raise FormatError(path, "", f"not a committed demb {what} ({err})") from err
    expected = marker.split()
    if text[: len(expected)] != expected:
        raise FormatError(path, "", f"expected '{marker}'")
    return text[len(expected) :]
