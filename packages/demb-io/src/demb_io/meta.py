"""The meta JSON of one table's shard (one rank's rows) in a checkpoint: what its files hold.

See ``docs/format.md``. Reading validates every field's type and range and raises
:class:`~demb_io.FormatError` naming the file and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from demb_io._errors import FormatError
from demb_io._small import META_BYTES, read_small
from demb_io.dtypes import DTYPES

__all__ = [
    "CHECKPOINT_FORMAT",
    "CRC_BLOCK",
    "FORMAT_VERSION",
    "PARTS",
    "SCORE_NAMES",
    "FileEntry",
    "ShardMeta",
    "read_meta",
    "shard_stem",
    "slot_layout_problem",
]

CHECKPOINT_FORMAT = "demb-checkpoint"
FORMAT_VERSION = 1
"""The version this code writes; it reads this one and the legacy (unversioned) meta."""

PARTS = ("keys", "values", "state", "scores", "admit_keys", "admit_counts", "slots")
"""The files of a shard, by part name (``state``, ``slots`` and the admission parts are
optional)."""

DIST_TYPES = ("continuous", "roundrobin", "hash_roundrobin")
SCORE_NAMES = ("TIMESTAMP", "STEP", "CUSTOMIZED", "LFU", "NO_EVICTION")
"""The score columns a meta may name; two columns are TIMESTAMP and LFU (either order)."""


def shard_stem(table: str, rank: int, world_size: int) -> str:
    """The file name stem of a table's shard: ``<table>.rank<r>-of-<W>``."""
    return f"{table}.rank{rank}-of-{world_size}"


CRC_BLOCK = 1 << 26
"""Bytes per checksummed block: a file's ``crc32`` lists the CRC-32 of each 64 MiB block (the
last one shorter), so a reader checks the blocks in parallel."""


@dataclass(frozen=True)
class FileEntry:
    """One file of a shard: its name (in the collection's folder), size and the CRC-32 of each
    :data:`CRC_BLOCK` bytes (both None in a legacy meta, which records neither)."""

    name: str
    bytes: int | None
    crc32: tuple[int, ...] | None


@dataclass(frozen=True)
class ShardMeta:
    """What one rank's part of a table holds.

    Row ``i`` of every part describes key ``i``: ``values`` ``(rows, embedding_dim)`` in
    ``embedding_dtype``; ``state`` ``(rows, state_width)`` in ``optim_state_dtype`` (absent when
    ``state_width`` is 0); ``scores`` ``(rows, num_scores)`` int64 in ``score_strategy`` order;
    ``admit_keys`` / ``admit_counts`` ``(admission_rows,)`` int64 when ``admission_rows`` is not
    None; ``slots`` ``(rows,)`` int64 when ``slot_layout`` is not None.
    """

    collection: str
    table: str
    rank: int
    world_size: int
    dist_type: str
    embedding_dtype: str
    embedding_dim: int
    rows: int
    """Keys in the shard (-1: not recorded, in a legacy meta)."""
    score_strategy: tuple[str, ...] = ("TIMESTAMP",)
    optimizer: str | None = None
    optim_state_dtype: str | None = None
    state_width: int = 0
    hyper_parameters: dict[str, float | bool] = field(default_factory=dict)
    admission_rows: int | None = None
    num_embeddings: int | None = None
    """The table's logical size, when known: ``continuous`` sharding's block size comes from it."""
    files: dict[str, FileEntry] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    legacy: bool = False
    """Read from a meta without the dtype keys (values read as float32, width from the size)."""
    admit_calls: int | None = None
    """The probabilistic admitter's call count on the rank that wrote the shard (the toss
    index of its next call), or None: the table has no probabilistic admission (or the dump
    left admission state out). Written only when set."""
    slot_layout: tuple[int, int] | None = None
    """``(capacity, bucket_capacity)`` of the table the shard was written from, exactly when the
    shard has a ``slots`` part: row ``i``'s slot in that table, in ``[0, capacity)`` (buckets of
    ``bucket_capacity`` slots; ``capacity`` a multiple of it). None: no slots (a meta written
    without the key reads as None). A slot means something only to a table of this layout, and
    only within this shard."""

    @property
    def num_scores(self) -> int:
        """Score words per key."""
        return len(self.score_strategy)

    @property
    def stem(self) -> str:
        return shard_stem(self.table, self.rank, self.world_size)

    def to_json(self) -> str:
        """The meta file's text."""
        d: dict[str, Any] = asdict(self)
        d.pop("legacy")
        d["format"] = CHECKPOINT_FORMAT
        d["score_strategy"] = list(self.score_strategy)
        d["num_scores"] = self.num_scores
        if self.slot_layout is None:  # absent: a shard without slots stays readable by older
            d.pop("slot_layout")  # readers, which refuse a key they do not know
        else:
            d["slot_layout"] = list(self.slot_layout)
        if self.admit_calls is None:  # likewise
            d.pop("admit_calls")
        return json.dumps(d, indent=1, sort_keys=True)


