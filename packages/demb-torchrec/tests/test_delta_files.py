"""Deltas on disk: what incremental_dump produced, written in demb-io's delta format (blocking
or not), merged offline with ``demb-io merge`` and applied with ``demb-io apply`` onto the last
full checkpoint, equals a full DynamicEmbDump of the source taken at the same moment (every
table's keys, rows, optimizer state and scores); loading it gives the source's content; read
back and replayed, it gives the source's tables bit for bit; a truncated or bit-flipped delta
file is demb-io's typed error and nothing is replayed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _online_common import (
    NAMES,
    Model,
    S,
    assert_same_tables,
    checkpoint_content,
    checksum,
    next_threshold,
    random_step,
)
from demb_io import FormatError, read_delta
from demb_io.cli import main as demb_io
from demb_torchrec import (
    DynamicEmbDump,
    DynamicEmbLoad,
    erase_keys,
    get_score,
    incremental_dump,
    replay_increment,
)
from demb_torchrec.delta_files import read_delta_dump, write_delta_dump

COLLECTION = "sparse"


@pytest.mark.parametrize(
    ("strategy", "retain", "capacity", "device"),
    [
        (S.TIMESTAMP, True, 128, "cpu"),  # evicting, evictions retained
        ((S.TIMESTAMP, S.LFU), False, 4096, "cpu"),  # no eviction: nothing to retain
        pytest.param(S.STEP, True, 128, "cpu", marks=pytest.mark.slow),
        pytest.param(S.TIMESTAMP, True, 128, "cuda", marks=pytest.mark.cuda),
    ],
)
def test_merged_deltas_applied_to_the_checkpoint_equal_a_full_dump(
    tmp_path, strategy, retain, capacity, device
):
    a = Model(score=strategy, retain=retain, capacity=capacity, device=device)
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        random_step(a, gen, key_range=400)
    DynamicEmbDump(tmp_path / "full0", a, optim=True)
    threshold = get_score(a)
    paths = []
    for w in range(4):
        for _ in range(3):
            random_step(a, gen, key_range=400)
        if w == 1:
            erase_keys(a, {COLLECTION: {"item": a.sparse.tables.export(1).keys[:4]}})
        deltas = incremental_dump(a, threshold)
        path = tmp_path / f"delta{w}"
        if w % 2:  # in the background, handed the dump's own host copy
            handle = write_delta_dump(path, deltas, blocking=False)
            handle.wait()
            assert handle.done()
        else:
            write_delta_dump(path, deltas)
        paths.append(str(path))
        threshold = next_threshold(deltas)
    DynamicEmbDump(tmp_path / "full1", a, optim=True)
    assert demb_io(["merge", str(tmp_path / "merged"), *paths]) == 0
    assert demb_io(["verify", str(tmp_path / "merged")]) == 0
    applied = tmp_path / "applied"
    assert demb_io(["apply", str(tmp_path / "full0"), str(tmp_path / "merged"), str(applied)]) == 0
    want = checkpoint_content(tmp_path / "full1", COLLECTION)
    assert all(len(want[n]) > 20 for n in NAMES)
    assert checkpoint_content(applied, COLLECTION) == want
    loaded = Model(score=strategy, retain=retain, capacity=capacity, device=device)
    DynamicEmbLoad(applied, loaded, optim=True)
    DynamicEmbDump(tmp_path / "reloaded", loaded, optim=True)
    assert checkpoint_content(tmp_path / "reloaded", COLLECTION) == want


def test_deltas_read_back_replay_to_the_source_bit_for_bit(tmp_path):
    a, b = Model(retain=True), Model(retain=True)
    gen = torch.Generator().manual_seed(12)
    threshold = get_score(a)
    for w in range(3):
        for _ in range(4):
            random_step(a, gen)
        if w == 1:
            erase_keys(a, {COLLECTION: {"user": a.sparse.tables.export(0).keys[::4]}})
        deltas = incremental_dump(a, threshold)
        write_delta_dump(tmp_path / f"d{w}", deltas)
        back = read_delta_dump(tmp_path / f"d{w}")[COLLECTION]
        ours = deltas[COLLECTION]
        assert sorted(back.table_names) == sorted(ours.table_names)
        for i, name in enumerate(ours.table_names):
            j = back.table_names.index(name)
            for field in ("keys", "values", "optimizer_states", "scores", "erased_keys"):
                assert torch.equal(getattr(back, field)[j], getattr(ours, field)[i]), field
            assert torch.equal(back.evicted_keys[j], ours.evicted_keys[i])
            for field in ("slot_index", "erased_slot_index"):
                assert torch.equal(back.meta[j][field], ours.meta[i][field]), field
        replay_increment(b, {COLLECTION: back})
        assert_same_tables(a, b)
        threshold = next_threshold(deltas)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-8])


@pytest.mark.parametrize("damage", [_flip, _truncate])
@pytest.mark.parametrize("part", ["values", "slots", "keys"])
def test_a_damaged_delta_is_a_typed_error_and_replays_nothing(tmp_path, damage, part):
    a = Model()
    gen = torch.Generator().manual_seed(13)
    threshold = get_score(a)
    for _ in range(3):
        random_step(a, gen)
    write_delta_dump(tmp_path / "d", incremental_dump(a, threshold))
    assert {t.meta.table for t in read_delta(tmp_path / "d")} == set(NAMES)
    damage(tmp_path / "d" / COLLECTION / f"item.{part}")  # the second table read
    b = Model()
    random_step(b, torch.Generator().manual_seed(1))
    before = checksum(b)
    with pytest.raises(FormatError):
        replay_increment(b, read_delta_dump(tmp_path / "d"))
    assert checksum(b) == before


def test_write_refuses_a_malformed_delta_before_writing(tmp_path):
    a = Model()
    threshold = get_score(a)
    random_step(a, torch.Generator().manual_seed(3))
    deltas = incremental_dump(a, threshold)
    deltas[COLLECTION].meta[0]["slot_index"] = deltas[COLLECTION].meta[0]["slot_index"][:-1]
    with pytest.raises(ValueError, match="slots"):
        write_delta_dump(tmp_path / "d", deltas, blocking=False)
    assert not (tmp_path / "d").exists()
