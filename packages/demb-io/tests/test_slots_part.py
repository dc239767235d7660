"""The optional ``slots`` part of a checkpoint shard and its meta field ``slot_layout``: round
trips (chunked, hypothesis), refusals naming the field or part (a flag without its file, a file
without its flag, bad layouts, slots out of range, wrong dtype or shape), metas without the key,
damaged slot files, and the tools that rewrite shards (reshard, apply) dropping the slots."""

from __future__ import annotations

import dataclasses
import itertools
import json

import numpy as np
import pytest
from demb_io import (
    Checkpoint,
    CheckpointWriter,
    DeltaMeta,
    DeltaTable,
    FormatError,
    ShardData,
    ShardMeta,
    ShardWriter,
    apply_delta,
    export_npz,
    iter_shard,
    read_meta,
    read_shard,
    reshard,
    write_shard,
)
from demb_io.manifest import reseal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

STEM = "t.rank0-of-1"


def make_meta(layout=(64, 8), rank=0, world=1, state=0):
    return ShardMeta(
        collection="ebc",
        table="t",
        rank=rank,
        world_size=world,
        dist_type="roundrobin",
        embedding_dtype="float32",
        embedding_dim=3,
        rows=0,
        score_strategy=("TIMESTAMP", "LFU"),
        optimizer="adagrad" if state else None,
        optim_state_dtype="float32" if state else None,
        state_width=state,
        slot_layout=layout,
    )


def make_rows(meta, n, seed=0, key_offset=0):
    """``n`` rows for ``meta``: distinct slots in ``[0, capacity)`` when it has a layout."""
    rng = np.random.default_rng(seed)
    slots = None
    if meta.slot_layout is not None:
        slots = rng.permutation(meta.slot_layout[0])[:n].astype(np.int64)
    return ShardData(
        keys=np.arange(key_offset, key_offset + n, dtype=np.int64) * 2 + meta.rank,
        values=rng.standard_normal((n, meta.embedding_dim)).astype(np.float32),
        scores=rng.integers(0, 1000, (n, meta.num_scores), dtype=np.int64),
        state=rng.standard_normal((n, meta.state_width)).astype(np.float32)
        if meta.state_width
        else None,
        slots=slots,
    )


def split(data, cuts):
    bounds = [0, *sorted(c for c in cuts if 0 < c < data.rows), data.rows]
    for a, b in itertools.pairwise(bounds):
        yield ShardData(
            data.keys[a:b],
            data.values[a:b],
            data.scores[a:b],
            None if data.state is None else data.state[a:b],
            slots=None if data.slots is None else data.slots[a:b],
        )


def assert_same(got, want):
    for f in dataclasses.fields(ShardData):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if b is None:
            assert a is None, f.name
        else:
            assert a is not None, f.name
            assert a.dtype == b.dtype, f.name
            np.testing.assert_array_equal(a, b, err_msg=f.name)


def write_checkpoint(path, meta, data, cuts=()):
    with CheckpointWriter(path) as w:
        return w.write_shard(meta, split(data, cuts))


def edit_meta(path, edit):
    """Edit the shard's meta JSON with ``edit(dict)`` and reseal the checkpoint."""
    meta_path = path / "ebc" / f"{STEM}.meta.json"
    d = json.loads(meta_path.read_text())
    edit(d)
    meta_path.write_text(json.dumps(d))
    reseal(path)
    return meta_path


layouts = st.one_of(
    st.none(),
    st.tuples(st.integers(1, 64), st.integers(1, 8)).map(lambda cb: (cb[0] * cb[1], cb[1])),
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layout=layouts,
    state=st.sampled_from([0, 2]),
    n=st.integers(0, 64),
    cuts=st.lists(st.integers(0, 64), max_size=3),
    chunk_rows=st.integers(1, 80),
    seed=st.integers(0, 2**31),
)
def test_a_shard_round_trips_its_slots(tmp_path, layout, state, n, cuts, chunk_rows, seed):
    meta = make_meta(layout, state=state)
    n = min(n, layout[0]) if layout is not None else n
    data = make_rows(meta, n, seed)
    path = tmp_path / f"c{seed}-{n}-{layout}"
    written = write_checkpoint(path, meta, data, cuts)
    assert written.slot_layout == layout
    assert ("slots" in written.files) == (layout is not None)
    assert (path / "ebc" / f"{STEM}.slots").exists() == (layout is not None)
    assert read_meta(path / "ebc" / f"{STEM}.meta.json") == written
    ckpt = Checkpoint(path)
    assert_same(ckpt.read_table("ebc", "t"), data)
    assert_same(read_shard(path / "ebc", written), data)
    chunks = [c for _, c in ckpt.iter_table("ebc", "t", chunk_rows)]
    assert all(c.rows <= chunk_rows for c in chunks)
    assert all((c.slots is None) == (layout is None) for c in chunks)
    if layout is not None:
        np.testing.assert_array_equal(np.concatenate([c.slots for c in chunks]), data.slots)
        reused = [c.slots.copy() for c in iter_shard(path / "ebc", written, chunk_rows, reuse=True)]
        np.testing.assert_array_equal(np.concatenate(reused), data.slots)


