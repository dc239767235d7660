"""Caching tables (``caching=True``): a device cache over a storage tier, trained step for step
against an all-device twin of the same capacity on the same stream, with the default host
storage, the dict-backed demo storage and RocksDB (helpers: _cache_common.py; prefetch and the
storage reads on the side stream: test_cache_prefetch.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _cache_common import (
    CAPACITY,
    DIM,
    HAS_ROCKSDICT,
    KEYS,
    NAMES,
    PyDictStorage,
    assert_union_equals_twin,
    batch,
    modules,
    storage_rows,
    tier_options,
    train_both,
    value_row_bytes,
)
from demb_storage import (
    DynamicEmbeddingTable,
    RocksDBStorage,
    RowLayout,
    Storage,
    TableConfigError,
)
from demb_torchrec import (
    DynamicEmbDump,
    DynamicEmbeddingTables,
    DynamicEmbLoad,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EvictedItemMode,
    erase_keys,
    pop_erased_keys,
    pop_evicted_keys,
    table_stats,
)
from demb_torchrec.errors import NotSupportedError


@pytest.mark.parametrize("ratio", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("kind", ["host", "dict", "rocksdb"])
def test_cached_training_equals_the_all_device_table(ratio: float, kind: str, tmp_path: Path):
    if kind == "rocksdb" and not HAS_ROCKSDICT:
        pytest.skip("rocksdict (extra 'ssd') missing")
    layouts = [RowLayout(DIM, value_row_bytes("adam") // 4 - DIM)] * len(NAMES)
    storage: Storage | None = None
    if kind == "dict":
        storage = PyDictStorage(layouts, names=NAMES)
    elif kind == "rocksdb":
        storage = RocksDBStorage(tmp_path / "rows", layouts, names=NAMES)
    twin, cached = modules(ratio, storage=storage)
    train_both(twin, cached, steps=12, n=1500)
    stats = cached.cache_stats()
    if ratio == 0.1:  # a 1024-row cache, ~1300 unique keys a batch: buckets overflow
        assert sum(s["storage_hits"] for s in stats.values()) > 0
        assert sum(s["overflows"] for s in stats.values()) > 0
    twin.eval()
    cached.eval()
    gen = torch.Generator().manual_seed(7)
    indices, offsets = batch(gen, 800, pooled=False)
    indices = indices + 3000  # half of them in neither tier: the eval initializer's rows
    torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets), rtol=0, atol=0)
    assert_union_equals_twin(twin, cached)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.NONE, DynamicEmbPoolingMode.SUM])
def test_optimizers_and_pooling(optimizer: str, pooling: DynamicEmbPoolingMode):
    twin, cached = modules(0.1, optimizer, pooling)
    train_both(twin, cached, steps=8, n=1400)
    assert_union_equals_twin(twin, cached)


@pytest.mark.cuda
@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.NONE, DynamicEmbPoolingMode.SUM])
def test_cached_training_on_cuda(pooling: DynamicEmbPoolingMode):
    """On a GPU: the cache in device memory, the host table's index on the device and its rows
    in host memory the device maps (a hybrid table of no device rows: counted as host memory)."""
    twin, cached = modules(0.1, "adam", pooling, device="cuda")
    assert cached.cache is not None
    below = cached.cache.below[0]
    assert below is not None
    storage = below.storage
    assert isinstance(storage, DynamicEmbeddingTable)
    assert all(c.device_rows == 0 for c in storage.table.configs)
    assert all(v.is_cuda for v in storage.table.values)
    values = sum(v.nbytes for v in storage.table.values)
    assert storage.memory_usage().host == values
    train_both(twin, cached, steps=8, n=1400)
    stats = cached.cache_stats()
    assert sum(s["storage_hits"] for s in stats.values()) > 0
    assert sum(s["overflows"] for s in stats.values()) > 0
    assert_union_equals_twin(twin, cached)


@pytest.mark.parametrize(
    "strategy",
    [
        DynamicEmbScoreStrategy.LFU,
        (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU),
    ],
)
def test_access_counts_follow_a_key_between_tiers(strategy: Any):
    twin, cached = modules(0.1, strategy=strategy)
    train_both(twin, cached, steps=10, n=1400)
    cached.flush()
    for t in range(len(NAMES)):
        ex = twin.tables.export(t)
        order = torch.argsort(ex.keys)
        keys, rows, frequency = storage_rows(cached, t)
        assert torch.equal(keys, ex.keys[order])
        torch.testing.assert_close(rows, ex.values[order].float(), rtol=0, atol=1e-6)
        lfu = [
            i for i, c in enumerate(twin.tables.configs[t].score_layout.columns) if c.name == "LFU"
        ]
        assert torch.equal(frequency, ex.scores[order][:, lfu[0]])


def test_a_forward_without_gradient_writes_its_overflow_back():
    twin, cached = modules(0.1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(3):
            indices, offsets = batch(gen, 1500, pooled=False)
            torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets))
    assert sum(s["overflows"] for s in cached.cache_stats().values()) > 0
    assert_union_equals_twin(twin, cached)


def test_a_full_storage_evicts_each_key_once_and_never_holds_one_twice():
    options = tier_options(0.1, "adam", evicted_item_mode=EvictedItemMode.RETAIN_KEY)
    for o in options:
        o.max_capacity = o.init_capacity = 2048  # the storage holds 2048; the cache 1024
        o.local_hbm_for_values = 1024 * value_row_bytes("adam")
    cached = DynamicEmbeddingTables(
        options, table_names=NAMES, device="cpu", optimizer="adam",
        pooling_mode=DynamicEmbPoolingMode.NONE,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    seen: list[set[int]] = [set(), set()]
    popped: list[set[int]] = [set(), set()]
    for _ in range(8):
        indices, offsets = batch(gen, 1500, pooled=False)
        cached(indices, offsets).sum().backward()
        for t, part in enumerate(indices.split(1500)):
            seen[t] |= set(part.tolist())
        out = pop_evicted_keys(cached)
        for t, name in enumerate(NAMES):
            keys = set(out["model"][name].tolist()) if name in out.get("model", {}) else set()
            held = set(cached.tables.export(t).keys.tolist()) | set(
                storage_rows(cached, t)[0].tolist()
            )
            assert not keys & held, "a key recorded as evicted is still held"
            popped[t] |= keys
    assert cached.cache is not None
    for t in range(len(NAMES)):
        in_cache = set(cached.tables.export(t).keys.tolist())
        below = set(storage_rows(cached, t)[0].tolist())
        assert not in_cache & below, "a key in both tiers"
        assert in_cache | below | popped[t] >= seen[t], "a key lost without being recorded"
        assert sum(cached.cache_stats(reset=False)[NAMES[t]].values()) > 0


def test_bad_tier_settings_are_named():
    one = DynamicEmbTableOptions(dim=DIM, max_capacity=CAPACITY, caching=True)
    with pytest.raises(TableConfigError, match=r"user.*caching=True sizes its device cache"):
        DynamicEmbeddingTables([one], table_names=["user"], device="cpu")
    one.local_hbm_for_values = 10 * DIM * 4
    with pytest.raises(TableConfigError, match=r"user\.local_hbm_for_values.*one bucket"):
        DynamicEmbeddingTables([one], table_names=["user"], device="cpu")
    one.local_hbm_for_values = 1 << 62
    with pytest.raises(TableConfigError, match=r"user\.local_hbm_for_values.*bytes of memory"):
        DynamicEmbeddingTables([one], table_names=["user"], device="cpu")
    one.local_hbm_for_values = 2048 * DIM * 4
    one.external_storage = PyDictStorage([RowLayout(DIM + 1)], names=["user"])
    with pytest.raises(TableConfigError, match=r"user\.external_storage.*5 x float32"):
        DynamicEmbeddingTables([one], table_names=["user"], device="cpu")
    one.external_storage = {"not": "a storage"}
    with pytest.raises(TableConfigError, match=r"user\.external_storage.*must be a"):
        DynamicEmbeddingTables([one], table_names=["user"], device="cpu")
    outside = DynamicEmbTableOptions(
        dim=DIM, max_capacity=CAPACITY, external_storage=PyDictStorage([RowLayout(DIM)])
    )
    with pytest.raises(NotSupportedError, match=r"user.*external_storage.*caching=True"):
        DynamicEmbeddingTables([outside], table_names=["user"], device="cpu")


def _exports(module: DynamicEmbeddingTables, t: int) -> tuple[torch.Tensor, ...]:
    """Table ``t``'s keys, rows and score columns across its tiers, by key."""
    if module.cache is None:
        ex = module.tables.export(t)
        order = torch.argsort(ex.keys)
        return ex.keys[order], ex.values[order].float(), ex.scores[order]
    module.flush()
    keys, rows, _ = storage_rows(module, t)
    below = module.cache.below[t]
    assert below is not None
    scores = below.storage.find(keys, below.table_id).scores.t()
    return keys, rows, scores


