"""Deltas and the offline tools: delta round trips; applying deltas one by one equals applying
their merge; reshard W -> W' -> W keeps every key's content for every dist type; apply and
reshard commute; the CLI, also from a fresh venv with only demb-io and its dependencies
installed."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from demb_io import (
    Checkpoint,
    CheckpointWriter,
    DeltaMeta,
    DeltaTable,
    FormatError,
    LayoutError,
    ShardData,
    ShardMeta,
    apply_delta,
    export_npz,
    export_parquet,
    from_float32,
    merge_delta_files,
    merge_deltas,
    read_delta,
    read_shard,
    reshard,
    to_float32,
    write_delta,
)
from demb_io.cli import main
from demb_planner import continuous_block_size, owner_rank
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DIM, STATE = 3, 2
PACKAGES = Path(__file__).resolve().parents[2]
STRATEGY = ("TIMESTAMP", "LFU")


LAYOUT = {
    "collection": "ebc",
    "embedding_dtype": "bfloat16",
    "embedding_dim": DIM,
    "score_strategy": STRATEGY,
    "optim_state_dtype": "float32",
    "state_width": STATE,
}
"""The layout of every table here, the same in the checkpoints' shards and in the deltas."""
SHARD = {**LAYOUT, "rows": 0, "optimizer": "adagrad", "num_embeddings": 1000}
DELTA = {**LAYOUT, "current_capacity": 1024, "row_capacity": (1024,), "bucket_capacity": 128}


def shard_meta(rank, world, dist="roundrobin", table="t"):
    return ShardMeta(table=table, rank=rank, world_size=world, dist_type=dist, **SHARD)


def make_checkpoint(path, keys, world=2, dist="roundrobin", seed=0, tables=("t",)):
    rng = np.random.default_rng(seed)
    keys = np.asarray(keys, dtype=np.int64)
    with CheckpointWriter(path) as w:
        for table in tables:
            block = continuous_block_size(1000, world) if dist == "continuous" else None
            owners = owner_rank(keys, world, dist, block)
            for rank in range(world):
                k = keys[owners == rank]
                n = k.size
                w.write_shard(
                    shard_meta(rank, world, dist, table),
                    [
                        ShardData(
                            k,
                            from_float32(rng.standard_normal((n, DIM)), "bfloat16"),
                            rng.integers(0, 10**6, (n, 2), dtype=np.int64),
                            rng.standard_normal((n, STATE)).astype(np.float32),
                        )
                    ],
                )


def make_delta(keys, erased, current, seed, table="t"):
    rng = np.random.default_rng(seed)
    keys = np.asarray(keys, dtype=np.int64)
    n = keys.size
    meta = DeltaMeta(
        table=table,
        current_score=current,
        world_size=2,
        dist_type="roundrobin",
        evicted_rows=0,
        table_options={"dim": DIM, "score_strategy": list(STRATEGY)},
        **DELTA,
    )
    return DeltaTable(
        meta=meta,
        keys=keys,
        values=from_float32(rng.standard_normal((n, DIM)), "bfloat16"),
        scores=np.stack([rng.integers(0, current + 1, n), rng.integers(0, 50, n)], 1).astype(
            np.int64
        ),
        slots=keys % 1024,  # a key keeps its slot: no delta evicts another's key
        state=rng.standard_normal((n, STATE)).astype(np.float32),
        erased=np.asarray(erased, dtype=np.int64),
        evicted=rng.integers(0, 1000, 2).astype(np.int64),
    )


def content(path):
    """key -> (values, scores, state, rank) over every table of a checkpoint."""
    ckpt = Checkpoint(path)
    out = {}
    for c in ckpt.collections():
        for t in ckpt.tables(c):
            for meta, chunk in ckpt.iter_table(c, t):
                for i, k in enumerate(chunk.keys.tolist()):
                    out[(c, t, k)] = (
                        chunk.values[i].tobytes(),
                        tuple(chunk.scores[i].tolist()),
                        chunk.state[i].tobytes(),
                        meta.rank,
                    )
    return out