def test_a_shard_writer_appends_slots_chunk_by_chunk(tmp_path):
    meta = make_meta((32, 4))
    data = make_rows(meta, 20)
    writer = ShardWriter(tmp_path, meta)
    for chunk in split(data, [3, 4, 17]):
        writer.append(chunk)
    written = writer.close()
    assert written.files["slots"].bytes == 20 * 8
    assert_same(read_shard(tmp_path, tmp_path / f"{STEM}.meta.json"), data)
    (tmp_path / "again").mkdir()
    again = write_shard(tmp_path / "again", meta, split(data, [10]))
    assert again.slot_layout == (32, 4)
    assert again.files["slots"].crc32 == written.files["slots"].crc32


def test_the_layout_is_json_ints_and_numpy_ints_are_accepted(tmp_path):
    meta = make_meta((np.int64(16), np.int32(4)))
    written = write_shard(tmp_path, meta, [make_rows(make_meta((16, 4)), 5)])
    assert written.slot_layout == (16, 4)
    assert all(type(v) is int for v in written.slot_layout)
    d = json.loads((tmp_path / f"{STEM}.meta.json").read_text())
    assert d["slot_layout"] == [16, 4]


def test_a_table_of_several_ranks_returns_slots_per_rank_only(tmp_path):
    path = tmp_path / "c"
    metas = [make_meta((16, 4), rank=0, world=2), make_meta(None, rank=1, world=2)]
    rows = [make_rows(m, 5, seed=m.rank) for m in metas]
    with CheckpointWriter(path) as w:
        for m, r in zip(metas, rows, strict=True):
            w.write_shard(m, [r])
    ckpt = Checkpoint(path)
    assert [m.slot_layout for m in ckpt.shards("ebc", "t")] == [(16, 4), None]
    table = ckpt.read_table("ebc", "t")
    assert table.slots is None
    np.testing.assert_array_equal(table.keys, np.concatenate([r.keys for r in rows]))
    by_rank = {m.rank: c.slots for m, c in ckpt.iter_table("ebc", "t")}
    np.testing.assert_array_equal(by_rank[0], rows[0].slots)
    assert by_rank[1] is None


def test_a_meta_without_the_key_reads_as_no_slots(tmp_path):
    path = tmp_path / "c"
    meta = make_meta(None)
    write_checkpoint(path, meta, make_rows(meta, 4))
    meta_path = path / "ebc" / f"{STEM}.meta.json"
    assert "slot_layout" not in json.loads(meta_path.read_text())  # as older writers wrote it
    assert read_meta(meta_path).slot_layout is None
    assert Checkpoint(path).read_table("ebc", "t").slots is None
    edit_meta(path, lambda d: d.update(slot_layout=None))  # null reads the same
    assert read_meta(meta_path).slot_layout is None


def test_a_legacy_meta_has_no_slots_even_beside_a_slots_file(tmp_path):
    keys = np.array([5, 9, 11], dtype="<i8")
    (tmp_path / f"{STEM}.keys").write_bytes(keys.tobytes())
    (tmp_path / f"{STEM}.values").write_bytes(np.zeros((3, 2), "<f4").tobytes())
    (tmp_path / f"{STEM}.slots").write_bytes(np.arange(3, dtype="<i8").tobytes())
    legacy = {"collection": "ebc", "table": "t", "rank": 0, "world_size": 1}
    (tmp_path / f"{STEM}.meta.json").write_text(json.dumps({**legacy, "dist_type": "roundrobin"}))
    m = read_meta(tmp_path / f"{STEM}.meta.json")
    assert m.legacy
    assert m.slot_layout is None
    assert "slots" not in m.files
    assert read_shard(tmp_path, m).slots is None


