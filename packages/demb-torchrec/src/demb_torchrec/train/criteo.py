"""Real click logs for ``demb train``: the Criteo Kaggle / Terabyte TSV format and Parquet.

**Formats.** TSV: one sample per line, ``label \\t I1 .. I13 \\t C1 .. C26`` (40 tab-separated
fields, no header, no quoting). An integer field may be empty (missing) or negative; a
categorical field is a hex string of 1-16 digits (Criteo's are 8) or empty (missing). Parquet:
columns ``label``, ``I1``..``I13`` (integers or floats, nullable) and ``C1``..``C26`` (hex
strings or binary, nullable, or integer columns holding the values themselves). A name ending
in ``.parquet`` / ``.pq`` is Parquet, any other TSV. Empty lines are samples with every field
missing (so they fail for want of a label).

**Rule.** A sample becomes one row of a :class:`~demb_torchrec.train.batch.ClickBatch`:

* ``labels``: the label, which must be 0 or 1, as float32;
* ``dense[:, j]``: ``float32(log1p(max(I_{j+1}, 0)))``; missing (or NaN) reads as 0;
* ``sparse[:, f]``: the value ``v`` of ``C_{f+1}`` as an unsigned 64-bit integer (the hex string
  parsed; an integer column's 64-bit pattern), then :func:`categorical_ids`:
  ``splitmix64(v ^ splitmix64((f + 1) * 0x9E3779B97F4A7C15)) & (2**63 - 1)``. A missing (null or
  empty) value reads as the reserved value :data:`MISSING_VALUE` (``2**64 - 1``, beyond
  Criteo's 8-digit hashes), so it gets one fixed id per feature.

Readers stream: pyarrow parses TSV block by block (``pyarrow.csv.open_csv``) and Parquet batch by
batch (``ParquetFile.iter_batches``); hex strings are parsed vectorized. A malformed file raises
:class:`~demb_torchrec.errors.FormatError` naming the file and the line (TSV, 1-based) or row
(Parquet, 0-based), never skips.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from demb_torchrec.errors import ConfigError, FormatError
from demb_torchrec.train.batch import ID_MASK, NUM_DENSE, NUM_SPARSE, ClickBatch, splitmix64

__all__ = [
    "COLUMNS",
    "MISSING_VALUE",
    "ClickFile",
    "categorical_ids",
]

COLUMNS: tuple[str, ...] = (
    "label",
    *(f"I{j + 1}" for j in range(NUM_DENSE)),
    *(f"C{f + 1}" for f in range(NUM_SPARSE)),
)
"""The 40 columns of a sample, in file order."""

MISSING_VALUE = 0xFFFF_FFFF_FFFF_FFFF
"""The value a missing categorical reads as before hashing (see :func:`categorical_ids`)."""

_GOLDEN = 0x9E3779B97F4A7C15
_MAX_HEX = 16
_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate("0123456789abcdef"):
    _HEX[ord(_c)] = _HEX[ord(_c.upper())] = _i
_CHUNK = 16 << 20  # bytes read at a time when counting lines
_Arrays = tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.float32]]


def categorical_ids(values: npt.NDArray[np.uint64], feature: int) -> npt.NDArray[np.int64]:
    """The ids of categorical ``values`` of ``feature`` (0-based, ``C1`` is 0).

    Args:
        values: ``(n,)`` uint64, the parsed values (:data:`MISSING_VALUE` for a missing one).
        feature: in ``[0, 26)``.

    Returns:
        ``(n,)`` int64, each ``>= 0``.
    """
    with np.errstate(over="ignore"):
        salt = splitmix64(np.asarray([(feature + 1) * _GOLDEN % 2**64], dtype=np.uint64))
    return (splitmix64(values ^ salt) & np.uint64(ID_MASK)).view(np.int64)


class _LineIndex:
    """Lines of a TSV file, counted once: ``lines_before[i]`` newlines precede byte
    ``i * _CHUNK``, which lets :meth:`offset` find a line by reading one chunk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines_before: list[int] = []
        newlines, last = 0, b"\n"
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                self.lines_before.append(newlines)
                newlines += chunk.count(b"\n")
                last = chunk[-1:]
        self.num_lines = newlines + (last != b"\n")  # a last line without its newline counts

    def offset(self, line: int) -> int:
        """The byte offset where the 0-based ``line`` starts (``0 < line <= num_lines``)."""
        i = bisect.bisect_left(self.lines_before, line) - 1  # the chunk holding newline line-1
        with self.path.open("rb") as f:
            f.seek(i * _CHUNK)
            buf = np.frombuffer(f.read(_CHUNK), dtype=np.uint8)
        ends = np.flatnonzero(buf == ord("\n"))
        k = line - self.lines_before[i] - 1
        return i * _CHUNK + int(ends[k]) + 1 if k < len(ends) else i * _CHUNK + len(buf)