_MISSING = object()

_SHARD_KEYS = frozenset({f.name for f in fields(ShardMeta)} - {"legacy"} | {"format", "num_scores"})
"""The keys a (versioned) shard meta holds: :meth:`ShardMeta.to_json`'s."""


def _field(
    d: dict[str, Any],
    path: Path,
    name: str,
    kind: type | tuple[type, ...],
    default: object = _MISSING,
) -> Any:  # noqa: ANN401
    """``d[name]`` if it is a ``kind`` (bools are not ints), else ``default``, else an error."""
    if name not in d:
        if default is _MISSING:
            raise FormatError(path, name, "missing")
        return default
    value = d[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        wanted = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
        raise FormatError(path, name, f"expected {wanted}, got {value!r}")
    return value


_MAX_COUNT = 2**62
"""The largest count a meta may hold (sizes in bytes derived from it stay within int64)."""
_MAX_SCORE = 2**63 - 1
"""The largest score (scores are int64)."""


def _check_keys(d: dict[str, Any], path: Path, allowed: frozenset[str]) -> None:
    """Raises FormatError naming the first key of ``d`` that ``allowed`` lacks (a misspelt
    or bit-flipped field would otherwise read as absent)."""
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise FormatError(path, unknown[0], "not a field of this meta")


def _score_strategy(d: dict[str, Any], path: Path, default: object = _MISSING) -> tuple[str, ...]:
    """The meta's ``score_strategy``: 1 name of :data:`SCORE_NAMES`, or TIMESTAMP and LFU."""
    strategy = _field(d, path, "score_strategy", list, default)
    names = set(strategy) if all(isinstance(s, str) for s in strategy) else set()
    single = len(strategy) == 1 and names <= set(SCORE_NAMES)
    if not (single or (len(strategy) == 2 and names == {"TIMESTAMP", "LFU"})):
        raise FormatError(
            path,
            "score_strategy",
            f"expected one of {SCORE_NAMES} or TIMESTAMP and LFU, got {strategy!r}",
        )
    return tuple(strategy)


def _count(d: dict[str, Any], path: Path, name: str, low: int = 0, limit: int = _MAX_COUNT) -> int:
    value = int(_field(d, path, name, int))
    if not low <= value <= limit:
        raise FormatError(path, name, f"must be in [{low}, {limit}], got {value}")
    return value


_SCALARS = (bool, int, float, str, type(None))


def _finite(value: object) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def settings(d: dict[str, Any], path: Path, name: str, *, numbers_only: bool) -> dict[str, Any]:
    """``d[name]`` (default empty): a JSON object of settings by name, each a finite number or
    a bool (``numbers_only``: a meta's ``hyper_parameters``), else also a string, null, or a
    list of such scalars (a delta's ``table_options``).

    Raises:
        FormatError: naming ``<name>.<key>``.
    """
    values: dict[str, Any] = _field(d, path, name, dict, {})
    for key, value in values.items():
        scalars = (bool, int, float) if numbers_only else _SCALARS
        items = value if isinstance(value, list) and not numbers_only else [value]
        if not all(isinstance(v, scalars) and _finite(v) for v in items):
            kind = "a finite number or bool" if numbers_only else "a finite JSON scalar"
            raise FormatError(path, f"{name}.{key}", f"expected {kind}, got {value!r}")
        if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            raise FormatError(path, f"{name}.{key}", f"{value} is out of range")
    return values


def slot_layout_problem(value: object) -> str | None:
    """What is wrong with ``value`` as a :attr:`ShardMeta.slot_layout` (a pair of ints
    ``(capacity, bucket_capacity)``, both >= 1, ``capacity`` a multiple of ``bucket_capacity``
    and at most 2**62; a list counts as a pair, bools are not ints), or None when it is one."""
    wanted = f"expected [capacity, bucket_capacity] (two ints), got {value!r}"
    if not isinstance(value, tuple | list) or len(value) != 2:
        return wanted
    capacity, bucket = value
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (capacity, bucket)):
        return wanted
    if not 1 <= capacity <= _MAX_COUNT or not 1 <= bucket <= _MAX_COUNT:
        return f"capacity and bucket_capacity must be in [1, {_MAX_COUNT}], got {value!r}"
    if capacity % bucket:
        return f"capacity {capacity} is not a multiple of bucket_capacity {bucket}"
    return None


