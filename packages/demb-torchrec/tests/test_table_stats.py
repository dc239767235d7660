"""table_stats / count_insert_outcomes: per table, the keys inserted and evicted since the last
read, checked against the reference of what each step changed (the keys a table held before
and after it), on tables that fill up and evict; off by default and costing nothing then."""

from __future__ import annotations

import pytest
import torch
from _online_common import DEVICES, NAMES, Model, present, step
from demb_torchrec import count_insert_outcomes, table_stats


@pytest.mark.parametrize("device", DEVICES)
def test_counts_match_what_each_step_changed(device: str) -> None:
    model = Model(capacity=64, bucket=16, device=device)
    count_insert_outcomes(model)
    gen = torch.Generator().manual_seed(3)
    total_evicted = 0
    for _ in range(12):
        before = [present(model, t) for t in range(2)]
        user = torch.randint(0, 500, (20,), generator=gen)
        item = torch.randint(0, 500, (20,), generator=gen)
        step(model, user, item)
        stats = table_stats(model)["sparse"]
        for t, (name, keys) in enumerate(zip(NAMES, (user, item), strict=True)):
            after = present(model, t)
            new = set(keys.tolist()) - before[t]
            s = stats[name]
            # every key not held before took a slot: free, or an evicted key's
            assert s.inserted + s.evicted == len(new)
            assert s.failed == 0
            assert s.size == len(after)
            assert len(after) - len(before[t]) == s.inserted
            # each eviction removed one key held before that the batch did not look up
            lost = before[t] - after
            assert s.evicted == len(lost)
            assert s.capacity == model.sparse.tables.capacity(t)
            assert s.load_factor == pytest.approx(s.size / s.capacity)
            total_evicted += s.evicted
    assert total_evicted > 0  # the stream overflowed the tables


def test_off_by_default_and_switched_off() -> None:
    model = Model(capacity=64, bucket=16)
    step(model, torch.arange(10), torch.arange(5))
    s = table_stats(model)["sparse"]["user"]
    assert (s.size, s.inserted, s.evicted) == (10, 0, 0)
    assert not model.sparse.tables.outcomes.enabled
    count_insert_outcomes(model)
    step(model, torch.arange(10, 13), torch.arange(5))
    assert table_stats(model)["sparse"]["user"].inserted == 3
    assert table_stats(model)["sparse"]["user"].inserted == 0  # read resets
    step(model, torch.arange(13, 15), torch.arange(5))
    assert table_stats(model, reset=False)["sparse"]["user"].inserted == 2
    assert table_stats(model)["sparse"]["user"].inserted == 2
    count_insert_outcomes(model, enabled=False)
    step(model, torch.arange(15, 20), torch.arange(5))
    assert table_stats(model)["sparse"]["user"].inserted == 0


def test_table_memory_counts_index_rows_and_counter():
    """Per table: its slots' key, digest and score words, its value rows and its share of the
    admission counter; on the CPU all of it host memory."""
    from demb_torchrec import (
        DynamicEmbeddingTables,
        DynamicEmbTableOptions,
        FrequencyAdmissionStrategy,
        KVCounter,
        table_memory,
    )

    strategy = FrequencyAdmissionStrategy(2, KVCounter(1024, bucket_capacity=128))
    m = DynamicEmbeddingTables(
        [
            DynamicEmbTableOptions(dim=8, max_capacity=256, admit_strategy=strategy),
            DynamicEmbTableOptions(dim=4, max_capacity=512),
        ],
        table_names=["a", "b"],
        optimizer="adam",
    )
    memory = (
        table_memory(m)["model"]
        if "model" in table_memory(m)
        else next(iter(table_memory(m).values()))
    )
    index = 8 + 1 + 8  # key, digest, one score word
    counter = 1024 * index + 64  # its slots, and a few words of per-table state
    assert memory["a"].device == memory["b"].device == 0
    assert memory["b"].host == 512 * (index + 4 * (4 + 8))
    table_a = 256 * (index + 4 * (8 + 16))
    assert table_a + 1024 * index <= memory["a"].host <= table_a + counter + 64
