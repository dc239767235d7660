"""The delta format: the file form of the spec's ``DeltaDumpResult`` (what ``incremental_dump``
returns and ``replay_increment`` applies), one folder per embedding collection, per table its
rows (keys, embeddings, optional optimizer state, scores with timestamp columns as ages, the
slot of each key), its erased and evicted keys, and a meta JSON. See ``docs/format.md``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from demb_io._crc import check_crcs
from demb_io._errors import FormatError
from demb_io._files import (
    KEY,
    PartWriter,
    check_arrays,
    read_rows,
    row_layout,
    row_shapes,
)
from demb_io._small import META_BYTES, read_small, regular_size
from demb_io._staging import staging_path, write_synced
from demb_io.dtypes import DTYPES
from demb_io.manifest import Manifest, commit_with_manifest, open_tree
from demb_io.meta import (
    _MAX_SCORE,
    DIST_TYPES,
    FORMAT_VERSION,
    FileEntry,
    _check_keys,
    _count,
    _field,
    _score_strategy,
    check_parts,
    file_entry,
    settings,
)

__all__ = [
    "DELTA_FORMAT",
    "DeltaMeta",
    "DeltaTable",
    "DeltaWriter",
    "iter_delta",
    "read_delta",
    "write_delta",
]

DELTA_FORMAT = "demb-delta"
_MARKER = f"{DELTA_FORMAT} {FORMAT_VERSION}"
_PARTS = ("keys", "values", "state", "scores", "slots", "erased", "erased_slots", "evicted")


@dataclass(frozen=True)
class DeltaMeta:
    """A table's delta: its layout (what ``replay_increment`` checks) and its row counts.

    ``score_strategy`` names the score columns in order; ``TIMESTAMP`` columns hold ages
    (``current_score - score``), the others their values verbatim.
    """

    collection: str
    table: str
    embedding_dtype: str
    embedding_dim: int
    score_strategy: tuple[str, ...]
    current_score: int
    current_capacity: int
    row_capacity: tuple[int, ...]
    bucket_capacity: int
    world_size: int
    dist_type: str
    optim_state_dtype: str | None = None
    state_width: int = 0
    rows: int = 0
    erased_rows: int = 0
    evicted_rows: int | None = None
    """None: the table retains no evicted keys (the spec's ``evicted_keys`` entry is None)."""
    erased_slots: bool = False
    """Whether the slot each erased key was freed from travels with it (file ``erased_slots``,
    ``erased_rows`` int64): a replica clears those slots, which may hold a key the erased one
    had evicted."""
    table_options: dict[str, Any] = field(default_factory=dict)
    files: dict[str, FileEntry] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def num_scores(self) -> int:
        return len(self.score_strategy)

    def layout(self) -> dict[str, object]:
        """The fields two deltas of one table must share to be merged (and a target to be
        replayed on)."""
        return {
            name: getattr(self, name)
            for name in (
                "embedding_dtype",
                "embedding_dim",
                "score_strategy",
                "current_capacity",
                "row_capacity",
                "bucket_capacity",
                "world_size",
                "dist_type",
                "optim_state_dtype",
                "state_width",
            )
        }


@dataclass
class DeltaTable:
    """One table's delta rows (row ``i`` of each array is key ``keys[i]``).

    Attributes:
        meta: its :class:`DeltaMeta` (``rows`` etc. follow the arrays when written).
        keys: ``(n,)`` int64. values: ``(n, dim)`` in the storage dtype of ``embedding_dtype``.
        scores: ``(n, num_scores)`` int64 (timestamp columns as ages).
        slots: ``(n,)`` int64 slot each key held in the source table (``slot_index``).
        state: ``(n, state_width)`` or None. erased: ``(e,)`` int64 keys explicitly erased.
        evicted: ``(v,)`` int64 retained evicted keys, or None.
        erased_slots: ``(e,)`` int64 the slot each erased key was freed from, or None.
    """

    meta: DeltaMeta
    keys: npt.NDArray[np.int64]
    values: npt.NDArray[np.generic]
    scores: npt.NDArray[np.int64]
    slots: npt.NDArray[np.int64]
    state: npt.NDArray[np.generic] | None = None
    erased: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, np.int64))
    evicted: npt.NDArray[np.int64] | None = None
    erased_slots: npt.NDArray[np.int64] | None = None

    def check(self) -> None:
        """Raise ValueError when an array disagrees with the meta."""
        m, n = self.meta, int(self.keys.shape[0])
        if not m.state_width and self.state is not None:
            raise ValueError(f"{m.table}: state given, but state_width is 0")
        check_arrays(m.table, self, {**row_shapes(m, n), "slots": ((n,), KEY)})
        for name in ("erased", "evicted"):
            a = getattr(self, name)
            if a is not None and (a.ndim != 1 or a.dtype != np.int64):
                raise ValueError(f"{m.table}: {name} must be 1-D int64")
        if (self.evicted is None) != (m.evicted_rows is None):
            raise ValueError(f"{m.table}: evicted keys given iff the meta's evicted_rows is set")
        if (self.erased_slots is None) == m.erased_slots:
            raise ValueError(f"{m.table}: erased_slots given iff the meta's erased_slots is set")
        if self.erased_slots is not None and (
            self.erased_slots.dtype != np.int64 or self.erased_slots.shape != self.erased.shape
        ):
            raise ValueError(f"{m.table}: erased_slots must be int64 like erased")
        arrays: dict[str, npt.NDArray[np.generic]] = {
            "keys": self.keys,
            "slots": self.slots,
            "scores": self.scores,
            "erased": self.erased,
        }
        if self.evicted is not None:
            arrays["evicted"] = self.evicted
        if self.erased_slots is not None:
            arrays["erased_slots"] = self.erased_slots
        try:
            _check_values(Path(m.collection), m, arrays, written=True)
        except FormatError as err:
            raise ValueError(f"{m.collection}/{m.table}: {err.field}: {err}") from None


