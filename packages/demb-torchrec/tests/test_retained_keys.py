"""evicted_item_mode=RETAIN_KEY and pop_evicted_keys, erase_keys and pop_erased_keys: every key
evicted in a window is popped exactly once (the reference: the keys a training step's table
held before it and not after it), incremental dumps drain the same buffers, DISCARD records
nothing, and each erase call decides whether it is recorded."""

from __future__ import annotations

import pytest
import torch
from _online_common import DEVICES, NAMES, Model, present, random_step
from demb_torchrec import (
    DynamicEmbeddingTables,
    DynamicEmbTableOptions,
    EvictedItemMode,
    erase_keys,
    get_score,
    incremental_dump,
    pop_erased_keys,
    pop_evicted_keys,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn


def _evicting_step(model: Model, gen: torch.Generator, evicted: list[set[int]]) -> None:
    """A random step; adds to ``evicted[t]`` the keys table ``t`` lost in it."""
    before = [present(model, t) for t in range(2)]
    random_step(model, gen, key_range=2000, n=20)
    for t in range(2):
        evicted[t] |= before[t] - present(model, t)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=5, deadline=None)
@given(windows=st.lists(st.integers(1, 5), min_size=1, max_size=4), seed=st.integers(0, 2**16))
def test_every_evicted_key_is_popped_exactly_once(device, windows, seed):
    model = Model(retain=True, capacity=64, device=device)
    gen = torch.Generator().manual_seed(seed)
    for steps in windows:
        evicted: list[set[int]] = [set(), set()]
        for _ in range(steps):
            _evicting_step(model, gen, evicted)
        popped = pop_evicted_keys(model)
        assert set(popped) == {"sparse"}
        for t, name in enumerate(NAMES):
            keys = popped["sparse"][name]
            assert keys.dtype == torch.int64
            assert keys.tolist() == sorted(evicted[t])  # distinct, ascending, all of them
        again = pop_evicted_keys(model)["sparse"]
        assert all(again[name].numel() == 0 for name in NAMES)


def test_incremental_dumps_drain_the_evicted_keys():
    model = Model(retain=True, capacity=64)
    gen = torch.Generator().manual_seed(4)
    threshold = get_score(model)
    evicted: list[set[int]] = [set(), set()]
    for _ in range(4):
        _evicting_step(model, gen, evicted)
    result = incremental_dump(model, threshold)["sparse"]
    assert all(evicted)
    for t in range(2):
        assert result.evicted_keys[t].tolist() == sorted(evicted[t])
    assert all(k.numel() == 0 for k in pop_evicted_keys(model)["sparse"].values())


def test_discard_records_nothing():
    model = Model(capacity=64)
    gen = torch.Generator().manual_seed(5)
    evicted: list[set[int]] = [set(), set()]
    for _ in range(4):
        _evicting_step(model, gen, evicted)
    assert all(evicted)  # keys were evicted
    assert pop_evicted_keys(model) == {}
    assert len(model.sparse.tables.evicted_keys) == 0
    assert model.sparse.tables._retains is None  # the inserts' hook returns at once
    threshold = get_score(model)
    result = incremental_dump(model, threshold)["sparse"]
    assert result.evicted_keys == [None, None]


def test_only_retaining_tables_are_popped_and_table_names_filter():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            opts = [
                DynamicEmbTableOptions(
                    dim=4, max_capacity=32, bucket_capacity=16, evicted_item_mode=mode
                )
                for mode in (EvictedItemMode.RETAIN_KEY, EvictedItemMode.DISCARD)
            ]
            self.sparse = DynamicEmbeddingTables(opts, table_names=list(NAMES))

    model = Two()
    keys = torch.arange(200, dtype=torch.int64)
    for batch in (keys, keys + 1000):  # the second batch evicts the first's keys
        model.sparse(torch.cat([batch, batch]), torch.tensor([0, 200, 400]))
    popped = pop_evicted_keys(model)
    assert list(popped["sparse"]) == ["user"]
    assert popped["sparse"]["user"].numel() > 0
    model.sparse(torch.cat([keys, keys]), torch.tensor([0, 200, 400]))
    assert pop_evicted_keys(model, {"sparse": ["item"]}) == {}
    assert pop_evicted_keys(model, {"sparse": ["user"]})["sparse"]["user"].numel() > 0
    with pytest.raises(ValueError, match="nope"):
        pop_evicted_keys(model, {"sparse": ["nope"]})


def test_erase_records_per_call():
    model = Model(capacity=1024)
    random_step(model, torch.Generator().manual_seed(6), key_range=100, n=30)
    held = sorted(present(model, 0))
    first, second = held[:3], held[3:6]
    removed = erase_keys(model, {"sparse": {"user": torch.tensor([*first, 10**9])}})
    assert removed == {"sparse": {"user": 3}}  # the absent key removes nothing
    erase_keys(model, {"sparse": {"user": torch.tensor(second)}}, EvictedItemMode.DISCARD)
    assert not present(model, 0) & set(first + second)
    popped = pop_erased_keys(model)
    assert popped["sparse"]["user"].tolist() == first  # the DISCARD call recorded nothing
    assert popped["sparse"]["item"].numel() == 0  # every table, recorded or not
    assert pop_erased_keys(model)["sparse"]["user"].numel() == 0
    with pytest.raises(TypeError):
        erase_keys(model, {"sparse": {"user": torch.tensor([1.0])}})
    with pytest.raises(ValueError, match="nope"):
        erase_keys(model, {"sparse": {"nope": torch.tensor([1])}})


def test_erased_keys_reach_the_next_incremental_dump_once():
    model = Model(capacity=1024)
    random_step(model, torch.Generator().manual_seed(7), key_range=100, n=30)
    threshold = get_score(model)
    held = sorted(present(model, 1))[:4]
    erase_keys(model, {"sparse": {"item": torch.tensor(held)}})
    result = incremental_dump(model, threshold)["sparse"]
    assert result.erased_keys[1].tolist() == held
    assert result.meta[1]["erased_slot_index"].shape == (4,)
    assert incremental_dump(model, threshold)["sparse"].erased_keys[1].numel() == 0
