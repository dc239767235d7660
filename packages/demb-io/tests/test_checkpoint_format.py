"""The checkpoint format: round trips over every dtype, width, score layout and optional part
(hypothesis), multi-rank tables, atomic commits, the legacy meta, and validation errors that
name the file and the field."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from demb_io import (
    DTYPES,
    Checkpoint,
    CheckpointWriter,
    FormatError,
    ShardData,
    ShardMeta,
    from_float32,
    iter_shard,
    read_meta,
    read_shard,
    storage_dtype,
    to_float32,
)
from demb_io.manifest import reseal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def make_meta(
    rank=0,
    world=1,
    dtype="float32",
    dim=4,
    state=0,
    state_dtype=None,
    scores=1,
    admission=False,
    table="t",
    collection="ebc",
):
    strategy = ("TIMESTAMP", "LFU")[:scores]
    return ShardMeta(
        collection=collection,
        table=table,
        rank=rank,
        world_size=world,
        dist_type="roundrobin",
        embedding_dtype=dtype,
        embedding_dim=dim,
        rows=0,
        score_strategy=strategy,
        optimizer="adam" if state else None,
        optim_state_dtype=(state_dtype or dtype) if state else None,
        state_width=state,
        hyper_parameters={"learning_rate": 0.01} if state else {},
        admission_rows=0 if admission else None,
    )


def make_rows(meta, n, rng, key_offset=0):
    values = from_float32(rng.standard_normal((n, meta.embedding_dim)), meta.embedding_dtype)
    state = None
    if meta.state_width:
        state = from_float32(rng.standard_normal((n, meta.state_width)), meta.optim_state_dtype)
    admit = meta.admission_rows is not None
    return ShardData(
        keys=np.arange(key_offset, key_offset + n, dtype=np.int64) * 7 - 3,
        values=values,
        scores=rng.integers(-(2**62), 2**62, (n, meta.num_scores), dtype=np.int64),
        state=state,
        admit_keys=rng.integers(0, 1000, 5, dtype=np.int64) if admit else None,
        admit_counts=rng.integers(0, 9, 5, dtype=np.int64) if admit else None,
    )


def split(data, cuts):
    """``data`` as chunks cut at ``cuts`` (admission rows ride the first chunk)."""
    bounds = [0, *sorted(c for c in cuts if 0 < c < data.rows), data.rows]
    for i, (a, b) in enumerate(itertools.pairwise(bounds)):
        yield ShardData(
            data.keys[a:b],
            data.values[a:b],
            data.scores[a:b],
            None if data.state is None else data.state[a:b],
            data.admit_keys if i == 0 else None,
            data.admit_counts if i == 0 else None,
        )


def assert_same(got, want):
    for f in dataclasses.fields(ShardData):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if b is None:
            assert a is None, f.name
        else:
            assert a.dtype == b.dtype, f.name
            np.testing.assert_array_equal(a, b, err_msg=f.name)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    meta=st.builds(
        make_meta,
        dtype=st.sampled_from(DTYPES),
        dim=st.integers(1, 70),
        state=st.sampled_from([0, 1, 2, 16]),
        state_dtype=st.sampled_from(DTYPES),
        scores=st.sampled_from([1, 2]),
        admission=st.booleans(),
    ),
    n=st.integers(0, 300),
    cuts=st.lists(st.integers(0, 300), max_size=4),
    chunk_rows=st.integers(1, 400),
    seed=st.integers(0, 2**31),
)
def test_a_shard_round_trips(tmp_path, meta, n, cuts, chunk_rows, seed):
    rng = np.random.default_rng(seed)
    data = make_rows(meta, n, rng)
    path = tmp_path / f"ckpt{seed}"
    with CheckpointWriter(path) as w:
        written = w.write_shard(meta, split(data, cuts))
    assert written.rows == n
    ckpt = Checkpoint(path)
    assert ckpt.collections() == ["ebc"]
    assert ckpt.tables("ebc") == ["t"]
    assert_same(ckpt.read_table("ebc", "t"), data)
    chunks = [c for _, c in ckpt.iter_table("ebc", "t", chunk_rows)]
    assert all(c.rows <= chunk_rows for c in chunks)
    assert_same(
        ShardData(
            np.concatenate([c.keys for c in chunks]),
            np.concatenate([c.values for c in chunks]),
            np.concatenate([c.scores for c in chunks]),
            None if data.state is None else np.concatenate([c.state for c in chunks]),
            chunks[0].admit_keys,
            chunks[0].admit_counts,
        ),
        data,
    )
    assert read_meta(path / "ebc" / "t.rank0-of-1.meta.json") == written


def test_a_table_of_several_ranks_reads_back_in_rank_order(tmp_path):
    rng = np.random.default_rng(0)
    parts = []
    with CheckpointWriter(tmp_path / "c") as w:
        for rank in range(3):
            meta = make_meta(rank=rank, world=3, dim=8, state=8)
            parts.append(make_rows(meta, 10 + rank, rng, key_offset=100 * rank))
            w.write_shard(meta, [parts[-1]])
    table = Checkpoint(tmp_path / "c").read_table("ebc", "t")
    np.testing.assert_array_equal(table.keys, np.concatenate([p.keys for p in parts]))
    np.testing.assert_array_equal(table.state, np.concatenate([p.state for p in parts]))


def test_missing_ranks_and_disagreeing_layouts_are_named(tmp_path):
    rng = np.random.default_rng(0)
    with CheckpointWriter(tmp_path / "c") as w:
        for rank in (0, 2):
            meta = make_meta(rank=rank, world=3)
            w.write_shard(meta, [make_rows(meta, 3, rng)])
    with pytest.raises(FormatError, match=r"ranks \[0, 2\]; world_size 3 needs all"):
        Checkpoint(tmp_path / "c").read_table("ebc", "t")
    with CheckpointWriter(tmp_path / "d") as w:
        for rank, dtype in ((0, "float32"), (1, "float16")):
            meta = make_meta(rank=rank, world=2, dtype=dtype)
            w.write_shard(meta, [make_rows(meta, 3, rng)])
    with pytest.raises(FormatError, match=r"t\.rank1-of-2\.meta\.json \[embedding_dtype\]"):
        Checkpoint(tmp_path / "d").shards("ebc")


def write_one(path, n=20, **kw):
    meta = make_meta(**kw)
    data = make_rows(meta, n, np.random.default_rng(1))
    with CheckpointWriter(path) as w:
        w.write_shard(meta, [data])
    return data


def test_a_commit_replaces_the_old_checkpoint_and_a_failed_write_leaves_it(tmp_path):
    path = tmp_path / "c"
    write_one(path, n=5)
    second = write_one(path, n=9)
    assert_same(Checkpoint(path).read_table("ebc", "t"), second)

    class WriterDiedError(RuntimeError):
        pass

    def write_then_fail():
        with CheckpointWriter(path) as w:
            meta = make_meta(table="u")
            w.write_shard(meta, [make_rows(meta, 4, np.random.default_rng(2))])
            raise WriterDiedError

    with pytest.raises(WriterDiedError):
        write_then_fail()
    assert Checkpoint(path).tables("ebc") == ["t"]
    assert_same(Checkpoint(path).read_table("ebc", "t"), second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no temporary left


@pytest.mark.parametrize("part", ["keys", "values", "scores", "state"])
def test_truncated_and_corrupted_files_are_named(tmp_path, part):
    path = tmp_path / "c"
    write_one(path, state=4)
    file = path / "ebc" / f"t.rank0-of-1.{part}"
    blob = bytearray(file.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    file.write_bytes(bytes(blob))
    with pytest.raises(FormatError, match=rf"{part} \[{part}\]: CRC-32"):
        Checkpoint(path).read_table("ebc", "t")
    Checkpoint(path).read_table("ebc", "t", verify=False)  # sizes still agree
    file.write_bytes(bytes(blob[:-3]))
    with pytest.raises(
        FormatError, match=rf"t\.rank0-of-1\.{part}: {len(blob) - 3} bytes, the manifest says"
    ):
        Checkpoint(path).read_table("ebc", "t", verify=False)
    reseal(path)  # the manifest rewritten to the short file: the meta still says otherwise
    with pytest.raises(FormatError, match=rf"t\.rank0-of-1\.meta\.json \[files\.{part}\]: differs"):
        Checkpoint(path).read_table("ebc", "t", verify=False)


@pytest.mark.parametrize(
    ("edit", "field", "match"),
    [
        (lambda d: d.pop("rows"), "rows", "missing"),
        (lambda d: d.update(rows="7"), "rows", "expected int"),
        (lambda d: d.update(embedding_dtype="float64"), "embedding_dtype", "not one of"),
        (lambda d: d.update(rank=3), "rank", "not below world_size"),
        (lambda d: d.update(format_version=9), "format_version", "9 is not 1"),
        (lambda d: d.update(dist_type="random"), "dist_type", "not one of"),
        (lambda d: d["files"]["keys"].update(name="../x"), "files.keys.name", "plain file"),
        (lambda d: d.update(num_scores=2), "num_scores", "disagrees"),
    ],
)
def test_bad_meta_fields_are_named(tmp_path, edit, field, match):
    path = tmp_path / "c"
    write_one(path)
    meta_path = path / "ebc" / "t.rank0-of-1.meta.json"
    d = json.loads(meta_path.read_text())
    edit(d)
    meta_path.write_text(json.dumps(d))
    with pytest.raises(FormatError, match=rf"\[{field}\]: .*{match}"):
        read_meta(meta_path)


def test_a_legacy_meta_reads_float32_with_the_width_from_the_file(tmp_path):
    folder = tmp_path
    keys = np.array([5, 9, 11], dtype="<i8")
    values = np.arange(3 * 6, dtype="<f4").reshape(3, 6)
    (folder / "t.rank0-of-1.keys").write_bytes(keys.tobytes())
    (folder / "t.rank0-of-1.values").write_bytes(values.tobytes())
    meta = {
        "collection": "ebc",
        "table": "t",
        "rank": 0,
        "world_size": 1,
        "dist_type": "roundrobin",
    }
    (folder / "t.rank0-of-1.meta.json").write_text(json.dumps(meta))
    m = read_meta(folder / "t.rank0-of-1.meta.json")
    assert m.legacy
    data = read_shard(folder, m)
    np.testing.assert_array_equal(data.keys, keys)
    np.testing.assert_array_equal(data.values, values)
    assert data.scores.shape == (3, 1)
    (folder / "t.rank0-of-1.values").write_bytes(values.tobytes()[:-4])
    with pytest.raises(FormatError, match=r"values \[embedding_dim\]: 68 bytes do not hold 3"):
        read_shard(folder, m)


def test_a_chunk_that_disagrees_with_the_meta_is_refused(tmp_path):
    meta = make_meta(dim=4)
    bad = make_rows(dataclasses.replace(meta, embedding_dim=5), 3, np.random.default_rng(0))
    with (
        pytest.raises(ValueError, match=r"values must be \(3, 4\)"),
        CheckpointWriter(tmp_path / "c") as w,
    ):
        w.write_shard(meta, [bad])
    assert not (tmp_path / "c").exists()


def test_iter_shard_checks_before_the_first_chunk(tmp_path):
    path = tmp_path / "c"
    write_one(path)
    (path / "ebc" / "t.rank0-of-1.keys").unlink()
    with pytest.raises(FormatError, match=r"t\.rank0-of-1\.keys \[keys\]: cannot be read"):
        next(iter_shard(path / "ebc", path / "ebc" / "t.rank0-of-1.meta.json"))


def test_not_a_checkpoint_is_named(tmp_path):
    with pytest.raises(FormatError, match="FORMAT: not a committed demb checkpoint"):
        Checkpoint(tmp_path)


def test_bfloat16_rounds_to_nearest_even_like_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[np.isfinite(x)]
    words = from_float32(x, "bfloat16")
    want = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy()
    np.testing.assert_array_equal(words.view(np.int16), want)
    back = to_float32(words, "bfloat16")
    np.testing.assert_array_equal(back, torch.from_numpy(x.copy()).to(torch.bfloat16).float())
    assert storage_dtype("bfloat16") == np.dtype("<u2")
    assert np.isnan(
        to_float32(from_float32(np.array([np.nan], np.float32), "bfloat16"), "bfloat16")
    )


def test_fresh_meta_round_trips_through_json(tmp_path):
    meta = dataclasses.replace(make_meta(state=3, admission=True), rows=0)
    path: Path = tmp_path / "c"
    with CheckpointWriter(path) as w:
        written = w.write_shard(meta, [])
    assert written.rows == 0
    assert written.admission_rows == 0
    assert read_meta(path / "ebc" / f"{meta.stem}.meta.json") == written


def test_an_expected_precision_converts_with_a_warning_and_a_wrong_dim_is_an_error(tmp_path):
    path = tmp_path / "c"
    data = write_one(path, dtype="float16", state=2)
    with pytest.warns(UserWarning, match=r"t\.rank0-of-1\.meta\.json: rows stored as float16, "):
        got = Checkpoint(path).read_table("ebc", "t", expect_dtype="bfloat16", expect_dim=4)
    want = from_float32(to_float32(data.values, "float16"), "bfloat16")
    np.testing.assert_array_equal(got.values, want)
    assert got.state is not None
    assert got.state.dtype == np.uint16
    with pytest.raises(FormatError, match=r"\[embedding_dim\]: 4 stored, 8 expected"):
        Checkpoint(path).read_table("ebc", "t", expect_dim=8)
    same = Checkpoint(path).read_table("ebc", "t", expect_dtype="float16")  # no warning
    np.testing.assert_array_equal(same.values, data.values)


def test_checksums_per_block_across_chunk_boundaries(tmp_path, monkeypatch):
    """Blocks of 1,000 bytes (the format's are 64 MiB) cut across chunks of odd sizes: every
    block's CRC-32 is right, and a flipped byte is reported in its block."""
    import demb_io._crc
    import demb_io.meta

    for module in (demb_io._crc, demb_io.meta):
        monkeypatch.setattr(module, "CRC_BLOCK", 1000)
    meta = make_meta(dim=5)
    data = make_rows(meta, 401, np.random.default_rng(3))
    with CheckpointWriter(tmp_path / "c") as w:
        written = w.write_shard(meta, split(data, [7, 150, 151, 390]))
    assert written.files["values"].bytes == 401 * 5 * 4
    assert len(written.files["values"].crc32) == 9  # 8,020 bytes
    assert_same(Checkpoint(tmp_path / "c").read_table("ebc", "t"), data)
    values = tmp_path / "c" / "ebc" / "t.rank0-of-1.values"
    blob = bytearray(values.read_bytes())
    blob[2500] ^= 1
    values.write_bytes(bytes(blob))
    with pytest.raises(FormatError, match=r"\[values\]: CRC-32 of block 2 is"):
        Checkpoint(tmp_path / "c").read_table("ebc", "t")
    # Chunks of 30 rows (600 value bytes): the ones before block 2 (bytes 2000..2999) come out,
    # the one reaching into it is held back by the failed check.
    chunks = iter(Checkpoint(tmp_path / "c").iter_table("ebc", "t", 30))
    got = [next(chunks)[1].keys.copy() for _ in range(3)]  # rows 0..89: bytes 0..1799
    np.testing.assert_array_equal(np.concatenate(got), data.keys[:90])
    with pytest.raises(FormatError, match=r"\[values\]: CRC-32 of block 2 is"):
        next(chunks)  # rows 90..119 reach byte 2399


def test_big_endian_arrays_are_stored_little_endian(tmp_path):
    meta = make_meta(dim=2)
    data = make_rows(meta, 5, np.random.default_rng(4))
    swapped = ShardData(
        data.keys.astype(">i8"), data.values.astype(">f4"), data.scores.astype(">i8")
    )
    with CheckpointWriter(tmp_path / "c") as w:
        w.write_shard(meta, [swapped])
    assert_same(Checkpoint(tmp_path / "c").read_table("ebc", "t"), data)
    raw = np.fromfile(tmp_path / "c" / "ebc" / "t.rank0-of-1.keys", dtype="<i8")
    np.testing.assert_array_equal(raw, data.keys)


def test_a_writer_caller_may_reuse_its_buffers_at_once(tmp_path, monkeypatch):
    """Chunks handed over in one buffer that the caller refills after each write (a streaming
    copy's pattern), with checksumming slowed down: the CRCs describe what was written."""
    import time

    from demb_io import _crc

    crc32 = _crc.crc32

    def slow_crc32(data):
        time.sleep(0.01)
        return crc32(data)

    monkeypatch.setattr(_crc, "crc32", slow_crc32)
    meta = make_meta(dim=4)
    data = make_rows(meta, 40, np.random.default_rng(7))
    buffer = make_rows(meta, 10, np.random.default_rng(8))

    def refilled():
        for begin in range(0, 40, 10):
            for name in ("keys", "values", "scores"):
                getattr(buffer, name)[...] = getattr(data, name)[begin : begin + 10]
            yield buffer

    with CheckpointWriter(tmp_path / "c") as w:
        w.write_shard(meta, refilled())
    monkeypatch.undo()
    got = Checkpoint(tmp_path / "c").read_table("ebc", "t")  # CRCs checked
    np.testing.assert_array_equal(got.keys, data.keys)
    np.testing.assert_array_equal(got.values, data.values)


@pytest.mark.parametrize("size", [0, 1, 7, 4096, (1 << 20) + 3])
def test_the_fast_crc32_gives_zlibs_values(tmp_path, size):
    """ISA-L's CRC-32 (the `crc` extra, installed in this workspace) equals zlib's, on bytes and
    on the read-only memory-mapped blocks the checks use."""
    import zlib

    from demb_io import _crc

    pytest.importorskip("isal")
    assert _crc.crc32_backend() == "isal"
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    assert _crc.crc32(data) == zlib.crc32(data)
    (tmp_path / "f").write_bytes(data)
    assert _crc.block_crcs(tmp_path / "f", size) == [
        zlib.crc32(data[b : b + _crc.CRC_BLOCK]) for b in range(0, size, _crc.CRC_BLOCK)
    ]


def test_a_checkpoint_reads_back_whichever_crc32_wrote_it(tmp_path, monkeypatch):
    """Written with zlib's CRC-32, checked with the fast one, and the other way round."""
    import zlib

    from demb_io import _crc

    meta = make_meta(dim=3)
    data = make_rows(meta, 50, np.random.default_rng(2))
    for writer, reader in ((zlib.crc32, _crc.crc32), (_crc.crc32, zlib.crc32)):
        target = tmp_path / f"c-{writer is zlib.crc32}"
        monkeypatch.setattr(_crc, "crc32", writer)
        with CheckpointWriter(target) as w:
            w.write_shard(meta, [data])
        monkeypatch.setattr(_crc, "crc32", reader)
        got = Checkpoint(target).read_table("ebc", "t")  # CRCs checked
        np.testing.assert_array_equal(got.values, data.values)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd (Linux)")
def test_a_chunked_read_holds_its_files_open_once_and_closes_them(tmp_path):
    """One descriptor per part for the whole read (the kernel's readahead follows it), all
    closed when the reader stops early, and the chunks equal one whole read."""
    meta = make_meta(dim=3)
    data = make_rows(meta, 100, np.random.default_rng(3))
    with CheckpointWriter(tmp_path / "c") as w:
        w.write_shard(meta, [data])
    before = len(list(Path("/proc/self/fd").iterdir()))
    chunks = iter(Checkpoint(tmp_path / "c").iter_table("ebc", "t", 30, verify=False))
    first = next(chunks)[1]
    opened = len(list(Path("/proc/self/fd").iterdir())) - before
    assert opened == 3  # keys, values, scores
    rest = [c for _, c in chunks]
    assert len(list(Path("/proc/self/fd").iterdir())) == before
    np.testing.assert_array_equal(
        np.concatenate([first.values, *(c.values for c in rest)]), data.values
    )
    early = iter(Checkpoint(tmp_path / "c").iter_table("ebc", "t", 30, verify=False))
    next(early)
    early.close()  # a reader that stops early
    assert len(list(Path("/proc/self/fd").iterdir())) == before


def test_big_reads_go_in_two_halves_and_still_catch_a_short_file(tmp_path):
    """A read of >= 8 MiB is two reads at once: the same rows as a small read's, and a file
    that ends inside either half is a FormatError naming it."""
    from demb_io._files import _SPLIT, RowFile

    rows, width = _SPLIT // 4 // 16 + 123, 16  # just over the split size in float32 rows
    data = np.random.default_rng(5).standard_normal((rows, width)).astype(np.float32)
    path = tmp_path / "rows"
    path.write_bytes(data.tobytes())
    with RowFile(path, width, np.dtype("<f4")) as f:
        np.testing.assert_array_equal(f.read(0, rows), data)
        np.testing.assert_array_equal(f.read(rows - 5, 5), data[-5:])  # a small read
    for keep in (rows // 4, 3 * rows // 4):  # ends in the first half, in the second
        path.write_bytes(data[:keep].tobytes())
        with RowFile(path, width, np.dtype("<f4")) as f, pytest.raises(FormatError, match="rows"):
            f.read(0, rows)