def without_rank(c):
    return {k: v[:3] for k, v in c.items()}


def test_a_delta_round_trips(tmp_path):
    delta = [make_delta([5, 7, 9], [1, 2], 10_000, 0), make_delta([3], [], 10_000, 1, table="u")]
    written = write_delta(tmp_path / "d", delta)
    back = read_delta(tmp_path / "d")
    assert [t.meta for t in back] == written
    for a, b in zip(back, delta, strict=True):
        for f in ("keys", "values", "scores", "slots", "state", "erased", "evicted"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    steps=st.lists(
        st.tuples(
            st.sets(st.integers(0, 40), max_size=12),
            st.sets(st.integers(0, 40), max_size=5),
            st.integers(0, 1000),
        ),
        min_size=1,
        max_size=4,
    ),
    seed=st.integers(0, 2**31),
)
def test_applying_deltas_one_by_one_equals_applying_their_merge(tmp_path, steps, seed):
    run = Path(tempfile.mkdtemp(dir=tmp_path))  # hypothesis reuses tmp_path across examples
    make_checkpoint(run / "c0", range(0, 40, 2), seed=seed)
    deltas, current = [], 5000
    for i, (keys, erased, advance) in enumerate(steps):
        current += advance
        deltas.append([make_delta(sorted(keys), sorted(erased), current, seed + i)])
    path = run / "c0"
    for i, d in enumerate(deltas):  # streamed in small chunks; the merge in one
        apply_delta(path, d, run / f"c{i + 1}", chunk_rows=3)
        path = run / f"c{i + 1}"
    apply_delta(run / "c0", merge_deltas(deltas), run / "merged")
    assert content(path) == content(run / "merged")
    write_delta(run / "m", merge_deltas(deltas))  # and the merge survives the disk
    apply_delta(run / "c0", read_delta(run / "m"), run / "merged2")
    assert content(run / "merged2") == content(path)


@pytest.mark.parametrize("dist", ["continuous", "roundrobin", "hash_roundrobin"])
@pytest.mark.parametrize(("world", "other"), [(1, 3), (2, 5), (4, 2)])
def test_reshard_there_and_back_keeps_every_key(tmp_path, dist, world, other):
    keys = np.unique(np.random.default_rng(0).integers(-(2**40), 2**40, 300))
    keys = np.concatenate([keys, np.arange(0, 999, 7)])  # continuous: in-range keys too
    make_checkpoint(tmp_path / "a", np.unique(keys), world=world, dist=dist)
    reshard(tmp_path / "a", tmp_path / "b", other, dist, chunk_rows=37)  # streamed in chunks
    reshard(tmp_path / "b", tmp_path / "c", world, dist)
    before, middle, after = (content(tmp_path / p) for p in "abc")
    assert after == before  # same rank too
    assert without_rank(middle) == without_rank(before)
    block = continuous_block_size(1000, other) if dist == "continuous" else None
    for (_, _, key), value in middle.items():
        assert value[3] == owner_rank(np.array([key]), other, dist, block)[0]


@pytest.mark.parametrize("dist", ["continuous", "roundrobin", "hash_roundrobin"])
def test_apply_and_reshard_commute(tmp_path, dist):
    make_checkpoint(tmp_path / "c", range(0, 60, 3), world=2, dist=dist)
    delta = [make_delta([1, 3, 4, 100, 2000], [6, 9], 7000, 3)]
    apply_delta(tmp_path / "c", delta, tmp_path / "applied")
    reshard(tmp_path / "applied", tmp_path / "applied_resharded", 3, dist)
    reshard(tmp_path / "c", tmp_path / "resharded", 3, dist)
    apply_delta(tmp_path / "resharded", delta, tmp_path / "resharded_applied")
    assert content(tmp_path / "applied_resharded") == content(tmp_path / "resharded_applied")


