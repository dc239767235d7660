"""Criteo TSV and Parquet readers: the same rows give the same batches, by the documented rule
(checked against a plain per-line Python parse), in order from any start, and a malformed line
raises an error that names the file and the line."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from demb_torchrec.errors import ConfigError, FormatError
from demb_torchrec.train import criteo
from demb_torchrec.train.batch import ClickBatch
from demb_torchrec.train.criteo import COLUMNS, MISSING_VALUE, ClickFile
from hypothesis import given, settings
from hypothesis import strategies as st

M64 = 2**64 - 1


def _mix(z: int) -> int:
    """splitmix64's finalizer on Python ints."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def parse_line(line: str) -> tuple[list[float], list[int], float]:
    """The documented rule, one line at a time."""
    fields = line.rstrip("\n").split("\t")
    assert len(fields) == 40
    dense = [float(np.float32(math.log1p(max(int(x), 0)))) if x else 0.0 for x in fields[1:14]]
    sparse = []
    for f, c in enumerate(fields[14:]):
        v = int(c, 16) if c else MISSING_VALUE
        sparse.append(_mix(v ^ _mix(((f + 1) * 0x9E3779B97F4A7C15) & M64)) & (2**63 - 1))
    return dense, sparse, float(fields[0])


def make_rows(n: int, seed: int = 0) -> list[list[str]]:
    """Rows of 40 fields as text: missing, negative and large ints, missing categoricals,
    8-digit and shorter hex, upper case."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ints = [
            rng.choice(["", "-1", "-3", "0", str(rng.randrange(50)), str(rng.randrange(2**40))])
            for _ in range(13)
        ]
        cats = [
            rng.choice(["", f"{rng.randrange(2**32):08x}", f"{rng.randrange(300):x}", "FFfe01"])
            for _ in range(26)
        ]
        rows.append([str(rng.randrange(2)), *ints, *cats])
    return rows


def write_tsv(path: Path, rows: list[list[str]], final_newline: bool = True) -> Path:
    text = "\n".join("\t".join(r) for r in rows)
    path.write_text(text + ("\n" if final_newline else ""))
    return path


def write_parquet(
    path: Path, rows: list[list[str]], int_cats: bool = False, row_group_size: int = 1000
) -> Path:
    cols: dict[str, pa.Array] = {"label": pa.array([int(r[0]) for r in rows], pa.int64())}
    for j in range(1, 14):
        cols[COLUMNS[j]] = pa.array([int(r[j]) if r[j] else None for r in rows], pa.int64())
    for j in range(14, 40):
        if int_cats:  # the values themselves, as int64 bit patterns
            vals = [np.uint64(int(r[j], 16)).astype(np.int64) if r[j] else None for r in rows]
            cols[COLUMNS[j]] = pa.array(vals, pa.int64())
        else:
            cols[COLUMNS[j]] = pa.array([r[j] or None for r in rows], pa.string())
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)
    return path


def read_all(f: ClickFile, batch_size: int, start: int = 0, stop: int | None = None) -> ClickBatch:
    return ClickBatch.concat(list(f.batches(batch_size, start, stop)))


def same(a: ClickBatch, b: ClickBatch) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.sparse, b.sparse)
        and torch.equal(a.labels, b.labels)
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[list[str]], Path, Path, Path]:
    tmp = tmp_path_factory.mktemp("criteo")
    rows = make_rows(300)
    return (
        rows,
        write_tsv(tmp / "day_0.tsv", rows),
        write_parquet(tmp / "day_0.parquet", rows, row_group_size=64),
        write_parquet(tmp / "day_0_ints.pq", rows, int_cats=True, row_group_size=100),
    )


def test_rule_and_formats_agree(files: tuple[list[list[str]], Path, Path, Path]) -> None:
    rows, tsv, parquet, parquet_ints = files
    want = reference(rows)
    for path in (tsv, parquet, parquet_ints):
        f = ClickFile(path, block_size=4096)  # several TSV blocks
        assert f.num_samples == len(rows)
        batches = list(f.batches(64))
        assert [len(b) for b in batches] == [64] * 4 + [300 - 256]
        assert same(ClickBatch.concat(batches), want), path
    assert ClickFile(parquet).format == "parquet"
    assert ClickFile(tsv).format == "tsv"
    # a missing categorical has one fixed id per feature, apart from the ids of values seen
    is_missing = torch.tensor([[c == "" for c in r[14:]] for r in rows])
    for f in range(26):
        ids = want.sparse[:, f]
        assert len(ids[is_missing[:, f]].unique()) == 1
        assert not bool(torch.isin(ids[is_missing[:, f]], ids[~is_missing[:, f]]).any())
    assert len(want.sparse[is_missing].unique()) == 26
    assert bool((want.sparse >= 0).all())


FULL: dict[Path, ClickBatch] = {}  # each file read whole, once


@settings(max_examples=15, deadline=None)
@given(
    batch_size=st.integers(1, 90),
    start=st.integers(0, 300),
    length=st.integers(0, 300),
    chunk=st.sampled_from([64, 1000, 16 << 20]),
)
def test_start_stop_is_a_slice(
    files: tuple[list[list[str]], Path, Path, Path],
    batch_size: int,
    start: int,
    length: int,
    chunk: int,
) -> None:
    rows, tsv, parquet, _ = files
    stop = min(start + length, len(rows))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(criteo, "_CHUNK", chunk)  # line counting across many chunk boundaries
        for path in (tsv, parquet):
            f = ClickFile(path, block_size=8192)  # about 30 lines a block
            full = FULL.setdefault(path, read_all(f, 300))
            got = list(f.batches(batch_size, start, stop))
            assert all(len(b) == batch_size for b in got[:-1])
            if stop == start:
                assert got == []
                continue
            assert same(ClickBatch.concat(got), full.slice(start, stop)), (path, start, stop)
            if stop == len(rows):
                assert same(read_all(f, batch_size, start), full.slice(start, stop))


def reference(rows: list[list[str]]) -> ClickBatch:
    ref = [parse_line("\t".join(r)) for r in rows]
    return ClickBatch(
        torch.tensor([d for d, _, _ in ref], dtype=torch.float32),
        torch.tensor([s for _, s, _ in ref], dtype=torch.int64),
        torch.tensor([y for _, _, y in ref], dtype=torch.float32),
    )


@pytest.mark.parametrize("width", [1, 8, 11, 16])
def test_fixed_width_layout(tmp_path: Path, width: int) -> None:
    """Criteo's usual layout (every value the same width, or missing) takes a faster path."""
    rng = random.Random(width)
    rows = []
    for i in range(100):
        cats = [
            rng.choice(["", "f" * width, f"{rng.randrange(16**width):0{width}x}"])
            for _ in range(26)
        ]
        rows.append([str(i % 2), *[str(i - 3)] * 13, *cats])
    rows[0][14:] = ["F" * width] * 26  # upper case digits
    want = reference(rows)
    for path in (write_tsv(tmp_path / "w.tsv", rows), write_parquet(tmp_path / "w.pq", rows)):
        assert same(read_all(ClickFile(path), 33), want), path
        assert same(read_all(ClickFile(path), 33, start=17, stop=61), want.slice(17, 61))
    rows[57][30] = "g" * width
    with pytest.raises(FormatError, match=r"\[C17\]: line 58: b'g+' is not hex"):
        read_all(ClickFile(write_tsv(tmp_path / "bad.tsv", rows)), 33)


