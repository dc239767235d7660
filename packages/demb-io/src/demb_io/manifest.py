"""The manifest of a checkpoint or delta: every file of the directory, with its size and the
CRC-32 of each block, written after all of them and checksummed by the ``FORMAT`` marker that
commits the directory (``<format> <version> manifest <crc32>``).

A reader opens a directory through :func:`open_tree`, which checks the tree against the
manifest before anything else is read: a file missing, extra, renamed or of another size, a
folder in a file's place, a FIFO or device, or a symlink leaving the directory is a
:class:`~demb_io.FormatError` naming it. The metas the reader then reads are checked against
the manifest too (:meth:`Manifest.read_meta`), and the files each meta lists must be the
manifest's (:meth:`Manifest.check_files`), so a meta swapped, copied or edited is caught before
its rows are read. A directory written before manifests existed (its marker names none) is read
as before, with one warning.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from demb_io._crc import block_crcs, crc32
from demb_io._errors import FormatError
from demb_io._small import MARKER_BYTES, META_BYTES, read_small
from demb_io._staging import MARKER, commit_staged, read_marker, write_synced
from demb_io.meta import FileEntry, _check_keys, _field, file_entry

__all__ = [
    "MANIFEST",
    "MANIFEST_BYTES",
    "Manifest",
    "commit_with_manifest",
    "open_tree",
    "reseal",
]

MANIFEST = "MANIFEST.json"
"""The manifest's file name, beside ``FORMAT``."""
MANIFEST_BYTES = 256 << 20
"""The most a manifest holds (about a million files)."""
_FORMAT = "demb-manifest"
_VERSION = 1
_Meta = TypeVar("_Meta")
_META_SUFFIX = ".meta.json"
_KEYS = frozenset({"format", "format_version", "content", "files"})