_DELTA_KEYS = frozenset({f.name for f in dataclasses.fields(DeltaMeta)} | {"format", "num_scores"})
"""The keys a delta meta holds: :func:`_meta_json`'s."""


def _meta_json(meta: DeltaMeta) -> str:
    d = dataclasses.asdict(meta)
    d["format"] = DELTA_FORMAT
    d["score_strategy"] = list(meta.score_strategy)
    d["row_capacity"] = list(meta.row_capacity)
    d["num_scores"] = meta.num_scores
    return json.dumps(d, indent=1, sort_keys=True)


class DeltaWriter:
    """Writes a delta directory table by table (only the table being written in memory), then
    commits it atomically like a checkpoint (a temporary directory, fsync, then a rename or
    exchange) when the ``with`` block ends cleanly; on an error nothing is committed.

    Example::

        with DeltaWriter(path) as w:
            for table in tables:
                w.write(table)
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._staged = staging_path(self.path)
        self._staged.mkdir(parents=True)
        self._seen: set[tuple[str, str]] = set()
        self.written: list[DeltaMeta] = []
        """The metas as written (row counts and files filled in)."""

    def write(self, t: DeltaTable) -> DeltaMeta:
        """Write one table.

        Raises:
            ValueError: its arrays disagree with its meta, or it was written before.
        """
        t.check()
        m = t.meta
        if (m.collection, m.table) in self._seen:
            raise ValueError(f"{m.collection}/{m.table}: given twice")
        self._seen.add((m.collection, m.table))
        folder = self._staged / m.collection
        folder.mkdir(exist_ok=True)
        files = {}
        for part in _PARTS:
            array = getattr(t, part)
            if array is None:
                continue
            writer = PartWriter(folder / f"{m.table}.{part}")
            try:
                writer.write(array)
            except BaseException:  # no descriptor left open in the staging being dropped
                writer.abort()
                raise
            files[part] = writer.close()
        meta = dataclasses.replace(
            m,
            rows=int(t.keys.shape[0]),
            erased_rows=int(t.erased.shape[0]),
            evicted_rows=None if t.evicted is None else int(t.evicted.shape[0]),
            files=files,
        )
        write_synced(folder / f"{m.table}.meta.json", _meta_json(meta))
        self.written.append(meta)
        return meta

    def __enter__(self) -> DeltaWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            try:
                commit_with_manifest(
                    self._staged,
                    self.path,
                    _MARKER,
                    lambda meta: _read_delta_meta(meta).files.values(),
                )
                return
            except BaseException:
                shutil.rmtree(self._staged, ignore_errors=True)
                raise
        shutil.rmtree(self._staged, ignore_errors=True)


def write_delta(path: str | Path, tables: Iterable[DeltaTable]) -> list[DeltaMeta]:
    """Write a delta directory (all its collections and tables), committed atomically
    (:class:`DeltaWriter`).

    Returns:
        The metas as written (row counts and files filled in).

    Raises:
        ValueError: a table whose arrays disagree with its meta, or a table given twice.
    """
    with DeltaWriter(path) as w:
        for t in tables:
            w.write(t)
    return w.written


def _read_delta_meta(path: Path, data: bytes | None = None) -> DeltaMeta:
    try:
        d = json.loads((read_small(path, META_BYTES) if data is None else data).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(path, "", f"not a readable meta JSON ({err})") from err
    if not isinstance(d, dict):
        raise FormatError(path, "", "a meta JSON must hold an object")
    if _field(d, path, "format_version", int) != FORMAT_VERSION:
        raise FormatError(path, "format_version", f"{d['format_version']} is not {FORMAT_VERSION}")
    _check_keys(d, path, _DELTA_KEYS)
    if _field(d, path, "format", str) != DELTA_FORMAT:
        raise FormatError(path, "format", f"{d['format']!r} is not {DELTA_FORMAT!r}")
    dtype = _field(d, path, "embedding_dtype", str)
    if dtype not in DTYPES:
        raise FormatError(path, "embedding_dtype", f"{dtype!r} is not one of {DTYPES}")
    strategy = _score_strategy(d, path)
    row_capacity = _field(d, path, "row_capacity", list)
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in row_capacity):
        raise FormatError(path, "row_capacity", f"expected counts, got {row_capacity!r}")
    state_width = _count(d, path, "state_width")
    state_dtype = _field(d, path, "optim_state_dtype", (str, type(None)), None)
    if state_width and state_dtype not in DTYPES:
        raise FormatError(path, "optim_state_dtype", f"{state_dtype!r} is not one of {DTYPES}")
    dist_type = _field(d, path, "dist_type", str)
    if dist_type not in DIST_TYPES:
        raise FormatError(path, "dist_type", f"{dist_type!r} is not one of {DIST_TYPES}")
    evicted = d.get("evicted_rows")
    erased_slots = _field(d, path, "erased_slots", bool, False)
    files = {}
    for part, entry in _field(d, path, "files", dict).items():
        if part not in _PARTS or not isinstance(entry, dict):
            raise FormatError(path, f"files.{part}", "not a part of a delta table")
        files[part] = file_entry(entry, path, part)
    check_parts(
        path,
        files,
        {
            "state": ("state_width", bool(state_width)),
            "evicted": ("evicted_rows", evicted is not None),
            "erased_slots": ("erased_slots", erased_slots),
        },
    )
    current = _count(d, path, "current_score", limit=_MAX_SCORE)
    current_capacity = _count(d, path, "current_capacity", 1)
    bucket_capacity = _count(d, path, "bucket_capacity", 1)
    if current_capacity % bucket_capacity:
        raise FormatError(
            path,
            "current_capacity",
            f"{current_capacity} is not a whole number of buckets of {bucket_capacity}",
        )
    if not row_capacity or row_capacity[0] > current_capacity:
        raise FormatError(
            path,
            "row_capacity",
            f"{row_capacity}: one count per tier, the first at most the {current_capacity} "
            "slots of the key map",
        )
    return DeltaMeta(
        collection=_field(d, path, "collection", str),
        table=_field(d, path, "table", str),
        embedding_dtype=dtype,
        embedding_dim=_count(d, path, "embedding_dim", 1),
        score_strategy=tuple(strategy),
        current_score=current,
        current_capacity=current_capacity,
        row_capacity=tuple(row_capacity),
        bucket_capacity=bucket_capacity,
        world_size=_count(d, path, "world_size", 1),
        dist_type=dist_type,
        optim_state_dtype=state_dtype if state_width else None,
        state_width=state_width,
        rows=_count(d, path, "rows"),
        erased_rows=_count(d, path, "erased_rows"),
        evicted_rows=None if evicted is None else _count(d, path, "evicted_rows"),
        erased_slots=erased_slots,
        table_options=settings(d, path, "table_options", numbers_only=False),
        files=files,
    )


def _read_table(folder: Path, meta_path: Path, verify: bool, manifest: Manifest) -> DeltaTable:
    m = manifest.read_meta(meta_path, _read_delta_meta)
    manifest.check_files(meta_path, m.files)
    if meta_path.name != f"{m.table}.meta.json":  # a meta moved or swapped with another's
        raise FormatError(meta_path, "table", f"{m.table!r} is not the table its file names")
    if m.collection != folder.name:
        raise FormatError(meta_path, "collection", f"differs from its folder {folder.name!r}")
    shapes = {part: (m.rows, w, dt) for part, (w, dt) in row_layout(m).items()}
    shapes["slots"] = (m.rows, 1, KEY)
    shapes["erased"] = (m.erased_rows, 1, KEY)
    if m.evicted_rows is not None:
        shapes["evicted"] = (m.evicted_rows, 1, KEY)
    if m.erased_slots:
        shapes["erased_slots"] = (m.erased_rows, 1, KEY)
    arrays: dict[str, npt.NDArray[np.generic]] = {}
    for part, (rows, width, dtype) in shapes.items():
        entry = m.files.get(part)
        if entry is None:
            raise FormatError(meta_path, f"files.{part}", "missing")
        file = folder / entry.name
        size = rows * width * dtype.itemsize
        actual = regular_size(file, part)
        if actual != size or entry.bytes != size:
            raise FormatError(
                file, part, f"{actual} bytes on disk, {entry.bytes} in the meta, {size} expected"
            )
        if verify:
            check_crcs(file, part, entry)
        arrays[part] = read_rows(file, 0, rows, width, dtype)
    _check_values(folder, m, arrays)
    return DeltaTable(
        meta=m,
        keys=arrays["keys"].reshape(-1).astype(np.int64, copy=False),
        values=arrays["values"],
        scores=arrays["scores"].astype(np.int64, copy=False),
        slots=arrays["slots"].reshape(-1).astype(np.int64, copy=False),
        state=arrays.get("state"),
        erased=arrays["erased"].reshape(-1).astype(np.int64, copy=False),
        evicted=arrays["evicted"].reshape(-1).astype(np.int64, copy=False)
        if "evicted" in arrays
        else None,
        erased_slots=arrays["erased_slots"].reshape(-1).astype(np.int64, copy=False)
        if "erased_slots" in arrays
        else None,
    )


_EMPTY_KEY = -1
"""The key no table holds (its empty slots' key)."""


def _check_values(
    folder: Path,
    m: DeltaMeta,
    arrays: dict[str, npt.NDArray[np.generic]],
    *,
    written: bool = False,
) -> None:
    """Values a table cannot hold: the empty key, a slot outside ``current_capacity``, a
    TIMESTAMP age outside ``[0, current_score]`` (its score would precede the clock's start).
    ``written``: the arrays of a table being written (no files yet).

    Raises:
        FormatError: naming the file and the part.
    """

    def file(part: str) -> Path:
        return folder / (f"{m.table}.{part}" if written else m.files[part].name)

    for part in ("keys", "erased", "evicted"):
        if part in arrays and bool((arrays[part] == _EMPTY_KEY).any()):
            raise FormatError(file(part), part, "holds -1, the empty key")
    for part in ("slots", "erased_slots"):
        slots = arrays.get(part)
        if slots is None or not slots.size:
            continue
        lowest = -1 if len(m.row_capacity) > 1 else 0  # -1: a row below a cache (no slot)
        if not (int(slots.min()) >= lowest and int(slots.max()) < m.current_capacity):
            raise FormatError(
                file(part),
                part,
                f"a slot outside [{lowest}, current_capacity {m.current_capacity})",
            )
    scores = arrays["scores"]
    for column, name in enumerate(m.score_strategy):
        ages = scores[:, column]
        if (
            name == "TIMESTAMP"
            and ages.size
            and not (int(ages.min()) >= 0 and int(ages.max()) <= m.current_score)
        ):
            raise FormatError(
                file("scores"),
                "scores",
                f"a TIMESTAMP age outside [0, current_score {m.current_score}]",
            )


def iter_delta(path: str | Path, *, verify: bool = True) -> Iterator[DeltaTable]:
    """The tables of a delta directory one at a time (memory: one table), validated (sizes,
    CRC-32s when ``verify``), in collection then table order.

    Raises:
        FormatError: not a committed delta, or a bad meta or file (named with its field).
    """
    path = Path(path)
    manifest = open_tree(path, _MARKER, "delta")
    for folder in sorted(p for p in path.iterdir() if p.is_dir()):
        for meta_path in sorted(folder.glob("*.meta.json")):
            yield _read_table(folder, meta_path, verify, manifest)


def read_delta(path: str | Path, *, verify: bool = True) -> list[DeltaTable]:
    """Every table of a delta directory (see :func:`iter_delta`)."""
    return list(iter_delta(path, verify=verify))