@pytest.mark.parametrize("direction", ["cached->device", "device->cached"])
def test_checkpoints_move_between_a_cached_and_an_all_device_table(direction: str, tmp_path: Path):
    twin, cached = modules(0.1)
    train_both(twin, cached, steps=6, n=1400)
    source, _ = (cached, twin) if direction == "cached->device" else (twin, cached)
    DynamicEmbDump(str(tmp_path / "ckpt"), source, optim=True)
    fresh_twin, fresh_cached = modules(0.1)
    target = fresh_twin if direction == "cached->device" else fresh_cached
    DynamicEmbLoad(str(tmp_path / "ckpt"), target, optim=True)
    for t in range(len(NAMES)):
        want, got = _exports(twin, t), _exports(target, t)
        assert torch.equal(got[0], want[0]), f"table {t}: key sets differ"
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        assert torch.equal(got[2], want[2]), f"table {t}: scores differ"


def test_a_non_blocking_dump_writes_the_caching_tables_at_the_call(tmp_path: Path):
    twin, cached = modules(0.1)
    train_both(twin, cached, steps=4, n=1400)
    handle = DynamicEmbDump(str(tmp_path / "ckpt"), cached, optim=True, blocking=False)
    train_both(twin, cached, steps=2, n=1400, seed=5)  # training goes on meanwhile
    handle.wait()
    back = modules(0.1)[0]
    DynamicEmbLoad(str(tmp_path / "ckpt"), back, optim=True)
    earlier = modules(0.1)[0]
    train_both(earlier, modules(0.1)[1], steps=4, n=1400)  # the state at the call
    for t in range(len(NAMES)):
        want, got = _exports(earlier, t), _exports(back, t)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_erase_removes_keys_from_both_tiers():
    twin, cached = modules(0.1)
    train_both(twin, cached, steps=4, n=1400)
    assert cached.cache is not None
    in_cache = cached.tables.export(0).keys[:50]
    below = storage_rows(cached, 0)[0][:50]
    keys = torch.cat([in_cache, below, torch.tensor([10**12])])
    removed = erase_keys(cached, {"model": {"user": keys}})
    assert removed == {"model": {"user": 100}}
    want = erase_keys(twin, {"model": {"user": keys}})
    assert want == removed
    assert_union_equals_twin(twin, cached)
    assert set(pop_erased_keys(cached)["model"]["user"].tolist()) == set(keys[:100].tolist())


