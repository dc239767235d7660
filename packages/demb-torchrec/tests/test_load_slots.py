"""DynamicEmbLoad into an empty table of the checkpoint's layout puts every key back at the slot
it was dumped from: the loaded table equals the dumped one slot for slot, so a replica that
starts from a checkpoint and then replays the deltas taken after it equals its source bit for
bit (with keys merely inserted, a replayed key could land on a slot the replica had given to
another key, and that key would be lost). Other loads (another capacity, a table that holds
keys) insert as before, and a checkpoint's slots that do not fit the table are a FormatError."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _online_common import DEVICES, Model, S, assert_same_tables, present, random_step
from demb_io import Checkpoint, CheckpointWriter, FormatError, ShardData, ShardMeta, read_shard
from demb_torchrec import (
    DynamicEmbDump,
    DynamicEmbLoad,
    get_score,
    incremental_dump,
    replay_increment,
)


def _slots(model: Model, t: int) -> dict[int, int]:
    ex = model.sparse.tables.export(t)
    return dict(zip(ex.keys.tolist(), ex.slots.tolist(), strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("blocking", [True, False])
def test_a_replica_from_a_checkpoint_then_deltas_equals_its_source(
    device: str, blocking: bool, tmp_path: Path
) -> None:
    source = Model(score=S.STEP, capacity=128, bucket=16, device=device)
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):  # the tables fill and evict: keys sit anywhere in their buckets
        random_step(source, gen, key_range=2000, n=16)
    handle = DynamicEmbDump(tmp_path / "ckpt", source, optim=True, blocking=blocking)
    if handle is not None:
        handle.wait()
    threshold = get_score(source)
    replica = Model(score=S.STEP, capacity=128, bucket=16, device=device)
    DynamicEmbLoad(tmp_path / "ckpt", replica, optim=True)
    replica.sparse.tables.steps = list(source.sparse.tables.steps)
    assert_same_tables(source, replica)  # slot for slot
    for _ in range(4):
        for _ in range(5):
            random_step(source, gen, key_range=2000, n=16)
        deltas = incremental_dump(source, threshold)
        threshold = get_score(source)
        replay_increment(replica, deltas)
        assert_same_tables(source, replica)


def _rewrite(src: Path, dst: Path, edit: Callable[[ShardMeta, ShardData], tuple]) -> None:
    """A copy of checkpoint ``src`` whose every shard went through ``edit``."""
    ckpt = Checkpoint(src)
    with CheckpointWriter(dst) as w:
        for collection in ckpt.collections():
            for meta in ckpt.shards(collection):
                data = read_shard(src / collection, meta)
                new_meta, new_data = edit(meta, data)
                w.write_shard(dataclasses.replace(new_meta, files={}), [new_data])


def test_without_slots_a_replayed_delta_can_drop_a_key_the_source_holds(tmp_path: Path) -> None:
    """Why the slots matter: the same checkpoint without its slots part loads (keys inserted)
    at other slots than the source's, and the deltas after it then lose keys in the replica."""
    source = Model(score=S.STEP, capacity=128, bucket=16)
    gen = torch.Generator().manual_seed(5)
    for _ in range(30):
        random_step(source, gen, key_range=2000, n=16)
    DynamicEmbDump(tmp_path / "ckpt", source, optim=True)
    threshold = get_score(source)
    _rewrite(
        tmp_path / "ckpt",
        tmp_path / "bare",
        lambda m, d: (
            dataclasses.replace(m, slot_layout=None),
            dataclasses.replace(d, slots=None),
        ),
    )
    placed, inserted = (Model(score=S.STEP, capacity=128, bucket=16) for _ in range(2))
    DynamicEmbLoad(tmp_path / "ckpt", placed, optim=True)
    DynamicEmbLoad(tmp_path / "bare", inserted, optim=True)
    assert present(inserted, 0) == present(source, 0)  # the same keys either way ...
    assert _slots(placed, 0) == _slots(source, 0)  # ... at the source's slots only when placed
    assert _slots(inserted, 0) != _slots(source, 0)
    for _ in range(10):
        random_step(source, gen, key_range=2000, n=16)
    deltas = incremental_dump(source, threshold)
    replay_increment(placed, deltas)
    replay_increment(inserted, deltas)
    assert present(placed, 0) == present(source, 0)
    # the replica lost keys the source holds (and kept keys the source evicted)
    assert present(source, 0) - present(inserted, 0)


def test_other_layouts_and_non_empty_tables_insert(tmp_path: Path) -> None:
    source = Model(score=S.STEP, capacity=128, bucket=16)
    gen = torch.Generator().manual_seed(1)
    for _ in range(10):
        random_step(source, gen, key_range=2000, n=8)
    DynamicEmbDump(tmp_path / "ckpt", source, optim=True)
    bigger = Model(score=S.STEP, capacity=256, bucket=16)
    DynamicEmbLoad(tmp_path / "ckpt", bigger, optim=True)
    held = Model(score=S.STEP, capacity=128, bucket=16)
    random_step(held, torch.Generator().manual_seed(99), key_range=2000, n=4)
    before = present(held, 0)
    DynamicEmbLoad(tmp_path / "ckpt", held, optim=True)
    for t in range(2):
        assert present(bigger, t) == present(source, t)
    assert present(held, 0) == present(source, 0) | before


def test_slots_outside_their_keys_buckets_are_a_format_error(tmp_path: Path) -> None:
    source = Model(score=S.STEP, capacity=128, bucket=16)
    gen = torch.Generator().manual_seed(2)
    for _ in range(6):
        random_step(source, gen, key_range=2000, n=8)
    DynamicEmbDump(tmp_path / "ckpt", source, optim=True)
    path = tmp_path / "moved"
    _rewrite(  # every key one bucket over
        tmp_path / "ckpt",
        path,
        lambda m, d: (m, dataclasses.replace(d, slots=(d.slots + 16) % 128)),
    )
    replica = Model(score=S.STEP, capacity=128, bucket=16)
    with pytest.raises(FormatError, match="slots"):
        DynamicEmbLoad(path, replica, optim=True)
    assert all(len(present(replica, t)) == 0 for t in range(2))  # all or nothing