def _first_bad_line(path: Path, offset: int, line: int) -> tuple[int, int, bytes]:
    """The first line from byte ``offset`` (0-based ``line``) without 40 fields: its 1-based
    number, its field count and its text (or ``(0, 0, b"")`` if none)."""
    with path.open("rb") as f:
        f.seek(offset)
        carry = b""
        while True:
            chunk = f.read(_CHUNK)
            text = carry + chunk
            lines = text.split(b"\n")
            carry = lines.pop() if chunk else b""
            for row in lines if chunk else [*lines, carry]:
                fields = row.count(b"\t") + 1
                if fields != len(COLUMNS) and (chunk or row):
                    return line + 1, fields, row
                line += 1
            if not chunk:
                return 0, 0, b""


def _hex_values(
    arr: pa.Array, column: str, path: Path, where: Callable[[int], str]
) -> npt.NDArray[np.uint64]:
    """The values ``(n,)`` uint64 of a string / binary column of hex (``MISSING_VALUE`` where
    null or empty); ``where(i)`` names row ``i`` in errors."""
    n = len(arr)
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    off_type = np.int64 if large else np.int32
    bufs = arr.buffers()
    at = arr.offset * (8 if large else 4)
    offsets = np.frombuffer(bufs[1], off_type, n + 1, at).astype(np.int64, copy=False)
    raw = np.diff(offsets)
    lengths = raw.copy()
    if arr.null_count:
        lengths[arr.is_null().to_numpy(zero_copy_only=False)] = 0
    present = lengths > 0
    width = int(lengths.max()) if n else 0
    if width > _MAX_HEX:
        row = int(np.argmax(lengths > _MAX_HEX))
        raise FormatError(path, column, f"{where(row)}: more than 16 hex digits")
    values = np.full(n, MISSING_VALUE, dtype=np.uint64)
    if not width:
        return values
    data = np.frombuffer(bufs[2], dtype=np.uint8)
    if np.array_equal(raw, lengths) and bool((lengths[present] == width).all()):
        # Criteo's layout: every value `width` digits, so the digits form a matrix
        hexd = _HEX[data[offsets[0] : offsets[-1]]]
        if (hexd == 255).any():
            pos = int(offsets[0]) + int(np.argmax(hexd == 255))
            _not_hex(
                path, column, where, data, offsets, int(np.searchsorted(offsets, pos, "right")) - 1
            )
        full = 8 if width <= 8 else _MAX_HEX
        digits = np.zeros((len(hexd) // width, full), dtype=np.uint8)
        digits[:, full - width :] = hexd.reshape(-1, width)
    else:  # any widths: gather each value's digits right-aligned in 16
        cols = np.arange(_MAX_HEX)
        first = _MAX_HEX - lengths
        inside = cols >= first[:, None]
        idx = np.where(inside, offsets[:-1, None] + (cols - first[:, None]), 0)
        digits = np.where(inside, _HEX[data[idx]], np.uint8(0))
        bad = (digits == 255).any(axis=1)
        if bad.any():
            _not_hex(path, column, where, data, offsets, int(np.argmax(bad)))
        digits = digits[present]
    packed = (digits[:, 0::2] << np.uint8(4)) | digits[:, 1::2]  # big-endian bytes
    values[present] = packed.view(f">u{packed.shape[1]}").reshape(-1)
    return values


def _not_hex(
    path: Path,
    column: str,
    where: Callable[[int], str],
    data: npt.NDArray[np.uint8],
    offsets: npt.NDArray[np.int64],
    row: int,
) -> NoReturn:
    text = bytes(data[offsets[row] : offsets[row + 1]])
    raise FormatError(path, column, f"{where(row)}: {text!r} is not hex")


class ClickFile:
    """A click log file, read in order as :class:`ClickBatch` es (see the module docstring).

    Args:
        path: a ``.parquet`` / ``.pq`` file is Parquet, any other a Criteo TSV file. The file
            must not change while it is read.
        block_size: bytes of TSV that pyarrow parses at a time.

    Raises:
        FileNotFoundError: no such file.
        FormatError: a Parquet file without the columns of the format.
    """

    def __init__(self, path: str | os.PathLike[str], *, block_size: int = 8 << 20) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such file")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1024:
            raise ConfigError(f"block_size: must be an int >= 1024, got {block_size!r}")
        self.block_size = block_size
        self.format = "parquet" if self.path.suffix.lower() in (".parquet", ".pq") else "tsv"
        self._index: _LineIndex | None = None
        self._parquet: pq.ParquetFile | None = None
        if self.format == "parquet":
            self._parquet = pq.ParquetFile(self.path)
            schema = self._parquet.schema_arrow
            absent = [c for c in COLUMNS if c not in schema.names]
            if absent:
                raise FormatError(self.path, ",".join(absent), "columns missing")
            for c in COLUMNS:
                t = schema.field(c).type
                t = t.value_type if pa.types.is_dictionary(t) else t
                text = c[0] == "C" and (
                    pa.types.is_string(t)
                    or pa.types.is_binary(t)
                    or pa.types.is_large_string(t)
                    or pa.types.is_large_binary(t)
                )
                if not (
                    pa.types.is_integer(t) or text or (c[0] != "C" and pa.types.is_floating(t))
                ):
                    raise FormatError(self.path, c, f"column type {t} is not supported")

    @property
    def num_samples(self) -> int:
        """Samples in the file (Parquet: its metadata; TSV: its lines, counted once)."""
        if self._parquet is not None:
            return int(self._parquet.metadata.num_rows)
        if self._index is None:
            self._index = _LineIndex(self.path)
        return self._index.num_lines

    def batches(
        self, batch_size: int, start: int = 0, stop: int | None = None
    ) -> Iterator[ClickBatch]:
        """Samples ``[start, stop)`` in file order, ``batch_size`` at a time (the last batch
        may be smaller). TSV lines before ``start`` are skipped unparsed.

        Raises:
            ConfigError: ``batch_size < 1``, or ``start`` / ``stop`` outside ``[0, num_samples]``
                or ``stop < start``.
            FormatError: a malformed line or row; the message names the file and the line.
        """
        for name, v, least in (("batch_size", batch_size, 1), ("start", start, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise ConfigError(f"{name}: must be an int >= {least}, got {v!r}")
        if start > 0 or stop is not None:
            total = self.num_samples
            end = total if stop is None else stop
            if isinstance(end, bool) or not isinstance(end, int) or not start <= end <= total:
                raise ConfigError(
                    f"start={start}, stop={stop}: need 0 <= start <= stop <= num_samples={total}"
                )
            stop = end
        return self._batches(batch_size, start, stop)

    def _batches(self, batch_size: int, start: int, stop: int | None) -> Iterator[ClickBatch]:
        pending: list[_Arrays] = []
        rows = 0
        source = self._parquet_batches if self._parquet is not None else self._tsv_batches
        for first, rb in source(start, stop):
            pending.append(self._convert(rb, first))
            rows += rb.num_rows
            if rows < batch_size:
                continue
            dense, sparse, labels = (np.concatenate(a) for a in zip(*pending, strict=True))
            full = rows - rows % batch_size
            for i in range(0, full, batch_size):
                yield ClickBatch.from_numpy(
                    *(a[i : i + batch_size] for a in (dense, sparse, labels))
                )
            pending = [(dense[full:], sparse[full:], labels[full:])] if rows > full else []
            rows -= full
        if rows:
            yield ClickBatch.from_numpy(*(np.concatenate(a) for a in zip(*pending, strict=True)))

    def _where(self, first: int) -> Callable[[int], str]:
        tsv = self.format == "tsv"

        def where(i: int) -> str:
            return f"line {first + i + 1}" if tsv else f"row {first + i}"

        return where

    def _convert(self, rb: pa.RecordBatch, first: int) -> _Arrays:
        where = self._where(first)
        n = rb.num_rows
        label = rb.column("label")
        if label.null_count:
            row = int(np.argmax(label.is_null().to_numpy(zero_copy_only=False)))
            raise FormatError(self.path, "label", f"{where(row)}: missing")
        labels = label.to_numpy(zero_copy_only=False).astype(np.float32)
        bad = (labels != 0) & (labels != 1)
        if bad.any():
            row = int(np.argmax(bad))
            raise FormatError(self.path, "label", f"{where(row)}: {labels[row]} is not 0 or 1")
        dense = np.empty((n, NUM_DENSE), dtype=np.float32)
        for j in range(NUM_DENSE):
            x = pc.fill_null(rb.column(f"I{j + 1}"), 0).to_numpy(zero_copy_only=False)
            x = np.nan_to_num(x.astype(np.float64), nan=0.0)
            dense[:, j] = np.log1p(np.maximum(x, 0.0))
        sparse = np.empty((NUM_SPARSE, n), dtype=np.int64)
        for f in range(NUM_SPARSE):
            arr = rb.column(f"C{f + 1}")
            if pa.types.is_dictionary(arr.type):
                arr = arr.dictionary_decode()
            if pa.types.is_integer(arr.type):  # the value's 64-bit two's complement pattern
                x = pc.fill_null(arr, 0).to_numpy(zero_copy_only=False)
                values = x.astype(np.uint64) if x.dtype.kind == "u" else x.astype(np.int64)
                values = values.view(np.uint64)
                if arr.null_count:
                    values[arr.is_null().to_numpy(zero_copy_only=False)] = np.uint64(MISSING_VALUE)
            else:
                values = _hex_values(arr, f"C{f + 1}", self.path, where)
            sparse[f] = categorical_ids(values, f)
        return dense, np.ascontiguousarray(sparse.T), labels

    def _parquet_batches(
        self, start: int, stop: int | None
    ) -> Iterator[tuple[int, pa.RecordBatch]]:
        assert self._parquet is not None
        meta = self._parquet.metadata
        bounds = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
        end = int(bounds[-1]) if stop is None else stop
        groups = [
            g for g in range(meta.num_row_groups) if bounds[g + 1] > start and bounds[g] < end
        ]
        if not groups:
            return
        row = int(bounds[groups[0]])
        for rb in self._parquet.iter_batches(
            batch_size=65536, row_groups=groups, columns=list(COLUMNS)
        ):
            lo, hi = max(start - row, 0), min(end - row, rb.num_rows)
            if hi > lo:
                yield row + lo, rb.slice(lo, hi - lo)
            row += rb.num_rows
            if row >= end:
                return

    def _tsv_batches(self, start: int, stop: int | None) -> Iterator[tuple[int, pa.RecordBatch]]:
        if self.path.stat().st_size == 0 or (stop is not None and start >= stop):
            return
        offset = 0
        if start:
            assert self._index is not None  # batches() counted the lines
            offset = self._index.offset(start)
        invalid: list[pacsv.InvalidRow] = []

        def on_invalid(row: pacsv.InvalidRow) -> str:
            invalid.append(row)
            return "error"

        line = start
        types = {c: pa.int64() if c[0] != "C" else pa.binary() for c in COLUMNS}
        with pa.OSFile(str(self.path)) as f:
            f.seek(offset)
            try:
                reader = pacsv.open_csv(
                    f,
                    read_options=pacsv.ReadOptions(
                        column_names=list(COLUMNS), block_size=self.block_size
                    ),
                    parse_options=pacsv.ParseOptions(
                        delimiter="\t",
                        quote_char=False,
                        ignore_empty_lines=False,
                        invalid_row_handler=on_invalid,
                    ),
                    convert_options=pacsv.ConvertOptions(
                        column_types=types, null_values=[""], strings_can_be_null=True
                    ),
                )
                while stop is None or line < stop:
                    try:
                        rb = reader.read_next_batch()
                    except StopIteration:
                        return
                    if stop is not None and line + rb.num_rows > stop:
                        rb = rb.slice(0, stop - line)
                    yield line, rb
                    line += rb.num_rows
            except pa.ArrowInvalid as e:
                raise self._tsv_error(e, bool(invalid), line) from e

    def _tsv_error(self, e: pa.ArrowInvalid, bad_fields: bool, line: int) -> FormatError:
        if bad_fields:
            if self._index is None:
                self._index = _LineIndex(self.path)
            offset = self._index.offset(line) if line else 0
            number, fields, text = _first_bad_line(self.path, offset, line)
            if number:
                return FormatError(
                    self.path,
                    f"line {number}",
                    f"expected {len(COLUMNS)} tab-separated fields, got {fields}: {text[:200]!r}",
                )
        return FormatError(self.path, f"line {line + 1} or later", str(e))
