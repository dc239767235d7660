"""Eviction across the two tiers of a caching table, against a Python model of both tiers built
from demb-kernels' pure-Python table model (``TableModel``, independent of the native
kernels): after every step the cache's keys and scores, the storage's keys and scores and the
keys the storage dropped (``RETAIN_KEY``) equal the model's, with hypothesis over the stream,
the policy and the sizes of both tiers."""

from __future__ import annotations

from collections import Counter

import torch
from demb_kernels.table_reference import EVICTED, FAILED, LFU, STEP, TableModel
from demb_torchrec import (
    DynamicEmbeddingTables,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EvictedItemMode,
    pop_evicted_keys,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

DIM = 4
POLICY = {DynamicEmbScoreStrategy.STEP: STEP, DynamicEmbScoreStrategy.LFU: LFU}


class TwoTiers:
    """The tiering algorithm of docs/tiers.md on two ``TableModel`` tables (one logical table,
    key sets and score words only): find in the cache, find the misses in the storage,
    find_or_insert into the cache, move found keys up, write the victims back (present keys
    first, as ``DynamicEmbeddingTable.insert`` orders them), then the overflow keys after the
    step."""

    def __init__(self, policy: int, cache: tuple[int, int], storage: tuple[int, int]) -> None:
        self.policy = policy
        self.cache = TableModel([cache[0]], [cache[1]], [policy], 1)
        self.storage = TableModel([storage[0]], [storage[1]], [policy], 1)
        self.dropped: set[int] = set()

    def _stored(self) -> dict[int, list[int]]:
        keys, scores, _ = self.storage.export(0)
        return dict(zip(keys, scores, strict=True))

    def _insert(self, keys: list[int], words: list[list[int]], alive: set[int]) -> None:
        present = [i for i, k in enumerate(keys) if self.storage.lookup([k], [0])[0] >= 0]
        order = present + [i for i in range(len(keys)) if i not in present]
        ks, ws = [keys[i] for i in order], [words[i] for i in order]
        _, status, victims, _ = self.storage.insert_or_assign(ks, [0] * len(ks), ws)
        for k, s, v in zip(ks, status, victims, strict=True):
            if s == EVICTED and v not in alive:
                self.dropped.add(v)
            if s == FAILED:
                self.dropped.add(k)

    def step(self, keys: list[int], counts: list[int], score: int) -> None:
        stored = self._stored()
        absent = [k for k in keys if self.cache.lookup([k], [0])[0] < 0]
        found = {k: stored[k] for k in absent if k in stored}
        slots, status, victims, victim_words = self.cache.find_or_insert(
            keys, [0] * len(keys), [score], counts
        )
        up = [k for k, s in zip(keys, slots, strict=True) if k in found and s >= 0]
        self.storage.erase(up, [0] * len(up))
        overflow = [k for k, s in zip(keys, status, strict=True) if s == FAILED]
        spilled = [
            (v, w) for s, v, w in zip(status, victims, victim_words, strict=True) if s == EVICTED
        ]
        self._insert([v for v, _ in spilled], [w for _, w in spilled], set(overflow))
        if self.policy == LFU:  # a key that moved up keeps its count
            for k in up:
                slot = self.cache.lookup([k], [0])[0]
                content = self.cache._slots[0][slot]
                assert content is not None
                content[1][0] += found[k][0]
        words = []
        for k in overflow:
            count = counts[keys.index(k)]
            words.append([count + found.get(k, [0])[0]] if self.policy == LFU else [score])
        self._insert(overflow, words, set())

    def tiers(self) -> tuple[dict[int, int], dict[int, int]]:
        ck, cs, _ = self.cache.export(0)
        sk, ss, _ = self.storage.export(0)
        return dict(zip(ck, (s[0] for s in cs), strict=True)), dict(
            zip(sk, (s[0] for s in ss), strict=True)
        )


def _module(
    strategy: DynamicEmbScoreStrategy, cache_rows: int, storage: tuple[int, int]
) -> DynamicEmbeddingTables:
    probe = DynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=DIM, max_capacity=128)], device="cpu", optimizer="sgd"
    )
    row_bytes = probe.tables.values[0].shape[1] * 4
    options = DynamicEmbTableOptions(
        dim=DIM, max_capacity=storage[0], init_capacity=storage[0], bucket_capacity=storage[1],
        score_strategy=strategy, caching=True, local_hbm_for_values=cache_rows * row_bytes,
        evicted_item_mode=EvictedItemMode.RETAIN_KEY,
    )  # fmt: skip
    return DynamicEmbeddingTables(
        [options], table_names=["t"], device="cpu", optimizer="sgd",
        pooling_mode=DynamicEmbPoolingMode.NONE,
    )  # fmt: skip


def _run(
    strategy: DynamicEmbScoreStrategy,
    cache_buckets: int,
    storage: tuple[int, int],
    steps: list[list[int]],
) -> tuple[int, int]:
    """Train the module and the model on ``steps``, comparing both tiers and the dropped keys
    after every step; returns how many keys overflowed the cache and how many were dropped."""
    module = _module(strategy, 16 * cache_buckets, storage)
    assert module.cache is not None
    width = module.tables.index.bucket_width_list[0]
    model = TwoTiers(POLICY[strategy], (module.tables.capacity(0), width), storage)
    dropped = 0
    for step, ids in enumerate(steps, start=1):
        occurrences = Counter(ids)
        keys = sorted(occurrences)  # the module's dedup order: by key
        model.dropped = set()
        model.step(keys, [occurrences[k] for k in keys], step)
        out = module(torch.tensor(ids), torch.arange(len(ids) + 1))
        out.sum().backward()
        cache, below = model.tiers()
        ex = module.tables.export(0)
        got = dict(zip(ex.keys.tolist(), ex.scores[:, 0].tolist(), strict=True))
        assert got == cache, f"step {step}: the cache differs"
        stored = module.cache.export(0)
        mine = stored.slots < 0
        got = dict(zip(stored.keys[mine].tolist(), stored.scores[mine, 0].tolist(), strict=True))
        assert got == below, f"step {step}: the storage differs"
        popped = pop_evicted_keys(module).get("model", {}).get("t", torch.zeros(0))
        assert set(popped.tolist()) == model.dropped, f"step {step}: dropped keys differ"
        dropped += len(model.dropped)
    return module.cache_stats()["t"]["overflows"], dropped


def test_a_churning_stream_overflows_the_cache_and_fills_the_storage():
    gen = torch.Generator().manual_seed(0)
    steps = [torch.randint(0, 400, (60,), generator=gen).tolist() for _ in range(12)]
    overflows, dropped = _run(DynamicEmbScoreStrategy.STEP, 1, (64, 32), steps)
    assert overflows > 0
    assert dropped > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    strategy=st.sampled_from([DynamicEmbScoreStrategy.STEP, DynamicEmbScoreStrategy.LFU]),
    cache_buckets=st.integers(1, 2),
    storage=st.sampled_from([(64, 32), (96, 16), (128, 64)]),
    steps=st.lists(st.lists(st.integers(0, 150), min_size=1, max_size=60), min_size=1, max_size=8),
)
def test_both_tiers_evict_as_the_model(
    strategy: DynamicEmbScoreStrategy,
    cache_buckets: int,
    storage: tuple[int, int],
    steps: list[list[int]],
) -> None:
    _run(strategy, cache_buckets, storage, steps)