def _slot_layout(d: dict[str, Any], path: Path) -> tuple[int, int] | None:
    """The meta's ``slot_layout`` (absent or null: None)."""
    value = d.get("slot_layout")
    if value is None:
        return None
    problem = slot_layout_problem(value)
    if problem is not None:
        raise FormatError(path, "slot_layout", problem)
    return int(value[0]), int(value[1])


def check_parts(
    path: Path, files: dict[str, FileEntry], optional: dict[str, tuple[str, bool]]
) -> None:
    """Each optional part listed in ``files`` must be one the meta's fields ask for
    (``optional``: per part, the field that asks for it and whether it does).

    Raises:
        FormatError: naming the field (a ``state_width`` of 0 beside a state file, a null
            ``admission_rows`` beside admission counters: the file would be dropped unread).
    """
    for part, (field_name, wanted) in optional.items():
        if part in files and not wanted:
            raise FormatError(path, field_name, f"says there is no {part}, but files lists one")


def file_entry(entry: dict[str, Any], path: Path, part: str) -> FileEntry:
    """A ``files`` entry of a meta JSON, validated: a plain name, a size, one CRC-32 per block."""
    name = _field(entry, path, "name", str)
    if "/" in name or name in ("", ".", ".."):
        raise FormatError(path, f"files.{part}.name", f"not a plain file name: {name!r}")
    size = _count(entry, path, "bytes")
    crcs = _field(entry, path, "crc32", list)
    blocks = -(-size // CRC_BLOCK)
    valid = all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 2**32 for c in crcs)
    if not valid or len(crcs) != blocks:
        raise FormatError(
            path, f"files.{part}.crc32", f"expected {blocks} CRC-32s (one per block), got {crcs!r}"
        )
    return FileEntry(name, size, tuple(crcs))


def _legacy_files(path: Path, stem: str) -> dict[str, FileEntry]:
    """A legacy meta's files: the standard names that exist beside it, sizes and CRCs unknown."""
    files = {}
    for part in PARTS:
        if part == "slots":  # legacy metas predate slots: such a file is not theirs
            continue
        name = f"{stem}.{part}"
        if (path.parent / name).exists():
            files[part] = FileEntry(name, None, None)
    return files


def _files(d: dict[str, Any], path: Path, legacy_stem: str | None) -> dict[str, FileEntry]:
    if "files" not in d and legacy_stem is not None:
        files = _legacy_files(path, legacy_stem)
        for part in ("keys", "values"):
            if part not in files:
                raise FormatError(path.parent / f"{legacy_stem}.{part}", part, "missing")
        return files
    raw = _field(d, path, "files", dict)
    files = {}
    for part, entry in raw.items():
        if part not in PARTS:
            raise FormatError(path, f"files.{part}", f"not a part of a shard ({', '.join(PARTS)})")
        if not isinstance(entry, dict):
            raise FormatError(path, f"files.{part}", f"expected an object, got {entry!r}")
        files[part] = file_entry(entry, path, part)
    for part in ("keys", "values", "scores"):
        if part not in files and not (legacy_stem is not None and part == "scores"):
            raise FormatError(path, f"files.{part}", "missing")
    return files


