"""get_score / set_score / incremental_dump on an unplanned module: a dump thresholded on
get_score's value holds exactly the keys touched since (and still held), checked against a
Python record of the keys each window looked up, over random streams; rows, state, scores and
slots are the table's; the spec's per-strategy meanings and errors."""

from __future__ import annotations

import warnings

import pytest
import torch
from _online_common import DEVICES, NAMES, Model, S, next_threshold, present, step
from demb_torchrec import (
    NotSupportedError,
    get_score,
    incremental_dump,
    set_score,
)
from hypothesis import given, settings
from hypothesis import strategies as st

STRATEGIES = {
    "timestamp": S.TIMESTAMP,
    "step": S.STEP,
    "timestamp_lfu": (S.TIMESTAMP, S.LFU),
}


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=10, deadline=None)
@given(
    strategy=st.sampled_from(sorted(STRATEGIES)),
    windows=st.lists(
        st.lists(st.integers(1, 6), min_size=1, max_size=4),  # batch sizes of a window's steps
        min_size=1,
        max_size=4,
    ),
    key_range=st.sampled_from([40, 400, 4000]),
    seed=st.integers(0, 2**16),
)
def test_the_dumped_keys_are_the_keys_touched_in_the_window(
    device, strategy, windows, key_range, seed
):
    model = Model(score=STRATEGIES[strategy], device=device)
    gen = torch.Generator().manual_seed(seed)
    threshold = get_score(model)
    for sizes in windows:
        touched: list[set[int]] = [set(), set()]
        for n in sizes:
            user = torch.randint(0, key_range, (n,), generator=gen)
            item = torch.randint(0, key_range, (n,), generator=gen)
            step(model, user, item)
            touched[0] |= set(user.tolist())
            touched[1] |= set(item.tolist())
        deltas = incremental_dump(model, threshold)
        result = deltas["sparse"]
        assert result.table_names == list(NAMES)
        for t in range(2):
            # keys touched and evicted again within the window are gone from the table
            expected = touched[t] & present(model, t)
            assert set(result.keys[t].tolist()) == expected
            assert result.keys[t].numel() == len(expected)
        threshold = next_threshold(deltas)


def test_rows_state_scores_and_slots_are_the_tables():
    model = Model(score=(S.LFU, S.TIMESTAMP))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        step(model, torch.randint(0, 50, (8,), generator=gen), torch.randint(0, 50, (8,)))
    threshold = get_score(model)
    step(model, torch.tensor([3, 5, 7]), torch.tensor([11]))
    result = incremental_dump(model, threshold)["sparse"]
    current = result.meta[0]["current_score"]
    tables = model.sparse.tables
    for t, dim in enumerate((8, 4)):
        ex = tables.export(t)
        at = {int(s): i for i, s in enumerate(ex.slots.tolist())}
        slots = result.meta[t]["slot_index"]
        assert slots.dtype == torch.int64
        assert slots.shape == result.keys[t].shape
        for j, slot in enumerate(slots.tolist()):
            i = at[slot]
            assert int(ex.keys[i]) == int(result.keys[t][j])
            assert torch.equal(result.values[t][j], ex.values[i, :dim])
            assert torch.equal(result.optimizer_states[t][j], ex.values[i, dim:])
            freq, stamp = ex.scores[i].tolist()  # the (LFU, TIMESTAMP) column order
            assert result.scores[t][j].tolist() == [freq, current - stamp]
        meta = result.meta[t]
        assert (meta["current_capacity"], meta["row_capacity"]) == (128, (128,))
        assert (meta["bucket_capacity"], meta["num_scores"]) == (16, 2)
        assert (meta["world_size"], meta["table_options"].dim) == (1, dim)
        assert meta["score_strategy"] == ("LFU", "TIMESTAMP")
    assert set(result.keys[0].tolist()) == {3, 5, 7}
    assert set(result.keys[1].tolist()) == {11}