def _relative(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _manifest_text(
    directory: Path, content: str, describe: Callable[[Path], Iterable[FileEntry]]
) -> bytes:
    """The manifest of ``directory``'s collection folders (see :func:`commit_with_manifest`)."""
    folders = sorted(p for p in directory.iterdir() if p.is_dir())
    described: dict[str, FileEntry] = {}
    for folder in folders:
        for meta in sorted(folder.glob("*.meta.json")):
            for entry in describe(meta):
                described[f"{folder.name}/{entry.name}"] = entry
    files: dict[str, dict[str, Any]] = {}
    for folder in folders:
        for path in sorted(folder.iterdir()):
            name = _relative(directory, path)
            size = path.stat().st_size
            known = described.get(name)
            crcs = known.crc32 if known is not None and known.bytes == size else None
            if crcs is None:
                crcs = tuple(block_crcs(path, size))
            files[name] = {"bytes": size, "crc32": list(crcs)}
    document = {"format": _FORMAT, "format_version": _VERSION, "content": content, "files": files}
    return json.dumps(document, indent=1, sort_keys=True).encode()


def _seal(directory: Path, marker: str, text: bytes) -> str:
    """Write the manifest ``text`` into ``directory``; the marker that commits it."""
    write_synced(directory / MANIFEST, text.decode())
    return f"{marker} manifest {crc32(memoryview(text)):08x}"


def commit_with_manifest(
    staged: Path,
    target: Path,
    marker: str,
    describe: Callable[[Path], Iterable[FileEntry]],
) -> None:
    """Write the manifest of the staging directory ``staged`` (every file in its collection
    folders), then commit it to ``target`` with the marker ``<marker> manifest <crc32>``
    (:func:`~demb_io._staging.commit_staged`).

    Args:
        staged: the complete staging directory (collection folders of files).
        target: where it is committed.
        marker: ``<format> <version>``.
        describe: the file entries a meta JSON lists (names in its folder, sizes, CRC-32s):
            the data files they name are taken from their metas, not read again; only the
            metas (and any file no meta names) are checksummed here.
    """
    text = _manifest_text(staged, marker.split()[0], describe)
    commit_staged(staged, target, _seal(staged, marker, text))


def reseal(directory: str | Path) -> None:
    """Rewrite the manifest (and marker) of the committed checkpoint or delta ``directory``
    from the files it holds now, every file checksummed anew: for a directory edited on
    purpose (a repair, a test). Not atomic; the directory's old manifest is replaced."""
    directory = Path(directory)
    words = read_small(directory / MARKER, MARKER_BYTES).decode("ascii").split()[:2]
    marker = " ".join(words)
    text = _manifest_text(directory, words[0], lambda _: ())
    write_synced(directory / MARKER, f"{_seal(directory, marker, text)}\n")


@dataclass(frozen=True)
class Manifest:
    """A committed directory's manifest (``files`` None: a directory without one).

    Attributes:
        root: the directory.
        files: per file (``<collection>/<name>``), its size and block CRC-32s.
    """

    root: Path
    files: Mapping[str, FileEntry] | None

    def read_meta(self, path: Path, parse: Callable[[Path, bytes], _Meta]) -> _Meta:
        """The meta JSON ``path`` (bounded: :data:`~demb_io._small.META_BYTES`) as ``parse``
        reads it from its bytes (its schema checked first, so a damaged field is named), then
        checked to be the manifest's bytes.

        Raises:
            FormatError: unreadable, a field ``parse`` refuses, or not the bytes the manifest
                lists.
        """
        data = read_small(path, META_BYTES)
        meta = parse(path, data)
        if self.files is None:
            return meta
        entry = self.files.get(_relative(self.root, path))
        if entry is None:
            raise FormatError(path, "", "not in the manifest")
        if len(data) != entry.bytes or (crc32(memoryview(data)),) != tuple(entry.crc32 or ()):
            raise FormatError(path, "", "differs from the manifest (a meta edited or swapped)")
        return meta

    def check_files(self, meta_path: Path, files: Mapping[str, FileEntry]) -> None:
        """The files a meta lists (``files``: per part) are the manifest's: same names, sizes
        and CRC-32s.

        Raises:
            FormatError: naming the meta and the part.
        """
        if self.files is None:
            return
        folder = _relative(self.root, meta_path.parent)
        for part, entry in files.items():
            listed = self.files.get(f"{folder}/{entry.name}")
            if listed is None or (listed.bytes, listed.crc32) != (entry.bytes, entry.crc32):
                raise FormatError(meta_path, f"files.{part}", "differs from the manifest")


def _read_manifest(root: Path, expected_crc: str, content: str) -> dict[str, FileEntry]:
    path = root / MANIFEST
    data = read_small(path, MANIFEST_BYTES)
    if f"{crc32(memoryview(data)):08x}" != expected_crc:
        raise FormatError(path, "", f"its CRC-32 is not the {expected_crc} that {MARKER} records")
    try:
        d = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(path, "", f"not a readable manifest ({err})") from err
    if not isinstance(d, dict):
        raise FormatError(path, "", "a manifest must hold an object")
    _check_keys(d, path, _KEYS)
    for name, wanted in (("format", _FORMAT), ("format_version", _VERSION), ("content", content)):
        if _field(d, path, name, type(wanted)) != wanted:
            raise FormatError(path, name, f"{d[name]!r} is not {wanted!r}")
    files = {}
    for name, entry in _field(d, path, "files", dict).items():
        parts = name.split("/")
        plain = len(parts) == 2 and all(p not in ("", ".", "..") for p in parts)
        if not plain or not isinstance(entry, dict):
            raise FormatError(path, f"files.{name}", "not a <collection>/<file> entry")
        _check_keys(entry, path, frozenset({"bytes", "crc32"}))
        files[name] = file_entry({"name": parts[1], **entry}, path, name)
    return files


def _inside(real_root: str, path: Path) -> os.stat_result:
    """The status of what ``path`` names (a symlink: what it points to, which must lie inside
    the directory ``real_root``).

    Raises:
        FormatError: a symlink leaving the directory, or one that points nowhere.
    """
    try:
        info = os.lstat(path)
    except OSError as err:
        raise FormatError(path, "", f"cannot be read ({err.strerror or err})") from err
    if not stat.S_ISLNK(info.st_mode):
        return info
    real = os.path.realpath(path)
    if os.path.commonpath([real_root, real]) != real_root:
        raise FormatError(path, "", "a symlink leaving the directory")
    try:
        return os.stat(real)
    except OSError as err:
        raise FormatError(path, "", f"a symlink to nothing ({err.strerror or err})") from err


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as err:
        raise FormatError(folder, "", f"cannot be listed ({err.strerror or err})") from err


def _walk(root: Path, strict: bool) -> dict[str, os.stat_result]:
    """Every file of the collection folders of ``root`` (what symlinks inside point to), by
    ``<collection>/<name>``. ``strict``: anything else (a file beside ``FORMAT``, a folder in a
    collection, a symlinked folder) is an error; else it is left alone, as readers always did.

    Raises:
        FormatError: a symlink leaving ``root`` or a strict tree's stray entry.
    """
    real_root = os.path.realpath(root)
    found: dict[str, os.stat_result] = {}
    for entry in _entries(root):
        path = root / entry.name
        info = _inside(real_root, path)
        if entry.name in (MARKER, MANIFEST):
            continue
        if not stat.S_ISDIR(info.st_mode) or entry.is_symlink():
            if strict:
                raise FormatError(
                    path,
                    "",
                    "not in the manifest (a file or symlink where only collection folders belong)",
                )
            continue
        for item in _entries(path):
            inner = path / item.name
            item_info = _inside(real_root, inner)
            if strict and not stat.S_ISREG(item_info.st_mode):
                raise FormatError(inner, "", "not a regular file")
            found[_relative(root, inner)] = item_info
    return found


def open_tree(root: Path, marker: str, what: str) -> Manifest:
    """Open the committed ``what`` (checkpoint or delta) at ``root``, whose marker starts with
    ``marker`` (``<format> <version>``), and check its tree against its manifest.

    Raises:
        FormatError: not a committed directory of that format, a bad manifest, or a tree that
            differs from it (naming the file: missing, extra or renamed, another size, not a
            regular file, a symlink leaving ``root``).
    """
    extra = read_marker(root, marker, what)
    if not extra and os.path.lexists(root / MANIFEST):
        raise FormatError(root / MARKER, "", f"names no manifest, but {MANIFEST} is there")
    if not extra:
        warnings.warn(
            f"{root}: a {what} without a manifest (written before demb-io kept one): a missing "
            "or extra file cannot be told",
            stacklevel=3,
        )
        _walk(root, strict=False)
        return Manifest(root, None)
    if len(extra) != 2 or extra[0] != "manifest" or len(extra[1]) != 8:
        raise FormatError(root / MARKER, "", f"expected '{marker} manifest <crc32>'")
    _inside(os.path.realpath(root), root / MANIFEST)
    files = _read_manifest(root, extra[1], marker.split()[0])
    found = _walk(root, strict=True)
    for name in sorted(set(found) - set(files)):
        raise FormatError(root / name, "", "not in the manifest (an extra or renamed file)")
    for name in sorted(set(files) - set(found)):
        raise FormatError(root / name, "", "missing (the manifest lists it)")
    for name, entry in files.items():  # a meta is checked when read: its fields named first
        if not name.endswith(_META_SUFFIX) and found[name].st_size != entry.bytes:
            raise FormatError(
                root / name, "", f"{found[name].st_size} bytes, the manifest says {entry.bytes}"
            )
    return Manifest(root, files)