def test_a_flag_without_its_file_and_a_file_without_its_flag_are_named(tmp_path):
    path = tmp_path / "c"
    meta = make_meta(None)
    write_checkpoint(path, meta, make_rows(meta, 4))
    meta_path = edit_meta(path, lambda d: d.update(slot_layout=[16, 4]))
    with pytest.raises(FormatError, match=r"\[files\.slots\]: missing, but slot_layout"):
        read_meta(meta_path)
    with pytest.raises(FormatError, match=r"\[files\.slots\]"):
        Checkpoint(path).read_table("ebc", "t")

    path = tmp_path / "s"
    meta = make_meta((16, 4))
    write_checkpoint(path, meta, make_rows(meta, 4))
    meta_path = edit_meta(path, lambda d: d.pop("slot_layout"))
    with pytest.raises(FormatError, match=r"\[slot_layout\]: says there is no slots"):
        read_meta(meta_path)
    with pytest.raises(FormatError, match=r"\[slot_layout\]"):
        Checkpoint(path).read_table("ebc", "t")


BAD_LAYOUTS = [
    [16], [16, 4, 1], [16, 3], [0, 1], [16, 0], [-16, 4], [16.0, 4], [True, 1], [16, "4"],
    "16,4", {"capacity": 16}, 16, [2**70, 1],
]  # fmt: skip


@pytest.mark.parametrize("value", BAD_LAYOUTS)
def test_a_bad_slot_layout_is_named(tmp_path, value):
    path = tmp_path / "c"
    meta = make_meta((16, 4))
    write_checkpoint(path, meta, make_rows(meta, 4))
    meta_path = edit_meta(path, lambda d: d.update(slot_layout=value))
    with pytest.raises(FormatError, match=r"\[slot_layout\]"):
        read_meta(meta_path)
    if isinstance(value, list) and all(type(v) is int for v in value):
        with pytest.raises(ValueError, match="slot_layout"):
            write_shard(tmp_path, make_meta(tuple(value)), [])


def test_a_slot_outside_the_capacity_on_disk_is_named(tmp_path):
    path = tmp_path / "c"
    meta = make_meta((16, 4))
    data = make_rows(meta, 4)
    data.slots[:] = [1, 15, 2, 3]
    write_checkpoint(path, meta, data)
    edit_meta(path, lambda d: d.update(slot_layout=[8, 4]))  # CRC-clean, out of range
    with pytest.raises(FormatError, match=rf"{STEM}\.slots \[slots\]: row 1's slot 15 is outside"):
        Checkpoint(path).read_table("ebc", "t")
    meta_path = path / "ebc" / f"{STEM}.meta.json"
    with pytest.raises(FormatError, match=r"\[slots\]: row 1's slot 15 is outside \[0, 8\)"):
        list(iter_shard(path / "ebc", meta_path, chunk_rows=1))  # counted from the shard's start


def bad_chunks(meta):
    rows = make_rows(meta, 4)
    slots = rows.slots
    return {
        "given": (dataclasses.replace(rows, slots=np.arange(4, dtype=np.int64)), "slots given"),
        "missing": (dataclasses.replace(rows, slots=None), "slots missing"),
        "dtype": (dataclasses.replace(rows, slots=slots.astype(np.int32)), "slots must be"),
        "shape": (dataclasses.replace(rows, slots=slots[:, None]), "slots must be"),
        "short": (dataclasses.replace(rows, slots=slots[:3]), "slots must be"),
        "high": (dataclasses.replace(rows, slots=np.array([0, 1, 16, 2])), "slot 16 is outside"),
        "negative": (dataclasses.replace(rows, slots=np.array([0, -1, 3, 2])), "slot -1 is outs"),
    }


@pytest.mark.parametrize(
    "case", ["given", "missing", "dtype", "shape", "short", "high", "negative"]
)
def test_a_chunk_whose_slots_disagree_with_the_meta_is_refused(tmp_path, case):
    layout = None if case == "given" else (16, 4)
    meta = make_meta(layout)
    chunk, match = bad_chunks(make_meta((16, 4)))[case]
    with pytest.raises(ValueError, match=match), CheckpointWriter(tmp_path / "c") as w:
        w.write_shard(meta, [make_rows(meta, 2, key_offset=100), chunk])
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=match):
        ShardWriter(tmp_path, meta).append(chunk)