def test_get_score_per_strategy():
    model = Model(score=S.STEP)
    assert get_score(model) == {"sparse": {"user": 1, "item": 1}}
    step(model, torch.tensor([1]), torch.tensor([2]))
    step(model, torch.tensor([1]), torch.tensor([2]))
    assert get_score(model) == {"sparse": {"user": 3, "item": 3}}  # the next forward's step
    timed = Model(score=S.TIMESTAMP)
    first = get_score(timed)["sparse"]["user"]
    step(timed, torch.tensor([1]), torch.tensor([2]))
    stamp = int(timed.sparse.tables.export(0).scores[0, 0])
    later = get_score(timed)["sparse"]["user"]
    assert first <= stamp < later  # the forward's score lies between the two readings
    assert get_score(torch.nn.Linear(2, 2)) is None


def test_set_score_registers_custom_scores_and_warns_when_they_decrease(monkeypatch):
    model = Model(score=S.CUSTOMIZED)
    set_score(model, 10)
    assert get_score(model) == {"sparse": {"user": 10, "item": 10}}
    step(model, torch.tensor([4]), torch.tensor([5]))
    assert model.sparse.tables.export(0).scores.tolist() == [[10]]
    set_score(model, {"sparse": {"item": 20}})
    assert get_score(model) == {"sparse": {"user": 10, "item": 20}}
    with pytest.warns(UserWarning, match="lower than the previous"):
        set_score(model, {"sparse": {"user": 3}})
    monkeypatch.setenv("DYNAMICEMB_CSTM_SCORE_CHECK", "0")  # read when a table is built
    quiet = Model(score=S.CUSTOMIZED)
    set_score(quiet, 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_score(quiet, 3)


def test_set_score_refuses_what_it_cannot_set():
    model = Model(score=S.TIMESTAMP)
    with pytest.raises(ValueError, match="no CUSTOMIZED table"):
        set_score(model, 5)
    with pytest.raises(ValueError, match="only CUSTOMIZED"):
        set_score(model, {"sparse": {"user": 5}})
    custom = Model(score=S.CUSTOMIZED)
    with pytest.raises(ValueError, match="no dynamic table sparse/nope"):
        set_score(custom, {"sparse": {"nope": 5}})
    with pytest.raises(TypeError):
        set_score(custom, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside"):
        set_score(custom, -1)
    assert get_score(custom) == {"sparse": {"user": 0, "item": 0}}  # nothing was set


def test_a_threshold_dict_dumps_only_the_tables_it_names():
    model = Model()
    threshold = get_score(model)["sparse"]["item"]
    step(model, torch.tensor([1, 2]), torch.tensor([3]))
    result = incremental_dump(model, {"sparse": {"item": threshold}})["sparse"]
    assert result.table_names == ["item"]
    assert result.keys[0].tolist() == [3]
    with pytest.raises(ValueError, match="no dynamic table sparse/nope"):
        incremental_dump(model, {"sparse": {"nope": 0}})


def test_continuous_sharding_is_not_supported():
    model = Model(dist_type="continuous")
    with pytest.raises(NotSupportedError, match="continuous"):
        incremental_dump(model, 0)
    assert isinstance(NotSupportedError("x", "y"), NotImplementedError)


def test_lfu_and_step_thresholds_are_absolute():
    model = Model(score=S.LFU)
    assert get_score(model) == {"sparse": {"user": 0, "item": 0}}  # no batch score: all keys
    step(model, torch.tensor([1, 1, 1, 2]), torch.tensor([3]))
    step(model, torch.tensor([1]), torch.tensor([3]))
    result = incremental_dump(model, 3)["sparse"]
    assert result.keys[0].tolist() == [1]  # count 4 >= 3; key 2 counts 1
    assert result.keys[1].numel() == 0  # key 3 counts 2
    assert set(incremental_dump(model, 0)["sparse"].keys[0].tolist()) == {1, 2}
