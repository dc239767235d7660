"""DynamicEmbDump(..., blocking=False): the checkpoint holds the tables as they were at the call
while training goes on during the write (keys inserted, evicted, tables grown, rows and
optimizer state updated): it equals, file for file, a blocking dump taken just before. The
background write is held on an event until the training steps ran, so the overlap is certain.
Nothing is committed before ``wait()``; an error in the background surfaces from ``wait()`` as
CheckpointError and leaves the target as it was; 2 gloo ranks (marker ``multiproc``) do the same
under DistributedModelParallel, with an error on one rank failing the dump on both."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from demb_io import Checkpoint, ShardData, ShardMeta
from demb_torchrec import (
    DynamicEmbDump,
    DynamicEmbeddingTables,
    DynamicEmbLoad,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)
from demb_torchrec import dump as dump_module
from demb_torchrec._snapshot import _POOL
from demb_torchrec.dump import DumpHandle, release_snapshot_memory
from demb_torchrec.errors import CheckpointError
from torch import nn

COLLECTION = "sparse.tables"
TABLES = ("user", "item")
RANK_SCRIPT = Path(__file__).with_name("_nonblocking_rank.py")
Writer = Callable[[Path, ShardMeta, Iterator[ShardData]], None]


class Model(nn.Module):
    """Two tables: ``user`` starts at 128 slots and grows to 256 (then evicts), ``item`` has
    128 slots (evicts early); both score (LFU, TIMESTAMP) and train with Adam."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        scores = (DynamicEmbScoreStrategy.LFU, DynamicEmbScoreStrategy.TIMESTAMP)
        opts = [
            DynamicEmbTableOptions(
                dim=d, init_capacity=128, max_capacity=cap, score_strategy=scores
            )
            for d, cap in ((8, 256), (4, 128))
        ]
        tables = DynamicEmbeddingTables(
            opts,
            table_names=list(TABLES),
            pooling_mode=DynamicEmbPoolingMode.SUM,
            device=device,
            optimizer="adam",
            learning_rate=0.05,
        )
        self.sparse = nn.ModuleDict({"tables": tables})