def test_a_damaged_slots_file_is_named(tmp_path):
    path = tmp_path / "c"
    meta = make_meta((64, 8))
    write_checkpoint(path, meta, make_rows(meta, 30))
    file = path / "ebc" / f"{STEM}.slots"
    blob = bytearray(file.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    file.write_bytes(bytes(blob))
    with pytest.raises(FormatError, match=r"slots \[slots\]: CRC-32"):
        Checkpoint(path).read_table("ebc", "t")
    with pytest.raises(FormatError, match=r"slots \[slots\]: CRC-32"):
        list(iter_shard(path / "ebc", path / "ebc" / f"{STEM}.meta.json", 7))
    file.write_bytes(bytes(blob[:-8]))
    with pytest.raises(FormatError, match=rf"{STEM}\.slots: {len(blob) - 8} bytes, the manifest"):
        Checkpoint(path).read_table("ebc", "t", verify=False)
    with pytest.raises(FormatError, match=r"slots \[slots\]: 232 bytes on disk, 240 in the meta"):
        read_shard(path / "ebc", path / "ebc" / f"{STEM}.meta.json", verify=False)
    reseal(path)
    with pytest.raises(FormatError, match=r"\[files\.slots\]: differs"):
        Checkpoint(path).read_table("ebc", "t", verify=False)


def no_slots_anywhere(path):
    """Every shard of the checkpoint at ``path`` has no slots, in its meta or beside it."""
    ckpt = Checkpoint(path)
    for c in ckpt.collections():
        for t in ckpt.tables(c):
            for m in ckpt.shards(c, t):
                assert m.slot_layout is None
                assert "slots" not in m.files
                assert "slot_layout" not in json.loads(
                    (path / c / f"{m.stem}.meta.json").read_text()
                )
                assert read_shard(path / c, m).slots is None
    assert not list(path.rglob("*.slots"))


def test_reshard_and_apply_drop_the_slots(tmp_path):
    source = tmp_path / "c"
    metas = [make_meta((32, 4), rank=r, world=2, state=2) for r in range(2)]
    rows = [make_rows(m, 6, seed=m.rank) for m in metas]
    with CheckpointWriter(source) as w:
        for m, r in zip(metas, rows, strict=True):
            w.write_shard(m, [r])
    keys = np.sort(np.concatenate([r.keys for r in rows]))

    reshard(source, tmp_path / "r", 3, "roundrobin")
    no_slots_anywhere(tmp_path / "r")
    np.testing.assert_array_equal(
        np.sort(Checkpoint(tmp_path / "r").read_table("ebc", "t").keys), keys
    )

    n = 2
    delta = DeltaTable(
        meta=DeltaMeta(
            collection="ebc",
            table="t",
            embedding_dtype="float32",
            embedding_dim=3,
            score_strategy=("TIMESTAMP", "LFU"),
            current_score=2000,
            current_capacity=32,
            row_capacity=(32,),
            bucket_capacity=4,
            world_size=2,
            dist_type="roundrobin",
            optim_state_dtype="float32",
            state_width=2,
        ),
        keys=np.array([0, 999], dtype=np.int64),
        values=np.ones((n, 3), np.float32),
        scores=np.zeros((n, 2), np.int64),
        slots=np.array([3, 7], dtype=np.int64),
        state=np.zeros((n, 2), np.float32),
        erased=np.array([2], dtype=np.int64),
    )
    apply_delta(source, [delta], tmp_path / "a")
    no_slots_anywhere(tmp_path / "a")
    applied = Checkpoint(tmp_path / "a").read_table("ebc", "t").keys
    assert sorted(applied.tolist()) == sorted({*keys.tolist(), 999} - {2})
    apply_delta(source, [], tmp_path / "a0")  # a table the delta leaves alone: dropped too
    no_slots_anywhere(tmp_path / "a0")


def test_export_ignores_the_slots(tmp_path):
    path = tmp_path / "c"
    meta = make_meta((16, 4))
    data = make_rows(meta, 5)
    write_checkpoint(path, meta, data)
    export_npz(path, "ebc", "t", tmp_path / "t.npz")
    with np.load(tmp_path / "t.npz") as archive:
        assert sorted(archive.files) == ["keys", "scores", "values"]
        np.testing.assert_array_equal(archive["keys"], data.keys)