def test_admission_on_another_table_of_the_module_still_decides():
    """A caching table beside a table with frequency admission: the latter admits exactly as
    in an all-device module (rejected keys read their initial rows and stay out)."""
    from demb_torchrec import FrequencyAdmissionStrategy, KVCounter

    def admitting(cache: bool) -> list[DynamicEmbTableOptions]:
        out = tier_options(0.1 if cache else None, "adam")
        out[1].caching, out[1].local_hbm_for_values, out[1].external_storage = False, 0, None
        out[1].admit_strategy = FrequencyAdmissionStrategy(2, KVCounter(1 << 16))
        return out

    kw: dict[str, Any] = {"table_names": NAMES, "device": "cpu", "optimizer": "adam"}
    kw["pooling_mode"] = DynamicEmbPoolingMode.NONE
    twin = DynamicEmbeddingTables(admitting(False), **kw)
    cached = DynamicEmbeddingTables(admitting(True), **kw)
    train_both(twin, cached, steps=6, n=1400)
    assert twin.tables.size(1) < len(set(range(KEYS)))  # admission kept keys out
    a, b = twin.tables.export(1), cached.tables.export(1)
    assert torch.equal(a.keys.sort().values, b.keys.sort().values)
    cached.eval()
    twin.eval()
    gen = torch.Generator().manual_seed(11)
    indices, offsets = batch(gen, 500, pooled=False)
    torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["frequency", "probabilistic"])