def test_integer_categorical_columns(tmp_path: Path) -> None:
    """An integer column holds the values themselves: any integer type, signed or not."""
    rows = make_rows(40, seed=5)
    table = pq.read_table(write_parquet(tmp_path / "a.parquet", rows, int_cats=True))
    c1 = [int(r[14], 16) if r[14] else None for r in rows]
    table = table.set_column(14, "C1", pa.array(c1, pa.uint64()))
    small = [v % 128 if v is not None else None for v in c1]
    table = table.set_column(15, "C2", pa.array([-v if v else v for v in small], pa.int8()))
    pq.write_table(table, tmp_path / "b.parquet")
    for r, v in zip(rows, small, strict=True):  # -v as a 64-bit pattern, in hex
        r[15] = "" if v is None else f"{-v % 2**64:x}"
    assert same(read_all(ClickFile(tmp_path / "b.parquet"), 16), reference(rows))


def test_num_samples_without_final_newline(tmp_path: Path) -> None:
    rows = make_rows(5, seed=1)
    f = ClickFile(write_tsv(tmp_path / "a.txt", rows, final_newline=False))
    assert f.num_samples == 5
    assert len(read_all(f, 2, start=3)) == 2
    empty = tmp_path / "empty.tsv"
    empty.write_bytes(b"")
    assert ClickFile(empty).num_samples == 0
    assert list(ClickFile(empty).batches(4)) == []