def test_apply_turns_ages_back_into_scores_and_keeps_other_columns(tmp_path):
    make_checkpoint(tmp_path / "c", [2, 4], world=1)
    delta = make_delta([4, 8], [2], 9000, 0)
    apply_delta(tmp_path / "c", [delta], tmp_path / "out")
    got = content(tmp_path / "out")
    assert sorted(k for _, _, k in got) == [4, 8]
    for i, key in enumerate([4, 8]):
        assert got[("ebc", "t", key)][1] == (
            9000 - int(delta.scores[i, 0]),
            int(delta.scores[i, 1]),
        )


def test_layouts_that_differ_are_named(tmp_path):
    make_checkpoint(tmp_path / "c", [1, 2], world=1)
    bad = make_delta([1], [], 10, 0)
    bad = dataclasses.replace(
        bad, meta=dataclasses.replace(bad.meta, embedding_dim=4), values=np.zeros((1, 4), np.uint16)
    )
    with pytest.raises(LayoutError, match=r"ebc/t: embedding_dim is 3 in the checkpoint, 4"):
        apply_delta(tmp_path / "c", [bad], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    moved = make_delta([1], [], 10, 0)
    moved = dataclasses.replace(moved, meta=dataclasses.replace(moved.meta, current_capacity=2048))
    with pytest.raises(LayoutError, match="ebc/t: current_capacity differs between deltas"):
        merge_deltas([[make_delta([1], [], 5, 0)], [moved]])
    with pytest.warns(UserWarning, match="delta table ebc/x is not in"):
        apply_delta(tmp_path / "c", [make_delta([1], [], 10, 0, table="x")], tmp_path / "out2")


def test_cli_commands(tmp_path, capsys):
    make_checkpoint(tmp_path / "c", range(10), world=2, tables=("t", "u"))
    write_delta(tmp_path / "d1", [make_delta([1, 50], [2], 100, 0)])
    write_delta(tmp_path / "d2", [make_delta([50, 60], [], 200, 1)])
    assert main(["inspect", str(tmp_path / "c")]) == 0
    assert "ebc/u" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "c")]) == 0
    assert main(["merge", str(tmp_path / "m"), str(tmp_path / "d1"), str(tmp_path / "d2")]) == 0
    assert main(["inspect", str(tmp_path / "m")]) == 0
    assert main(["apply", str(tmp_path / "c"), str(tmp_path / "m"), str(tmp_path / "c2")]) == 0
    assert (
        main(
            [
                "reshard",
                str(tmp_path / "c2"),
                str(tmp_path / "c3"),
                "--world-size",
                "3",
                "--dist-type",
                "hash_roundrobin",
            ]
        )
        == 0
    )
    assert main(["export", str(tmp_path / "c3"), "ebc", "t", str(tmp_path / "t.npz")]) == 0
    with np.load(tmp_path / "t.npz") as npz:
        assert sorted(npz["keys"].tolist()) == [0, 1, 3, 4, 5, 6, 7, 8, 9, 50, 60]
        assert npz["values"].dtype == np.float32
    capsys.readouterr()
    (tmp_path / "c3" / "ebc" / "t.rank1-of-3.values").write_bytes(b"\x00")
    assert main(["verify", str(tmp_path / "c3")]) == 2
    err = capsys.readouterr().err
    assert "t.rank1-of-3.values: 1 bytes, the manifest says" in err


def _uv() -> str:
    """The uv that set up this environment (README), to install into a fresh venv offline."""
    found = os.environ.get("UV") or shutil.which("uv")
    if found is None:
        pytest.skip("uv (the README's installer) is not on PATH")
    return found


def _copy_distribution(name: str, site: Path) -> None:
    """Copy installed distribution ``name`` (its package files and metadata, as its RECORD
    lists them; no scripts) into ``site``."""
    dist = importlib.metadata.distribution(name)
    for entry in dist.files or []:
        source = Path(str(dist.locate_file(entry)))
        if ".." in entry.parts or not source.is_file():
            continue
        target = site / entry
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)