def read_meta(path: str | Path, data: bytes | None = None) -> ShardMeta:
    """Read and validate a shard's meta JSON (``data``: its bytes, read already).

    A meta without ``embedding_dtype`` / ``embedding_dim`` (the legacy format) is returned with
    ``legacy=True``, float32 values and ``embedding_dim`` 0 (the reader recovers the width from
    the value file's size); without ``rows``, ``rows`` is -1 (the key file's size tells); without
    ``files``, the standard file names beside it, sizes and CRCs unknown.

    Raises:
        FormatError: unreadable JSON, a missing or mistyped field, an unknown dtype or dist type,
            or an unsupported format version; the message names the file and the field.
    """
    path = Path(path)
    try:
        d = json.loads((read_small(path, META_BYTES) if data is None else data).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FormatError(path, "", f"not a readable meta JSON ({err})") from err
    if not isinstance(d, dict):
        raise FormatError(path, "", "a meta JSON must hold an object")
    legacy = "embedding_dtype" not in d and "embedding_dim" not in d
    version = _field(d, path, "format_version", int, 0 if legacy else _MISSING)
    if not legacy and version != FORMAT_VERSION:
        raise FormatError(path, "format_version", f"{version} is not {FORMAT_VERSION}")
    if not legacy:
        _check_keys(d, path, _SHARD_KEYS)
        if _field(d, path, "format", str) != CHECKPOINT_FORMAT:
            raise FormatError(path, "format", f"{d['format']!r} is not {CHECKPOINT_FORMAT!r}")
    world_size = _count(d, path, "world_size", 1)
    rank = _count(d, path, "rank")
    if rank >= world_size:
        raise FormatError(path, "rank", f"{rank} is not below world_size {world_size}")
    dist_type = _field(d, path, "dist_type", str)
    if dist_type not in DIST_TYPES:
        raise FormatError(path, "dist_type", f"{dist_type!r} is not one of {DIST_TYPES}")
    dtype = "float32" if legacy else _field(d, path, "embedding_dtype", str)
    if dtype not in DTYPES:
        raise FormatError(path, "embedding_dtype", f"{dtype!r} is not one of {DTYPES}")
    dim = 0 if legacy else _count(d, path, "embedding_dim", 1)
    strategy = _score_strategy(d, path, ["TIMESTAMP"] if legacy else _MISSING)
    if "num_scores" in d and _count(d, path, "num_scores") != len(strategy):
        raise FormatError(path, "num_scores", f"disagrees with score_strategy {strategy}")
    state_width = _count(d, path, "state_width") if "state_width" in d else 0
    state_dtype = _field(d, path, "optim_state_dtype", (str, type(None)), None)
    if state_width and (state_dtype if not legacy else "float32") not in DTYPES:
        raise FormatError(path, "optim_state_dtype", f"{state_dtype!r} is not one of {DTYPES}")
    hyper = settings(d, path, "hyper_parameters", numbers_only=True)
    admission = d.get("admission_rows")
    if admission is not None:
        admission = _count(d, path, "admission_rows")
    calls = d.get("admit_calls")
    if calls is not None:
        calls = _count(d, path, "admit_calls")
    num_embeddings = d.get("num_embeddings")
    if num_embeddings is not None:
        num_embeddings = _count(d, path, "num_embeddings", 1)
    table = _field(d, path, "table", str)
    rows = _count(d, path, "rows") if "rows" in d or not legacy else -1
    files = _files(d, path, shard_stem(table, rank, world_size) if legacy else None)
    slot_layout = None if legacy else _slot_layout(d, path)
    check_parts(  # a legacy meta's files are what lies beside it
        path,
        {} if legacy else files,
        {
            "state": ("state_width", bool(state_width)),
            "admit_keys": ("admission_rows", admission is not None),
            "admit_counts": ("admission_rows", admission is not None),
            "slots": ("slot_layout", slot_layout is not None),
        },
    )
    if slot_layout is not None and "slots" not in files:
        raise FormatError(path, "files.slots", "missing, but slot_layout says the shard has slots")
    return ShardMeta(
        collection=_field(d, path, "collection", str),
        table=table,
        rank=rank,
        world_size=world_size,
        dist_type=dist_type,
        embedding_dtype=dtype,
        embedding_dim=dim,
        rows=rows,
        score_strategy=strategy,
        optimizer=_field(d, path, "optimizer", (str, type(None)), None),
        optim_state_dtype=(state_dtype or "float32") if state_width else None,
        state_width=state_width,
        hyper_parameters=hyper,
        admission_rows=admission,
        admit_calls=calls,
        num_embeddings=num_embeddings,
        files=files,
        format_version=version,
        legacy=legacy,
        slot_layout=slot_layout,
    )