@pytest.mark.parametrize("start", [0, 40])
@pytest.mark.parametrize(
    ("bad", "field", "match"),
    [
        (lambda r: r[:-1], "line 171", "expected 40 tab-separated fields, got 39"),
        (lambda r: [*r, "12"], "line 171", "got 41"),
        (lambda r: [], "label", "line 171: missing"),  # an empty line: all fields missing
        (lambda r: [*r[:16], "12zz", *r[17:]], "C3", "line 171: b'12zz' is not hex"),
        (lambda r: [*r[:16], "1" * 17, *r[17:]], "C3", "line 171: more than 16 hex"),
        (lambda r: ["2", *r[1:]], "label", "line 171: 2.0 is not 0 or 1"),
        (lambda r: ["", *r[1:]], "label", "line 171: missing"),
    ],
)
def test_bad_tsv_line_names_file_and_line(
    tmp_path: Path, start: int, bad: object, field: str, match: str
) -> None:
    rows = make_rows(200, seed=2)
    rows[170] = bad(rows[170])  # type: ignore[operator]
    path = write_tsv(tmp_path / "bad.tsv", rows)
    f = ClickFile(path, block_size=2048)  # the bad line is in a later block
    with pytest.raises(FormatError, match=match) as info:
        read_all(f, 32, start=start)
    assert info.value.path == path
    assert field in str(info.value)
    # the samples of earlier blocks read fine
    assert len(read_all(f, 32, stop=20)) == 20


def test_bad_integer_field_names_file(tmp_path: Path) -> None:
    rows = make_rows(20, seed=3)
    rows[7][5] = "x1"
    path = write_tsv(tmp_path / "bad_int.tsv", rows)
    with pytest.raises(FormatError, match=r"bad_int\.tsv"):
        read_all(ClickFile(path), 8)


def test_bad_parquet(tmp_path: Path) -> None:
    rows = make_rows(30, seed=4)
    rows[12][20] = "nothex"
    path = write_parquet(tmp_path / "bad.parquet", rows)
    with pytest.raises(FormatError, match=r"\[C7\]: row 12: b'nothex' is not hex"):
        read_all(ClickFile(path), 8)
    table = pq.read_table(write_parquet(tmp_path / "ok.parquet", rows[:3]))
    pq.write_table(table.drop_columns(["I4", "C2"]), tmp_path / "cols.parquet")
    with pytest.raises(FormatError, match="I4,C2"):
        ClickFile(tmp_path / "cols.parquet")
    pq.write_table(table.set_column(1, "I1", pa.array(["a", "b", "c"])), tmp_path / "types.parquet")
    with pytest.raises(FormatError, match="I1"):
        ClickFile(tmp_path / "types.parquet")


def test_bad_arguments(files: tuple[list[list[str]], Path, Path, Path], tmp_path: Path) -> None:
    _, tsv, parquet, _ = files
    for path in (tsv, parquet):
        f = ClickFile(path)
        with pytest.raises(ConfigError, match="batch_size"):
            f.batches(0)
        with pytest.raises(ConfigError, match="num_samples=300"):
            f.batches(8, start=301)
        with pytest.raises(ConfigError, match="stop"):
            f.batches(8, start=10, stop=5)
    with pytest.raises(FileNotFoundError, match=r"nope\.tsv"):
        ClickFile(tmp_path / "nope.tsv")