def _train(model: Model, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tables = model.sparse["tables"]
    for _ in range(steps):
        lengths = torch.randint(0, 20, (2 * 5,), generator=gen)
        keys = torch.randint(0, 5000, (int(lengths.sum()),), generator=gen) * 7919
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        tables(keys.to(tables.device), offsets.to(tables.device)).square().sum().backward()


def _live(model: Model) -> dict[str, dict[int, list[float]]]:
    """Per table, key -> row with optimizer state, as the model holds them now."""
    tables = model.sparse["tables"].tables
    out = {}
    for t, name in enumerate(TABLES):
        ex = tables.export(t)
        out[name] = dict(zip(ex.keys.tolist(), ex.values.float().tolist(), strict=True))
    return out


def _read(path: Path) -> dict[str, ShardData]:
    ckpt = Checkpoint(path)
    return {n: ckpt.read_table(c, n) for c in ckpt.collections() for n in ckpt.tables(c)}


def assert_same_checkpoint(got: Path, want: Path) -> None:
    """Same tables with equal keys, values, scores and state (in slot order), and equal bytes
    in every file (the metas and the manifest included: nothing in them varies)."""
    a, b = _read(got), _read(want)
    assert a.keys() == b.keys()
    for name in a:
        for part in ("keys", "values", "scores", "state"):
            x, y = getattr(a[name], part), getattr(b[name], part)
            assert (x is None) == (y is None), f"{name}.{part}"
            if x is not None:
                assert x.dtype == y.dtype, f"{name}.{part}"
                np.testing.assert_array_equal(x, y, err_msg=f"{name}.{part}")
    files = sorted(p.relative_to(want) for p in want.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(got) for p in got.rglob("*") if p.is_file())
    for f in files:
        assert (got / f).read_bytes() == (want / f).read_bytes(), f


def _gated(monkeypatch: pytest.MonkeyPatch, gate: threading.Event) -> list[str]:
    """Hold every shard write of the background path until ``gate`` is set; the tables whose
    writes began, in order."""
    started: list[str] = []
    write: Writer = dump_module._write_shard

    def held(folder: Path, meta: ShardMeta, chunks: Iterator[ShardData]) -> None:
        started.append(meta.table)
        assert gate.wait(timeout=60), "the test never released the writer"
        write(folder, meta, chunks)

    monkeypatch.setattr(dump_module, "_write_shard", held)
    return started


def _until_done(handle: DumpHandle) -> None:
    deadline = time.monotonic() + 60
    while not handle.done():
        assert time.monotonic() < deadline, "the background write never ended"
        time.sleep(0.01)


@pytest.mark.parametrize(
    ("device", "optim", "names"),
    [
        ("cpu", True, None),
        ("cpu", False, None),
        ("cpu", True, ["item"]),
        pytest.param("cuda", True, None, marks=pytest.mark.cuda),
    ],
)
def test_the_checkpoint_is_the_state_at_the_call_while_training_goes_on(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    device: str,
    optim: bool,
    names: list[str] | None,
) -> None:
    monkeypatch.setattr(dump_module, "_CHUNK_SLOTS", 64)  # several chunks per table
    model = Model(device)
    _train(model, steps=1, seed=1)
    p0, p1 = tmp_path / "blocking", tmp_path / "background"
    assert DynamicEmbDump(p0, model, names, optim=optim) is None  # the reference
    before = _live(model)
    user_slots = model.sparse["tables"].tables.capacity(0)

    gate = threading.Event()
    started = _gated(monkeypatch, gate)
    handle = DynamicEmbDump(p1, model, names, optim=optim, blocking=False)
    assert isinstance(handle, DumpHandle)
    _train(model, steps=6, seed=2)  # while the writer waits: inserts, evictions, growth
    assert not handle.done()
    assert started == ["user" if names is None else "item"]
    gate.set()
    _until_done(handle)
    assert not p1.exists()  # written, not committed: that is wait()'s
    handle.wait()
    assert handle.done()
    handle.wait()  # a second wait returns at once

    after = _live(model)
    for name in TABLES if names is None else names:  # the model did change meanwhile
        assert before[name].keys() - after[name].keys(), f"{name}: nothing evicted"
        common = before[name].keys() & after[name].keys()
        assert any(before[name][k] != after[name][k] for k in common), f"{name}: no update"
    if names is None:
        assert model.sparse["tables"].tables.capacity(0) > user_slots  # grown meanwhile
    assert_same_checkpoint(p1, p0)
    loaded = Model()
    DynamicEmbLoad(p1, loaded, names, optim=optim)
    for name in TABLES if names is None else names:
        assert _live(loaded)[name].keys() == before[name].keys()


def test_an_error_in_the_background_surfaces_from_wait_and_keeps_the_old_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = Model()
    _train(model, steps=2, seed=1)
    path = tmp_path / "c"
    DynamicEmbDump(path, model, optim=True)
    old = _read(path)

    def broken(folder: Path, meta: ShardMeta, chunks: Iterator[ShardData]) -> None:
        raise OSError(f"disk full writing {meta.table}")

    monkeypatch.setattr(dump_module, "_write_shard", broken)
    _train(model, steps=2, seed=2)
    handle = DynamicEmbDump(path, model, optim=True, blocking=False)
    with pytest.raises(CheckpointError, match=r"DynamicEmbDump to .*OSError: disk full") as first:
        handle.wait()
    assert handle.done()
    with pytest.raises(CheckpointError) as again:  # the same error, again
        handle.wait()
    assert again.value is first.value
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no staging left behind
    still = _read(path)  # the previous checkpoint, whole
    for name in TABLES:
        np.testing.assert_array_equal(still[name].keys, old[name].keys)
        np.testing.assert_array_equal(still[name].values, old[name].values)

    fresh = tmp_path / "fresh"  # a failed first dump creates nothing
    with pytest.raises(CheckpointError, match="disk full"):
        DynamicEmbDump(fresh, model, blocking=False).wait()
    assert not fresh.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_handle_never_waited_on_commits_nothing(tmp_path: Path) -> None:
    model = Model()
    _train(model, steps=1, seed=1)
    handle = DynamicEmbDump(tmp_path / "c", model, blocking=False)
    _until_done(handle)
    with pytest.warns(ResourceWarning, match="never waited on"):
        del handle  # the last reference (the ended thread holds none)
    assert not (tmp_path / "c").exists()


def test_dump_handle_runs_the_work_in_a_thread_and_finish_in_wait() -> None:
    gate = threading.Event()
    calls: list[object] = []

    def work() -> None:
        calls.append(threading.current_thread() is not threading.main_thread())
        assert gate.wait(timeout=60)
        raise ValueError("from the thread")

    def finish(error: BaseException | None) -> None:
        calls.append(threading.current_thread() is threading.main_thread())
        calls.append(repr(error))

    handle = DumpHandle(work, finish)
    assert not handle.done()
    gate.set()
    handle.wait()  # finish did not raise: neither does wait
    handle.wait()
    assert handle.done()
    assert calls == [True, True, "ValueError('from the thread')"]


def _check_ranks(run_ranks: Callable[..., list[dict]], tmp_path: Path, device: str) -> None:
    results = run_ranks(RANK_SCRIPT, 2, str(tmp_path / "ckpt"), device)
    assert_same_checkpoint(tmp_path / "ckpt" / "background", tmp_path / "ckpt" / "blocking")
    dumped = _read(tmp_path / "ckpt" / "blocking")
    assert {n: len(d.keys) > 100 for n, d in dumped.items()} == {"ua": True, "ia": True}
    for rank, result in enumerate(results):
        assert result["held_while_training"], f"rank {rank}: the writer ran before training"
        assert result["changed"], f"rank {rank}: training changed nothing during the dump"
        assert "rank 1 disk full" in result["failed"], f"rank {rank}: {result['failed']!r}"
    assert not (tmp_path / "ckpt" / "failed").exists()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["background", "blocking"]


@pytest.mark.multiproc
@pytest.mark.slow
def test_two_gloo_ranks_dump_in_the_background_while_training(run_ranks, tmp_path) -> None:
    _check_ranks(run_ranks, tmp_path, "cpu")


@pytest.mark.cuda
@pytest.mark.multiproc
def test_two_gpus_dump_in_the_background_while_training(run_ranks, tmp_path) -> None:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip(f"needs 2 GPUs, {gpus} visible")
    _check_ranks(run_ranks, tmp_path, "cuda")


def test_later_dumps_copy_into_the_memory_of_earlier_ones(tmp_path: Path) -> None:
    """On the CPU a finished dump's copy serves the next one: each dump still equals a
    blocking dump taken at its call (the reused memory held the previous state), and
    ``release_snapshot_memory`` frees it."""
    model = Model()
    _train(model, 30, seed=1)  # the user table has grown: its shape stays from now on
    release_snapshot_memory()
    before: list[int] = []
    for i in range(3):
        DynamicEmbDump(tmp_path / f"want{i}", model, optim=True)
        handle = DynamicEmbDump(tmp_path / f"got{i}", model, optim=True, blocking=False)
        _train(model, 4, seed=10 + i)  # changes the tables while (maybe) still writing
        handle.wait()
        assert_same_checkpoint(tmp_path / f"got{i}", tmp_path / f"want{i}")
        kept = sorted(t.data_ptr() for ts in _POOL._free.values() for t in ts)
        assert len(kept) == 6  # one dump's copies only: index keys, digests, scores, sizes, rows x2
        if i > 0:  # the copies went into the previous dump's memory
            assert kept == before
        before = kept
    assert release_snapshot_memory() > 0
    assert release_snapshot_memory() == 0