def test_the_cli_runs_in_a_venv_with_only_demb_io_installed(tmp_path):
    """A fresh venv (no pip, no torch) holding demb-io and the two dependencies it declares
    (demb-planner, numpy) and nothing else: uv installs the two packages from their sources
    offline, and numpy is copied from this environment (the same interpreter; a fresh
    ``uv sync --frozen`` downloads it by the lock's URL, so uv's cache cannot resolve it
    offline). The installed ``demb-io`` script runs every subcommand's help, a verify and an
    inspect, and torch is not importable there."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    sources = tmp_path / "src"
    for name in ("demb-planner", "demb-io"):  # copies: the build leaves the checkout alone
        shutil.copytree(PACKAGES / name, sources / name, ignore=shutil.ignore_patterns("build"))
    install = [_uv(), "pip", "install", "--python", str(python), "--offline", "--quiet"]
    packages = [str(sources / "demb-planner"), str(sources / "demb-io")]
    subprocess.run([*install, "--no-deps", *packages], check=True)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    _copy_distribution("numpy", venv / "lib" / version / "site-packages")
    script = venv / "bin" / "demb-io"

    def printed(code: str) -> str:
        """What ``code`` prints when run by the venv's python."""
        done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    listed = printed(
        "import importlib.metadata as m; print(sorted(d.name for d in m.distributions()))"
    )
    assert listed == "['demb-io', 'demb-planner', 'numpy']", listed
    declared = printed("import importlib.metadata as m; print(m.requires('demb-io'))")
    assert "numpy" in declared
    assert "demb-planner" in declared
    assert "torch" not in declared
    no_torch = subprocess.run([str(python), "-c", "import torch"], capture_output=True, check=False)
    assert no_torch.returncode != 0
    # No `crc` extra there: it checks with zlib's CRC-32.
    assert printed("from demb_io._crc import crc32_backend; print(crc32_backend())") == "zlib"
    make_checkpoint(tmp_path / "c", range(5), world=1)  # written here (ISA-L, if installed)
    for args in (["verify"], ["inspect"]):
        done = subprocess.run(
            [str(script), *args, str(tmp_path / "c")], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
    assert (
        "ok: checkpoint"
        in subprocess.run(
            [str(script), "verify", str(tmp_path / "c")], capture_output=True, text=True, check=True
        ).stdout
    )
    for command in ("", "inspect", "verify", "merge", "apply", "reshard", "export"):
        args = [command, "--help"] if command else ["--help"]
        done = subprocess.run([str(script), *args], capture_output=True, text=True, check=False)
        assert done.returncode == 0, (command, done.stderr)
        assert "usage: demb-io" in done.stdout


def test_export_to_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    make_checkpoint(tmp_path / "c", range(7), world=2)
    assert (
        main(
            [
                "export",
                str(tmp_path / "c"),
                "ebc",
                "t",
                str(tmp_path / "t.parquet"),
                "--format",
                "parquet",
            ]
        )
        == 0
    )
    got = pq.read_table(tmp_path / "t.parquet").to_pydict()
    rows = Checkpoint(tmp_path / "c").read_table("ebc", "t")
    assert got["key"] == rows.keys.tolist()
    assert got["values"] == to_float32(rows.values, "bfloat16").tolist()
    assert got["scores"] == rows.scores.tolist()
    assert got["state"] == rows.state.tolist()


def test_reshard_routes_admission_counters_by_their_keys(tmp_path):
    with CheckpointWriter(tmp_path / "a") as w:
        for rank in range(2):
            meta = dataclasses.replace(shard_meta(rank, 2), admission_rows=0)
            keys = np.arange(rank, 20, 2, dtype=np.int64)
            w.write_shard(
                meta,
                [
                    ShardData(
                        keys,
                        np.zeros((10, DIM), np.uint16),
                        np.zeros((10, 2), np.int64),
                        np.zeros((10, STATE), np.float32),
                        admit_keys=keys + 100,
                        admit_counts=keys % 5,
                    )
                ],
            )
    reshard(tmp_path / "a", tmp_path / "b", 3, "roundrobin", chunk_rows=4)
    got = {}
    for meta in Checkpoint(tmp_path / "b").shards("ebc", "t"):
        data = read_shard(tmp_path / "b" / "ebc", meta)
        assert (owner_rank(data.admit_keys, 3, "roundrobin") == meta.rank).all()
        got.update(zip(data.admit_keys.tolist(), data.admit_counts.tolist(), strict=True))
    assert got == {k + 100: k % 5 for k in range(20)}


def test_merging_delta_directories_streams_table_by_table(tmp_path):
    """merge_delta_files (one table of each delta in memory) writes what merge_deltas of the
    whole deltas gives, with tables present in only some deltas."""
    deltas = [
        [make_delta([1, 2, 3], [9], 100, 0), make_delta([4], [], 100, 1, table="u")],
        [make_delta([2, 5], [1], 150, 2, table="u")],
        [make_delta([3, 7], [2], 300, 3), make_delta([8], [], 300, 4, table="v")],
    ]
    paths = [tmp_path / f"d{i}" for i in range(len(deltas))]
    for path, delta in zip(paths, deltas, strict=True):
        write_delta(path, delta)
    written = merge_delta_files(paths, tmp_path / "m")
    got, want = read_delta(tmp_path / "m"), merge_deltas(deltas)
    assert [t.meta for t in got] == written
    assert [(t.meta.table, t.meta.current_score) for t in got] == [
        (t.meta.table, t.meta.current_score) for t in want
    ]
    for a, b in zip(got, want, strict=True):
        for f in ("keys", "values", "scores", "slots", "state", "erased", "evicted"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    moved = dataclasses.replace(
        deltas[0][0], meta=dataclasses.replace(deltas[0][0].meta, dist_type="continuous")
    )
    write_delta(tmp_path / "bad", [moved])
    with pytest.raises(LayoutError, match="dist_type differs"):
        merge_delta_files([tmp_path / "d0", tmp_path / "bad"], tmp_path / "m2")
    assert not (tmp_path / "m2").exists()


@pytest.mark.parametrize("float32", [True, False])
def test_exports_stream_chunk_by_chunk(tmp_path, float32):
    """npz and parquet exports read in 3-row chunks equal the whole table, admission counters
    included (npz), and an empty table exports empty arrays of the right shapes."""
    with CheckpointWriter(tmp_path / "c") as w:
        for rank, n in enumerate((7, 0, 5)):
            keys = np.arange(rank, 3 * n, 3, dtype=np.int64)[:n]
            w.write_shard(
                dataclasses.replace(shard_meta(rank, 3), admission_rows=0),
                [
                    ShardData(
                        keys,
                        from_float32(np.arange(n * DIM).reshape(n, DIM), "bfloat16"),
                        np.arange(2 * n, dtype=np.int64).reshape(n, 2),
                        np.ones((n, STATE), np.float32),
                        admit_keys=keys + 1000,
                        admit_counts=keys,
                    )
                ],
            )
    rows = Checkpoint(tmp_path / "c").read_table("ebc", "t")
    values = to_float32(rows.values, "bfloat16") if float32 else rows.values
    export_npz(tmp_path / "c", "ebc", "t", tmp_path / "t.npz", float32=float32, chunk_rows=3)
    with np.load(tmp_path / "t.npz") as npz:
        np.testing.assert_array_equal(npz["keys"], rows.keys)
        np.testing.assert_array_equal(npz["values"], values)
        assert npz["values"].dtype == values.dtype
        np.testing.assert_array_equal(npz["scores"], rows.scores)
        np.testing.assert_array_equal(npz["state"], rows.state)
        np.testing.assert_array_equal(npz["admit_keys"], rows.admit_keys)
        np.testing.assert_array_equal(npz["admit_counts"], rows.admit_counts)
    pq = pytest.importorskip("pyarrow.parquet")
    export_parquet(tmp_path / "c", "ebc", "t", tmp_path / "t.pq", float32=float32, chunk_rows=3)
    got = pq.read_table(tmp_path / "t.pq")
    assert got.column("key").to_pylist() == rows.keys.tolist()
    assert got.column("values").to_pylist() == values.tolist()
    assert got.column("scores").to_pylist() == rows.scores.tolist()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "t.npz", "t.pq"]  # no scratch


def test_an_empty_table_exports_and_a_failed_export_leaves_nothing(tmp_path):
    make_checkpoint(tmp_path / "c", [], world=2)
    export_npz(tmp_path / "c", "ebc", "t", tmp_path / "t.npz", chunk_rows=2)
    with np.load(tmp_path / "t.npz") as npz:
        assert npz["keys"].shape == (0,)
        assert npz["values"].shape == (0, DIM)
        assert npz["state"].shape == (0, STATE)
    with pytest.raises(FormatError):
        export_npz(tmp_path / "c", "ebc", "nope", tmp_path / "x.npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "t.npz"]


def test_a_meta_under_another_tables_name_is_a_format_error(tmp_path):
    """A delta meta copied or swapped under another table's file name (two metas then claim
    one table) is a FormatError naming the file, not a writer's ValueError: the manifest does
    not list the copy; and where the manifest is rewritten to list it, the meta's table is
    checked against its file's name."""
    from demb_io.manifest import reseal
    from demb_io.mutations import small_delta

    path = tmp_path / "d"
    small_delta(path)
    shutil.copy(path / "ebc" / "t.meta.json", path / "ebc" / "u.meta.json")
    with pytest.raises(FormatError, match="not in the manifest") as bad:
        read_delta(path)
    assert bad.value.path == path / "ebc" / "u.meta.json"
    reseal(path)
    with pytest.raises(FormatError, match="'t' is not the table its file names") as bad:
        read_delta(path)
    assert bad.value.path == path / "ebc" / "u.meta.json"
    assert bad.value.field == "table"


def test_a_failed_apply_leaves_no_open_file_and_no_staging(tmp_path):
    """A checkpoint whose second rank fails its CRC mid-apply: FormatError, the target not
    written, no staging left, and no file of the dropped staging left open (ResourceWarning)."""
    import gc
    import warnings

    make_checkpoint(tmp_path / "c", range(0, 600, 3), world=2)
    values = next((tmp_path / "c").rglob("t.rank1-of-2.values"))
    data = bytearray(values.read_bytes())
    data[len(data) // 2] ^= 0x10
    values.write_bytes(bytes(data))
    delta = [make_delta([1, 3, 4], [6], 7000, 3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(FormatError, match="values"):
            apply_delta(tmp_path / "c", delta, tmp_path / "out", chunk_rows=16)
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_failed_delta_write_leaves_no_open_file_and_no_staging(tmp_path, monkeypatch):
    """A part that fails to write (here: the disk refuses its bytes) drops the staging and
    leaves no file open (ResourceWarning), as a failed checkpoint write does."""
    import gc
    import warnings

    from demb_io import _files, write_delta

    def refuse(self, array):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_files.PartWriter, "write", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(OSError, match="No space left"):
            write_delta(tmp_path / "d", [make_delta([1, 3], [6], 7000, 3)])
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert list(tmp_path.iterdir()) == []


def test_a_newer_row_at_an_older_rows_slot_supersedes_it_in_a_merge():
    old = make_delta([1, 2], [], 100, 0)
    new = make_delta([3], [], 200, 1)
    new.slots[:] = old.slots[0]  # key 3 took key 1's slot: key 1 was evicted (unrecorded)
    merged = merge_deltas([[old], [new]])[0]
    assert sorted(merged.keys.tolist()) == [2, 3]
    assert len(set(merged.slots.tolist())) == merged.keys.size


def test_apply_removes_retained_evicted_keys_the_delta_does_not_write(tmp_path):
    make_checkpoint(tmp_path / "c", [2, 4, 6], world=1)
    delta = make_delta([6, 8], [], 9000, 0)
    delta.evicted = np.array([2, 6], dtype=np.int64)  # 6 was evicted, then written again
    apply_delta(tmp_path / "c", [delta], tmp_path / "out")
    assert sorted(k for _, _, k in content(tmp_path / "out")) == [4, 6, 8]
