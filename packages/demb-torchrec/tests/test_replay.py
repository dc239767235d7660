"""replay_increment on unplanned modules: a model B that replays each window's delta of a
training model A equals A bit for bit after every window (keys at their slots, digests, scores,
sizes, rows with optimizer state), with evictions and erases; the ReplayContent choices; every
mismatching layout or malformed delta raises ValueError naming the field before anything is
written (checksums before and after)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _online_common import (
    DEVICES,
    NAMES,
    Model,
    S,
    assert_same_tables,
    checksum,
    next_threshold,
    random_step,
    table_state,
)
from demb_torchrec import (
    ReplayContent,
    erase_keys,
    get_score,
    incremental_dump,
    replay_increment,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def _windows(a: Model, b: Model, windows: int, seed: int, erase_at: int = -1) -> None:
    gen = torch.Generator().manual_seed(seed)
    threshold = get_score(a)
    for w in range(windows):
        for _ in range(4):
            random_step(a, gen)
        if w == erase_at:  # keys held, some of which evicted others in this window
            held = a.sparse.tables.export(0).keys
            erase_keys(a, {"sparse": {"user": held[::3]}})
        deltas = incremental_dump(a, threshold)
        stats = replay_increment(b, deltas)["sparse"]
        result = deltas["sparse"]
        for i, name in enumerate(result.table_names):
            assert stats[name].upserted == result.keys[i].numel()
            assert stats[name].skipped == 0
        assert_same_tables(a, b)
        threshold = next_threshold(deltas)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=3, deadline=None)
@given(
    strategy=st.sampled_from([S.TIMESTAMP, S.STEP, (S.TIMESTAMP, S.LFU)]),
    retain=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_replica_equals_its_source_after_every_window(device, strategy, retain, seed):
    a = Model(score=strategy, retain=retain, device=device)
    b = Model(score=strategy, retain=retain, device=device)
    _windows(a, b, windows=5, seed=seed, erase_at=2)


def test_an_erase_after_an_eviction_leaves_no_evicted_key_in_the_replica():
    # key 0 and key 16 share the home bucket of a 16-slot table; 16 evicts 0, then is erased
    a, b = Model(capacity=16), Model(capacity=16)
    threshold = get_score(a)
    bucket = [k for k in range(5000) if _home(a, k) == 0][:17]
    from _online_common import step

    step(a, torch.tensor(bucket[:16]), torch.tensor([1]))
    replay_increment(b, incremental_dump(a, threshold))
    threshold = get_score(a)
    step(a, torch.tensor(bucket[16:]), torch.tensor([1]))  # evicts one of the 16
    erase_keys(a, {"sparse": {"user": torch.tensor(bucket[16:])}})
    deltas = incremental_dump(a, threshold)
    stats = replay_increment(b, deltas)["sparse"]["user"]
    assert stats.erased == 1  # the slot held the evicted key: cleared
    assert_same_tables(a, b)
    assert a.sparse.tables.size(0) == 15


def _home(model: Model, key: int) -> int:
    from demb_planner import home_slots

    return int(home_slots([key], model.sparse.tables.capacity(0), 16).bucket[0])


def test_content_without_scores_or_state():
    gen = torch.Generator().manual_seed(5)
    a = Model(score=S.STEP)
    threshold = get_score(a)
    for _ in range(3):
        random_step(a, gen, key_range=200)
    deltas = incremental_dump(a, threshold)
    b = Model(score=S.STEP)
    replay_increment(b, deltas, ReplayContent.EMBEDDING_ONLY)
    sa, sb = table_state(a), table_state(b)
    for t, (name, dim) in enumerate(zip(NAMES, (8, 4), strict=True)):
        assert torch.equal(sa[name][0], sb[name][0])  # the same keys at the same slots
        rows_a, rows_b = sa[name][4], sb[name][4]
        assert torch.equal(rows_a[:, :dim], rows_b[:, :dim])
        initial = b.sparse.initial_states[t]
        assert torch.equal(rows_b[:, dim:], initial.expand(rows_b.shape[0], -1))
        occupied = sb[name][0] != -1
        assert (sb[name][2][0, occupied] == 1).all()  # scored as just inserted: step 1
    c = Model(score=S.STEP)
    replay_increment(c, deltas, ReplayContent.SCORE)
    for name in NAMES:
        assert torch.equal(table_state(a)[name][2], table_state(c)[name][2])
    d = Model(score=S.STEP)
    replay_increment(d, deltas, ReplayContent.OPTIMIZER_STATE)
    for name in NAMES:
        assert torch.equal(table_state(a)[name][4], table_state(d)[name][4])


def test_a_key_keeps_its_state_when_it_already_holds_the_row():
    gen = torch.Generator().manual_seed(6)
    a, b = Model(), Model()
    threshold = get_score(a)
    random_step(a, gen, key_range=100)
    replay_increment(b, incremental_dump(a, threshold))
    threshold = get_score(a)
    random_step(a, gen, key_range=100)
    before = table_state(b)
    replay_increment(b, incremental_dump(a, threshold), ReplayContent.SCORE)
    after = table_state(b)
    for name, dim in zip(NAMES, (8, 4), strict=True):
        # the keys held before keep their (stale) state rows; new rows would be initial
        held_before = before[name][0] != -1
        held = held_before & (after[name][0] == before[name][0])
        rows_before = b_rows(before[name], held)
        rows_after = b_rows(after[name], held)
        assert torch.equal(rows_before[:, dim:], rows_after[:, dim:])


def b_rows(state: tuple, mask: torch.Tensor) -> torch.Tensor:
    """The rows (of a table_state entry) of the slots in ``mask``."""
    occupied = state[0] != -1
    position = torch.cumsum(occupied.to(torch.int64), 0) - 1
    return state[4][position[mask & occupied]]


def _delta(seed: int = 7, **model: object) -> dict:
    gen = torch.Generator().manual_seed(seed)
    a = Model(**model)  # type: ignore[arg-type]
    threshold = get_score(a)
    for _ in range(3):
        random_step(a, gen)
    erase_keys(a, {"sparse": {"user": a.sparse.tables.export(0).keys[:2]}})
    return incremental_dump(a, threshold)


MISMATCHES = {
    "current_capacity": ({"capacity": 256}, "current_capacity"),
    "dim": ({"dims": (8, 8)}, "table_options.dim"),
    "bucket_capacity": ({"bucket": 32}, "bucket_capacity"),
    "score layout": ({"score": (S.TIMESTAMP, S.LFU)}, "num_scores"),
    "score order": ({"score": S.STEP}, "score_strategy"),
    "dist_type": ({"dist_type": "hash_roundrobin"}, "table_options.dist_type"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_delta_of_another_layout_raises_naming_the_field_and_writes_nothing(case):
    target_options, field = MISMATCHES[case]
    deltas = _delta()
    target = Model(**target_options)  # type: ignore[arg-type]
    random_step(target, torch.Generator().manual_seed(1))
    before = checksum(target)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        replay_increment(target, deltas)
    assert checksum(target) == before


def _broken(field: str) -> dict:
    deltas = _delta()
    r = deltas["sparse"]
    meta = [dict(m) for m in r.meta]
    second = 1  # the second table is the broken one: the first must stay unwritten too
    n = r.keys[second].numel()
    if field == "world_size":
        meta[second]["world_size"] = 2
    elif field == "slot_index":
        meta[second]["slot_index"] = meta[second]["slot_index"][: n - 1]
    elif field == "slot_index home bucket":
        slots = meta[second]["slot_index"].clone()
        slots[0] = (slots[0] + 16) % 128  # another bucket
        meta[second]["slot_index"] = slots
    elif field == "values":
        r = dataclasses.replace(r, values=[r.values[0], r.values[1][:, :3]])
    elif field == "scores":
        r = dataclasses.replace(r, scores=[r.scores[0], r.scores[1].to(torch.int32)])
    elif field == "optimizer_states":
        r = dataclasses.replace(r, optimizer_states=[r.optimizer_states[0], None])
    elif field == "current_score":
        meta[second]["current_score"] = -5
    return {"sparse": dataclasses.replace(r, meta=meta)}


@pytest.mark.parametrize(
    "field",
    [
        "world_size",
        "slot_index",
        "slot_index home bucket",
        "values",
        "scores",
        "optimizer_states",
        "current_score",
    ],
)
def test_a_malformed_delta_raises_naming_the_field_and_writes_nothing(field):
    deltas = _broken(field)
    target = Model()
    random_step(target, torch.Generator().manual_seed(2))
    before = checksum(target)
    with pytest.raises(ValueError, match=field.split()[0]):
        replay_increment(target, deltas)
    assert checksum(target) == before


def test_unknown_tables_are_skipped_with_a_warning():
    deltas = _delta()
    renamed = dataclasses.replace(deltas["sparse"], table_names=["user", "other"])
    b = Model()
    with pytest.warns(UserWarning, match="sparse/other"):
        stats = replay_increment(b, {"sparse": renamed, "elsewhere": deltas["sparse"]})
    assert set(stats) == {"sparse"}
    assert set(stats["sparse"]) == {"user"}