def test_admission_on_caching_tables_decides_as_on_all_device_ones(kind: str):
    """Admission on the caching tables themselves: a key neither tier holds is asked about,
    a rejected one reads its initializer's row and enters neither tier; the union of the
    tiers equals an all-device twin with the same admission, step for step."""
    from demb_torchrec import FrequencyAdmissionStrategy, KVCounter, ProbabilisticAdmissionStrategy

    def admitting(ratio: float | None) -> list[DynamicEmbTableOptions]:
        out = tier_options(ratio, "adam")
        for o in out:
            o.admit_strategy = (
                FrequencyAdmissionStrategy(2, KVCounter(1 << 16))
                if kind == "frequency"
                else ProbabilisticAdmissionStrategy(0.4, seed=3)
            )
        return out

    kw: dict[str, Any] = {"table_names": NAMES, "device": "cpu", "optimizer": "adam"}
    kw["pooling_mode"] = DynamicEmbPoolingMode.NONE
    twin = DynamicEmbeddingTables(admitting(None), **kw)
    cached = DynamicEmbeddingTables(admitting(0.1), **kw)
    train_both(twin, cached, steps=6, n=1400)
    assert twin.tables.size(0) < len(set(range(KEYS)))  # admission kept keys out
    stats = cached.cache_stats()
    assert sum(s["storage_hits"] for s in stats.values()) > 0  # rows moved between the tiers
    want, got = table_stats(twin)["model"], table_stats(cached)["model"]
    for name in NAMES:  # the same keys asked about, the same decisions
        assert (got[name].admitted, got[name].rejected) == (
            want[name].admitted,
            want[name].rejected,
        )
        assert got[name].rejected > 0
    assert_union_equals_twin(twin, cached)


def test_the_storage_grows_while_the_cache_writes_back():
    """A storage that starts at 2,048 slots doubles as write-backs fill it (to 16,384): no key
    is lost on the way."""
    kw: dict[str, Any] = {"table_names": NAMES, "device": "cpu", "optimizer": "adam"}
    kw["pooling_mode"] = DynamicEmbPoolingMode.NONE
    twin = DynamicEmbeddingTables(tier_options(None, "adam"), **kw)
    options = tier_options(0.1, "adam")
    for o in options:
        o.init_capacity = 2048
    cached = DynamicEmbeddingTables(options, **kw)
    assert cached.cache is not None
    below = cached.cache.below[0]
    assert below is not None
    table = below.storage.table  # type: ignore[attr-defined]
    assert table.capacity(0) == 2048
    train_both(twin, cached, steps=8, n=1400)
    assert table.capacity(0) > 2048
    assert_union_equals_twin(twin, cached)
