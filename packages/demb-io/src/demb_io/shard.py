"""One table's shard (one rank's rows) on disk: streamed writes in bounded memory, validated
reads (sizes against the meta, CRC-32s, dtype and width), whole or in chunks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import numpy.typing as npt

from demb_io._crc import BlockChecks
from demb_io._errors import FormatError
from demb_io._files import (
    KEY,
    PartWriter,
    RowFile,
    check_arrays,
    read_rows,
    row_layout,
    row_shapes,
)
from demb_io._small import regular_size
from demb_io._staging import write_synced
from demb_io.dtypes import from_float32, storage_dtype, to_float32
from demb_io.meta import FileEntry, ShardMeta, read_meta, slot_layout_problem

__all__ = [
    "ShardData",
    "ShardWriter",
    "check_meta_sizes",
    "iter_shard",
    "read_shard",
    "write_shard",
]


@dataclass
class ShardData:
    """Rows of a shard (or a chunk of them); row ``i`` of each array is key ``keys[i]``.

    Attributes:
        keys: ``(n,)`` int64.
        values: ``(n, embedding_dim)`` in the storage dtype of ``embedding_dtype``
            (:func:`demb_io.dtypes.storage_dtype`: bfloat16 as uint16 words).
        scores: ``(n, num_scores)`` int64, in ``score_strategy`` order.
        state: ``(n, state_width)`` optimizer state in ``optim_state_dtype``'s storage, or None.
        admit_keys / admit_counts: ``(m,)`` int64 admission counters, or None (a chunk may
            carry some of them; they are not aligned with the rows).
        slots: ``(n,)`` int64, row ``i``'s slot in its source table, in ``[0, capacity)`` of
            the meta's ``slot_layout``; None when the shard has no slots (given exactly when
            the meta has a ``slot_layout``). A slot is local to its shard's table.
    """

    keys: npt.NDArray[np.int64]
    values: npt.NDArray[np.generic]
    scores: npt.NDArray[np.int64]
    state: npt.NDArray[np.generic] | None = None
    admit_keys: npt.NDArray[np.int64] | None = None
    admit_counts: npt.NDArray[np.int64] | None = None
    slots: npt.NDArray[np.int64] | None = None

    @property
    def rows(self) -> int:
        return int(self.keys.shape[0])


def _layout(meta: ShardMeta) -> dict[str, tuple[int, np.dtype[np.generic]]]:
    """Per row-aligned part of the shard (:func:`~demb_io._files.row_layout`'s, and ``slots``
    when the meta has a ``slot_layout``): values per row and storage dtype."""
    layout = row_layout(meta)
    if meta.slot_layout is not None:
        layout["slots"] = (1, KEY)
    return layout


def _slots_outside(slots: npt.NDArray[np.generic], capacity: int, first_row: int = 0) -> str | None:
    """The first slot of ``slots`` (int64, any shape; row ``first_row`` first) outside
    ``[0, capacity)``, described, or None."""
    flat = slots.reshape(-1).astype(np.int64, copy=False)
    bad = np.flatnonzero((flat < 0) | (flat >= capacity))
    if not bad.size:
        return None
    return f"row {first_row + int(bad[0])}'s slot {int(flat[bad[0]])} is outside [0, {capacity})"


def _writer_meta(meta: ShardMeta) -> ShardMeta:
    """``meta`` with its ``slot_layout`` as two Python ints (numpy or torch ints accepted).

    Raises:
        ValueError: a ``slot_layout`` that is not ``(capacity, bucket_capacity)``, both >= 1,
            ``capacity`` a multiple of ``bucket_capacity``.
    """
    layout: object = meta.slot_layout
    if layout is None:
        return meta
    if isinstance(layout, tuple | list) and len(layout) == 2:
        with contextlib.suppress(TypeError):
            if not any(isinstance(v, bool | np.bool_) for v in layout):
                layout = (operator.index(layout[0]), operator.index(layout[1]))
    problem = slot_layout_problem(layout)
    if problem is not None:
        raise ValueError(f"{meta.stem}: slot_layout: {problem}")
    return dataclasses.replace(meta, slot_layout=cast("tuple[int, int]", layout))


def _check_chunk(meta: ShardMeta, chunk: ShardData) -> None:
    if not meta.state_width and chunk.state is not None:
        raise ValueError(f"{meta.stem}: state given, but the meta's state_width is 0")
    if (chunk.slots is None) != (meta.slot_layout is None):
        given = "given" if chunk.slots is not None else "missing"
        raise ValueError(
            f"{meta.stem}: slots {given}, but the meta's slot_layout is {meta.slot_layout}"
        )
    shapes = row_shapes(meta, chunk.rows)
    if meta.slot_layout is not None:
        shapes["slots"] = ((chunk.rows,), KEY)
    check_arrays(meta.stem, chunk, shapes)
    if meta.slot_layout is not None and chunk.slots is not None:
        outside = _slots_outside(chunk.slots, meta.slot_layout[0])
        if outside is not None:
            raise ValueError(f"{meta.stem}: slots: {outside} (slot_layout {meta.slot_layout})")
    admission = (chunk.admit_keys, chunk.admit_counts)
    if (admission[0] is None) != (admission[1] is None) or (
        admission[0] is not None and meta.admission_rows is None
    ):
        raise ValueError(f"{meta.stem}: admit_keys and admit_counts go together, with admission")
    if (
        admission[0] is not None
        and admission[1] is not None
        and (admission[0].shape != admission[1].shape or admission[0].ndim != 1)
    ):
        raise ValueError(f"{meta.stem}: admit_keys and admit_counts must be (m,) alike")


class ShardWriter:
    """Writes one shard's files chunk by chunk (memory: one chunk); :meth:`close` fsyncs them
    and writes the meta JSON last (a shard without its meta is not a shard).

    Args:
        directory: the collection's folder (exists).
        meta: the shard's description; ``rows``, ``admission_rows`` (if not None) and ``files``
            are filled in from what was written. With a ``slot_layout``, every chunk carries
            ``slots`` (written as the ``slots`` part); without, none does.

    Raises:
        ValueError: a ``slot_layout`` that is not ``(capacity, bucket_capacity)`` (both >= 1,
            ``capacity`` a multiple of ``bucket_capacity``).
    """

    def __init__(self, directory: str | Path, meta: ShardMeta) -> None:
        self.directory = Path(directory)
        self.meta = meta = _writer_meta(meta)
        parts = ["keys", "values", "scores"] + (["state"] if meta.state_width else [])
        if meta.admission_rows is not None:
            parts += ["admit_keys", "admit_counts"]
        if meta.slot_layout is not None:
            parts.append("slots")
        self._writers = {p: PartWriter(self.directory / f"{meta.stem}.{p}") for p in parts}
        self.rows = self.admitted = 0
        self.closed = False
        """Closed (committed or aborted)."""

    def append(self, chunk: ShardData) -> None:
        """Append rows (and admission counters).

        Raises:
            ValueError: arrays that do not match the meta (the shard stays unfinished: no
                meta is written for it): a wrong shape or dtype, ``slots`` given without the
                meta's ``slot_layout`` or missing with it, a slot outside ``[0, capacity)``.
        """
        _check_chunk(self.meta, chunk)
        for p, w in self._writers.items():
            array = getattr(chunk, p)
            if array is not None:
                w.write(array)
        self.rows += chunk.rows
        self.admitted += 0 if chunk.admit_keys is None else int(chunk.admit_keys.shape[0])

    def write_all(self, chunks: Iterable[ShardData]) -> ShardMeta:
        """Append every chunk, then close and commit; on an error, close without a meta and
        re-raise."""
        try:
            for chunk in chunks:
                self.append(chunk)
        except BaseException:
            self.close(commit=False)
            raise
        return self.close()

    def abort(self) -> None:
        """Close the files unfinished, unless closed already (a failed write's staging is
        being dropped: no descriptor is left open)."""
        if not self.closed:
            self.closed = True
            for w in self._writers.values():
                w.abort()

    def close(self, *, commit: bool = True) -> ShardMeta:
        """Close the files; with ``commit``, fsync them and write the meta. Returns the meta
        as written (or as far as it got)."""
        if self.closed:
            raise ValueError(f"{self.meta.stem}: closed twice")
        self.closed = True
        files = {p: w.close() for p, w in self._writers.items()}
        written = dataclasses.replace(
            self.meta,
            rows=self.rows,
            admission_rows=None if self.meta.admission_rows is None else self.admitted,
            files=files,
            legacy=False,
        )
        if commit:
            write_synced(self.directory / f"{self.meta.stem}.meta.json", written.to_json())
        return written


def write_shard(directory: str | Path, meta: ShardMeta, chunks: Iterable[ShardData]) -> ShardMeta:
    """Write a shard from ``chunks`` (see :class:`ShardWriter`: ``slots`` in every chunk
    exactly when ``meta.slot_layout`` is set); returns the meta as written.

    Raises:
        ValueError: a chunk whose arrays do not match ``meta`` (no meta is written then; the
            caller's temporary directory drops the files), or a bad ``slot_layout``.
    """
    return ShardWriter(directory, meta).write_all(chunks)


def _part_path(directory: Path, meta: ShardMeta, part: str) -> Path:
    return directory / meta.files[part].name


def _resolve(directory: Path, meta: ShardMeta) -> ShardMeta:
    """A legacy meta completed from its files: rows from the keys file, the embedding width
    from the values file (float32), scores and state absent unless their files exist."""
    if not meta.legacy:
        return meta
    keys_path = _part_path(directory, meta, "keys")
    key_bytes = regular_size(keys_path, "keys")
    if key_bytes % 8:
        raise FormatError(keys_path, "keys", f"{key_bytes} bytes is not a whole number of int64")
    rows = key_bytes // 8 if meta.rows < 0 else meta.rows
    values_path = _part_path(directory, meta, "values")
    value_bytes = regular_size(values_path, "values")
    if rows == 0 or value_bytes % (4 * rows):
        raise FormatError(
            values_path, "embedding_dim", f"{value_bytes} bytes do not hold {rows} float32 rows"
        )
    return dataclasses.replace(meta, rows=rows, embedding_dim=value_bytes // (4 * rows))


def _expected_sizes(meta: ShardMeta) -> dict[str, int]:
    """Each part's bytes, as the meta's rows and widths imply."""
    expected = {p: meta.rows * w * int(dt.itemsize) for p, (w, dt) in _layout(meta).items()}
    if meta.admission_rows is not None:
        expected["admit_keys"] = expected["admit_counts"] = meta.admission_rows * 8
    return expected


def check_meta_sizes(meta_path: Path, meta: ShardMeta) -> None:
    """The sizes a (versioned) meta lists for its files are the ones its rows and widths imply
    (arithmetic only: the files are not looked at).

    Raises:
        FormatError: naming the meta and the part.
    """
    if meta.legacy:
        return
    for part, size in _expected_sizes(meta).items():
        entry = meta.files.get(part)
        if entry is not None and entry.bytes != size:
            raise FormatError(
                meta_path, f"files.{part}", f"{entry.bytes} bytes listed, {size} implied by rows"
            )


def _check_sizes(directory: Path, meta: ShardMeta) -> list[tuple[str, Path, FileEntry]]:
    """Every file exists with the size the meta implies; returns them (part, path, entry)."""
    expected = _expected_sizes(meta)
    files = []
    for part, size in expected.items():
        if part not in meta.files:
            if part == "scores" and meta.legacy:
                continue
            raise FormatError(directory / f"{meta.stem}.meta.json", f"files.{part}", "missing")
        entry = meta.files[part]
        path = directory / entry.name
        actual = regular_size(path, part)
        if actual != size or (entry.bytes is not None and entry.bytes != size):
            raise FormatError(
                path, part, f"{actual} bytes on disk, {entry.bytes} in the meta, {size} expected"
            )
        files.append((part, path, entry))
    return files


def iter_shard(
    directory: str | Path,
    meta: ShardMeta | str | Path,
    chunk_rows: int = 1 << 20,
    *,
    verify: bool = True,
    reuse: bool = False,
    expect_dtype: str | None = None,
    expect_dim: int | None = None,
) -> Iterator[ShardData]:
    """The shard's rows in chunks of at most ``chunk_rows`` (memory: one chunk). Sizes are
    checked against the meta before the first chunk; with ``verify``, the CRC-32 of every
    block a chunk covers is checked before the chunk is yielded (the checks run on worker
    threads beside the reads), so no unchecked byte is ever handed out. A shard with a
    ``slots`` part gives each chunk's ``slots`` (each checked in ``[0, capacity)``), else None.

    Args:
        directory: the collection's folder.
        meta: the shard's meta, or the path of its meta JSON.
        chunk_rows: rows per chunk (>= 1).
        verify: check the files' CRC-32s (see above).
        reuse: read every chunk into the same buffers (a chunk's arrays are then valid until
            the next chunk is asked for): no fresh memory per chunk, which a large read would
            otherwise spend its time faulting in.
        expect_dtype: the precision the reader holds rows at: values (and state) stored at
            another one are converted to it (through float32, rounding to nearest even), with
            a warning naming the shard.
        expect_dim: the embedding width the reader expects; another one is an error.

    Raises:
        FormatError: a missing, truncated or corrupted file, naming it and the part; a stored
            ``embedding_dim`` other than ``expect_dim``; a slot outside ``[0, capacity)``.
    """
    directory = Path(directory)
    if not isinstance(meta, ShardMeta):
        meta = read_meta(meta)
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows}: must be >= 1")
    meta = _resolve(directory, meta)
    files = _check_sizes(directory, meta)
    convert = _expectations(directory, meta, expect_dtype, expect_dim)
    with BlockChecks(files if verify else []) as checks:
        yield from _chunks(directory, meta, chunk_rows, reuse, convert, checks)


def _chunks(
    directory: Path,
    meta: ShardMeta,
    chunk_rows: int,
    reuse: bool,
    convert: str | None,
    checks: BlockChecks,
) -> Iterator[ShardData]:
    """iter_shard's chunks: each read, then held until the CRC-32 checks of the blocks it
    covers (running beside the reads) pass."""
    widths = _layout(meta)
    admit_keys: npt.NDArray[np.generic] = np.zeros((0, 1), dtype=KEY)
    admit_counts: npt.NDArray[np.generic] = np.zeros((0, 1), dtype=KEY)
    if meta.admission_rows is not None:
        m = meta.admission_rows
        admit_keys = read_rows(_part_path(directory, meta, "admit_keys"), 0, m, 1, KEY)
        admit_counts = read_rows(_part_path(directory, meta, "admit_counts"), 0, m, 1, KEY)
        checks.wait("admit_keys")
        checks.wait("admit_counts")
    first = True
    size = min(chunk_rows, max(meta.rows, 0))
    buffers = {p: np.empty((size, w), dtype=dt) for p, (w, dt) in widths.items()} if reuse else {}
    with contextlib.ExitStack() as stack:  # each part's file open for the whole read
        files = {
            part: stack.enter_context(RowFile(_part_path(directory, meta, part), w, dt))
            for part, (w, dt) in widths.items()
            if part in meta.files
        }
        for begin in range(0, max(meta.rows, 1), chunk_rows):
            count = min(chunk_rows, meta.rows - begin)
            ahead = min(chunk_rows, meta.rows - begin - count)  # the next chunk, read ahead
            arrays = {
                part: files[part].read(begin, count, buffers.get(part), ahead)
                if part in files
                else np.zeros((count, w), dtype=dt)
                for part, (w, dt) in widths.items()
            }
            for part, (w, dt) in widths.items():
                checks.wait(part, (begin + count) * w * dt.itemsize)
            slots = arrays.get("slots")
            if slots is not None and meta.slot_layout is not None:
                outside = _slots_outside(slots, meta.slot_layout[0], begin)
                if outside is not None:
                    path = _part_path(directory, meta, "slots")
                    raise FormatError(path, "slots", f"{outside} (slot_layout {meta.slot_layout})")
            admission = first and meta.admission_rows is not None
            if convert is not None:
                arrays["values"] = _convert(arrays["values"], meta.embedding_dtype, convert)
                if "state" in arrays and meta.optim_state_dtype != convert:
                    assert meta.optim_state_dtype is not None
                    arrays["state"] = _convert(arrays["state"], meta.optim_state_dtype, convert)
            yield ShardData(
                keys=arrays["keys"].reshape(count).astype(np.int64, copy=False),
                values=arrays["values"],
                scores=arrays["scores"].astype(np.int64, copy=False),
                state=arrays.get("state"),
                admit_keys=admit_keys.reshape(-1).astype(np.int64, copy=False)
                if admission
                else None,
                admit_counts=admit_counts.reshape(-1).astype(np.int64, copy=False)
                if admission
                else None,
                slots=None if slots is None else slots.reshape(count).astype(np.int64, copy=False),
            )
            first = False


def read_shard(
    directory: str | Path,
    meta: ShardMeta | str | Path,
    *,
    verify: bool = True,
    expect_dtype: str | None = None,
    expect_dim: int | None = None,
) -> ShardData:
    """The whole shard (see :func:`iter_shard`)."""
    chunks = iter_shard(
        directory,
        meta,
        chunk_rows=1 << 62,
        verify=verify,
        expect_dtype=expect_dtype,
        expect_dim=expect_dim,
    )
    return next(iter(chunks))


def _expectations(
    directory: Path, meta: ShardMeta, dtype: str | None, dim: int | None
) -> str | None:
    """Check ``dim``; return the dtype to convert rows to (None: as stored), warning once."""
    meta_path = directory / f"{meta.stem}.meta.json"
    if dim is not None and meta.embedding_dim != dim:
        raise FormatError(
            meta_path, "embedding_dim", f"{meta.embedding_dim} stored, {dim} expected"
        )
    if dtype is None:
        return None
    storage_dtype(dtype)  # a known name, or ValueError
    stored = {meta.embedding_dtype}
    if meta.state_width and meta.optim_state_dtype is not None:
        stored.add(meta.optim_state_dtype)
    if stored == {dtype}:
        return None
    warnings.warn(
        f"{meta_path}: rows stored as {' / '.join(sorted(stored))}, converted to {dtype}",
        stacklevel=3,
    )
    return dtype


def _convert(array: npt.NDArray[np.generic], stored: str, wanted: str) -> npt.NDArray[np.generic]:
    return array if stored == wanted else from_float32(to_float32(array, stored), wanted)
