"""Caching tables (``caching=True``): a device cache over a storage tier, trained step for step
against an all-device twin of the same capacity on the same stream, with the default host
storage, the dict-backed demo storage and RocksDB."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
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


def _dict_storage_class() -> type[Storage]:
    path = Path(__file__).parents[2] / "demb-storage" / "tests" / "_dict_storage.py"
    spec = importlib.util.spec_from_file_location("_demb_cache_dict_storage", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls: type[Storage] = module.PyDictStorage
    return cls


PyDictStorage = _dict_storage_class()
HAS_ROCKSDICT = importlib.util.find_spec("rocksdict") is not None

DIM = 4
CAPACITY = 16384
KEYS = 6000
"""Keys drawn per table: under 40% of the twin's slots, so the twin never evicts."""
NAMES = ["user", "item"]


def _row_bytes(optimizer: str) -> int:
    """Bytes of a value row (embedding and optimizer state) of a float32 table."""
    probe = DynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=DIM, max_capacity=128)], device="cpu", optimizer=optimizer
    )
    return int(probe.tables.values[0].shape[1]) * 4


def _options(
    ratio: float | None,
    optimizer: str,
    strategy: Any = DynamicEmbScoreStrategy.STEP,
    storage: Storage | None = None,
    **extra: Any,
) -> list[DynamicEmbTableOptions]:
    row_bytes = _row_bytes(optimizer)
    out = []
    for _ in NAMES:
        o = DynamicEmbTableOptions(
            dim=DIM, max_capacity=CAPACITY, init_capacity=CAPACITY, score_strategy=strategy,
            **extra,
        )  # fmt: skip
        if ratio is not None:
            o.caching = True
            o.local_hbm_for_values = int(ratio * CAPACITY) * row_bytes
            o.external_storage = storage
        out.append(o)
    return out


def _modules(
    ratio: float,
    optimizer: str = "adam",
    pooling: DynamicEmbPoolingMode = DynamicEmbPoolingMode.NONE,
    strategy: Any = DynamicEmbScoreStrategy.STEP,
    storage: Storage | None = None,
    device: str = "cpu",
) -> tuple[DynamicEmbeddingTables, DynamicEmbeddingTables]:
    kw: dict[str, Any] = {
        "table_names": NAMES, "pooling_mode": pooling, "device": device,
        "optimizer": optimizer, "learning_rate": 0.05,
    }  # fmt: skip
    twin = DynamicEmbeddingTables(_options(None, optimizer, strategy), **kw)
    cached = DynamicEmbeddingTables(_options(ratio, optimizer, strategy, storage), **kw)
    return twin, cached


def _batch(
    gen: torch.Generator, n: int, pooled: bool, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    indices = torch.randint(0, KEYS, (2 * n,), generator=gen)
    step = 2 if pooled else 1
    return indices.to(device), torch.arange(0, 2 * n + 1, step, device=device)


def _train_both(
    twin: DynamicEmbeddingTables, cached: DynamicEmbeddingTables, steps: int, n: int, seed: int = 0
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pooled = twin.pooling_mode is not DynamicEmbPoolingMode.NONE
    for step in range(steps):
        indices, offsets = _batch(gen, n, pooled, twin.device)
        a, b = twin(indices, offsets), cached(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}: outputs differ")
        grad = torch.randn(a.shape, generator=gen).to(a.device)
        a.backward(grad)
        b.backward(grad)


def _storage_rows(cached: DynamicEmbeddingTables, t: int) -> tuple[torch.Tensor, ...]:
    """Table ``t``'s keys, rows and first score word in its storage, by key."""
    assert cached.cache is not None
    below = cached.cache.below[t]
    assert below is not None
    ex = below.storage.export(below.table_id)
    order = torch.argsort(ex.keys.cpu())
    return ex.keys.cpu()[order], ex.values.cpu().float()[order], ex.scores.cpu()[0][order]


def _assert_union_equals_twin(twin: DynamicEmbeddingTables, cached: DynamicEmbeddingTables) -> None:
    cached.flush()  # the cache's rows go down: the storage then holds every key
    for t in range(len(NAMES)):
        assert cached.tables.size(t) == 0
        ex = twin.tables.export(t)
        order = torch.argsort(ex.keys)
        keys, rows, scores = _storage_rows(cached, t)
        assert torch.equal(keys, ex.keys[order].cpu()), f"table {t}: key sets differ"
        torch.testing.assert_close(rows, ex.values[order].float().cpu(), rtol=0, atol=1e-6)
        assert torch.equal(scores, ex.scores[order][:, 0].cpu()), f"table {t}: scores differ"


@pytest.mark.parametrize("ratio", [0.1, 0.5, 1.0])
@pytest.mark.parametrize("kind", ["host", "dict", "rocksdb"])
def test_cached_training_equals_the_all_device_table(ratio: float, kind: str, tmp_path: Path):
    if kind == "rocksdb" and not HAS_ROCKSDICT:
        pytest.skip("rocksdict (extra 'ssd') missing")
    layouts = [RowLayout(DIM, _row_bytes("adam") // 4 - DIM)] * len(NAMES)
    storage: Storage | None = None
    if kind == "dict":
        storage = PyDictStorage(layouts, names=NAMES)
    elif kind == "rocksdb":
        storage = RocksDBStorage(tmp_path / "rows", layouts, names=NAMES)
    twin, cached = _modules(ratio, storage=storage)
    _train_both(twin, cached, steps=12, n=1500)
    stats = cached.cache_stats()
    if ratio == 0.1:  # a 1024-row cache, ~1300 unique keys a batch: buckets overflow
        assert sum(s["storage_hits"] for s in stats.values()) > 0
        assert sum(s["overflows"] for s in stats.values()) > 0
    twin.eval()
    cached.eval()
    gen = torch.Generator().manual_seed(7)
    indices, offsets = _batch(gen, 800, pooled=False)
    indices = indices + 3000  # half of them in neither tier: the eval initializer's rows
    torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets), rtol=0, atol=0)
    _assert_union_equals_twin(twin, cached)


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.NONE, DynamicEmbPoolingMode.SUM])
def test_optimizers_and_pooling(optimizer: str, pooling: DynamicEmbPoolingMode):
    twin, cached = _modules(0.1, optimizer, pooling)
    _train_both(twin, cached, steps=8, n=1400)
    _assert_union_equals_twin(twin, cached)


@pytest.mark.cuda
@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.NONE, DynamicEmbPoolingMode.SUM])
def test_cached_training_on_cuda(pooling: DynamicEmbPoolingMode):
    """On a GPU: the cache in device memory, the host table's index on the device and its rows
    in host memory the device maps (a hybrid table of no device rows: counted as host memory)."""
    twin, cached = _modules(0.1, "adam", pooling, device="cuda")
    assert cached.cache is not None
    below = cached.cache.below[0]
    assert below is not None
    storage = below.storage
    assert isinstance(storage, DynamicEmbeddingTable)
    assert all(c.device_rows == 0 for c in storage.table.configs)
    assert all(v.is_cuda for v in storage.table.values)
    values = sum(v.nbytes for v in storage.table.values)
    assert storage.memory_usage().host == values
    _train_both(twin, cached, steps=8, n=1400)
    stats = cached.cache_stats()
    assert sum(s["storage_hits"] for s in stats.values()) > 0
    assert sum(s["overflows"] for s in stats.values()) > 0
    _assert_union_equals_twin(twin, cached)


@pytest.mark.parametrize(
    "strategy",
    [
        DynamicEmbScoreStrategy.LFU,
        (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU),
    ],
)
def test_access_counts_follow_a_key_between_tiers(strategy: Any):
    twin, cached = _modules(0.1, strategy=strategy)
    _train_both(twin, cached, steps=10, n=1400)
    cached.flush()
    for t in range(len(NAMES)):
        ex = twin.tables.export(t)
        order = torch.argsort(ex.keys)
        keys, rows, frequency = _storage_rows(cached, t)
        assert torch.equal(keys, ex.keys[order])
        torch.testing.assert_close(rows, ex.values[order].float(), rtol=0, atol=1e-6)
        lfu = [
            i for i, c in enumerate(twin.tables.configs[t].score_layout.columns) if c.name == "LFU"
        ]
        assert torch.equal(frequency, ex.scores[order][:, lfu[0]])


def test_a_forward_without_gradient_writes_its_overflow_back():
    twin, cached = _modules(0.1)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _ in range(3):
            indices, offsets = _batch(gen, 1500, pooled=False)
            torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets))
    assert sum(s["overflows"] for s in cached.cache_stats().values()) > 0
    _assert_union_equals_twin(twin, cached)


def test_a_full_storage_evicts_each_key_once_and_never_holds_one_twice():
    options = _options(0.1, "adam", evicted_item_mode=EvictedItemMode.RETAIN_KEY)
    for o in options:
        o.max_capacity = o.init_capacity = 2048  # the storage holds 2048; the cache 1024
        o.local_hbm_for_values = 1024 * _row_bytes("adam")
    cached = DynamicEmbeddingTables(
        options, table_names=NAMES, device="cpu", optimizer="adam",
        pooling_mode=DynamicEmbPoolingMode.NONE,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    seen: list[set[int]] = [set(), set()]
    popped: list[set[int]] = [set(), set()]
    for _ in range(8):
        indices, offsets = _batch(gen, 1500, pooled=False)
        cached(indices, offsets).sum().backward()
        for t, part in enumerate(indices.split(1500)):
            seen[t] |= set(part.tolist())
        out = pop_evicted_keys(cached)
        for t, name in enumerate(NAMES):
            keys = set(out["model"][name].tolist()) if name in out.get("model", {}) else set()
            held = set(cached.tables.export(t).keys.tolist()) | set(
                _storage_rows(cached, t)[0].tolist()
            )
            assert not keys & held, "a key recorded as evicted is still held"
            popped[t] |= keys
    assert cached.cache is not None
    for t in range(len(NAMES)):
        in_cache = set(cached.tables.export(t).keys.tolist())
        below = set(_storage_rows(cached, t)[0].tolist())
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
    keys, rows, _ = _storage_rows(module, t)
    below = module.cache.below[t]
    assert below is not None
    scores = below.storage.find(keys, below.table_id).scores.t()
    return keys, rows, scores


@pytest.mark.parametrize("direction", ["cached->device", "device->cached"])
def test_checkpoints_move_between_a_cached_and_an_all_device_table(direction: str, tmp_path: Path):
    twin, cached = _modules(0.1)
    _train_both(twin, cached, steps=6, n=1400)
    source, _ = (cached, twin) if direction == "cached->device" else (twin, cached)
    DynamicEmbDump(str(tmp_path / "ckpt"), source, optim=True)
    fresh_twin, fresh_cached = _modules(0.1)
    target = fresh_twin if direction == "cached->device" else fresh_cached
    DynamicEmbLoad(str(tmp_path / "ckpt"), target, optim=True)
    for t in range(len(NAMES)):
        want, got = _exports(twin, t), _exports(target, t)
        assert torch.equal(got[0], want[0]), f"table {t}: key sets differ"
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
        assert torch.equal(got[2], want[2]), f"table {t}: scores differ"


def test_a_non_blocking_dump_writes_the_caching_tables_at_the_call(tmp_path: Path):
    twin, cached = _modules(0.1)
    _train_both(twin, cached, steps=4, n=1400)
    handle = DynamicEmbDump(str(tmp_path / "ckpt"), cached, optim=True, blocking=False)
    _train_both(twin, cached, steps=2, n=1400, seed=5)  # training goes on meanwhile
    handle.wait()
    back = _modules(0.1)[0]
    DynamicEmbLoad(str(tmp_path / "ckpt"), back, optim=True)
    earlier = _modules(0.1)[0]
    _train_both(earlier, _modules(0.1)[1], steps=4, n=1400)  # the state at the call
    for t in range(len(NAMES)):
        want, got = _exports(earlier, t), _exports(back, t)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)


def test_erase_removes_keys_from_both_tiers():
    twin, cached = _modules(0.1)
    _train_both(twin, cached, steps=4, n=1400)
    assert cached.cache is not None
    in_cache = cached.tables.export(0).keys[:50]
    below = _storage_rows(cached, 0)[0][:50]
    keys = torch.cat([in_cache, below, torch.tensor([10**12])])
    removed = erase_keys(cached, {"model": {"user": keys}})
    assert removed == {"model": {"user": 100}}
    want = erase_keys(twin, {"model": {"user": keys}})
    assert want == removed
    _assert_union_equals_twin(twin, cached)
    assert set(pop_erased_keys(cached)["model"]["user"].tolist()) == set(keys[:100].tolist())


def test_admission_on_another_table_of_the_module_still_decides():
    """A caching table beside a table with frequency admission: the latter admits exactly as
    in an all-device module (rejected keys read their initial rows and stay out)."""
    from demb_torchrec import FrequencyAdmissionStrategy, KVCounter

    def options(cache: bool) -> list[DynamicEmbTableOptions]:
        out = _options(0.1 if cache else None, "adam")
        out[1].caching, out[1].local_hbm_for_values, out[1].external_storage = False, 0, None
        out[1].admit_strategy = FrequencyAdmissionStrategy(2, KVCounter(1 << 16))
        return out

    kw: dict[str, Any] = {"table_names": NAMES, "device": "cpu", "optimizer": "adam"}
    kw["pooling_mode"] = DynamicEmbPoolingMode.NONE
    twin = DynamicEmbeddingTables(options(False), **kw)
    cached = DynamicEmbeddingTables(options(True), **kw)
    _train_both(twin, cached, steps=6, n=1400)
    assert twin.tables.size(1) < len(set(range(KEYS)))  # admission kept keys out
    a, b = twin.tables.export(1), cached.tables.export(1)
    assert torch.equal(a.keys.sort().values, b.keys.sort().values)
    cached.eval()
    twin.eval()
    gen = torch.Generator().manual_seed(11)
    indices, offsets = _batch(gen, 500, pooled=False)
    torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets), rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["frequency", "probabilistic"])
def test_admission_on_caching_tables_decides_as_on_all_device_ones(kind: str):
    """Admission on the caching tables themselves: a key neither tier holds is asked about,
    a rejected one reads its initializer's row and enters neither tier; the union of the
    tiers equals an all-device twin with the same admission, step for step."""
    from demb_torchrec import FrequencyAdmissionStrategy, KVCounter, ProbabilisticAdmissionStrategy

    def options(ratio: float | None) -> list[DynamicEmbTableOptions]:
        out = _options(ratio, "adam")
        for o in out:
            o.admit_strategy = (
                FrequencyAdmissionStrategy(2, KVCounter(1 << 16))
                if kind == "frequency"
                else ProbabilisticAdmissionStrategy(0.4, seed=3)
            )
        return out

    kw: dict[str, Any] = {"table_names": NAMES, "device": "cpu", "optimizer": "adam"}
    kw["pooling_mode"] = DynamicEmbPoolingMode.NONE
    twin = DynamicEmbeddingTables(options(None), **kw)
    cached = DynamicEmbeddingTables(options(0.1), **kw)
    _train_both(twin, cached, steps=6, n=1400)
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
    _assert_union_equals_twin(twin, cached)


def test_the_storage_grows_while_the_cache_writes_back():
    """A storage that starts at 2,048 slots doubles as write-backs fill it (to 16,384): no key
    is lost on the way."""
    kw: dict[str, Any] = {"table_names": NAMES, "device": "cpu", "optimizer": "adam"}
    kw["pooling_mode"] = DynamicEmbPoolingMode.NONE
    twin = DynamicEmbeddingTables(_options(None, "adam"), **kw)
    options = _options(0.1, "adam")
    for o in options:
        o.init_capacity = 2048
    cached = DynamicEmbeddingTables(options, **kw)
    assert cached.cache is not None
    below = cached.cache.below[0]
    assert below is not None
    table = below.storage.table  # type: ignore[attr-defined]
    assert table.capacity(0) == 2048
    _train_both(twin, cached, steps=8, n=1400)
    assert table.capacity(0) > 2048
    _assert_union_equals_twin(twin, cached)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _slow_side_stream(cached: DynamicEmbeddingTables) -> None:
    """On CUDA, hold up (about 20 ms) the stream the module reads its storage on, before its
    next reads: a forward, or a write to the storage, that did not wait for them on the device
    would use rows not yet read (or overwrite rows being read)."""
    assert cached.cache is not None
    if cached.device.type != "cuda":
        return
    reads = cached.cache.reads
    if reads._stream is None:
        reads._stream = torch.cuda.Stream(cached.device)
    with torch.cuda.stream(reads._stream):
        torch.cuda._sleep(20_000_000)


@pytest.mark.cuda
def test_the_storage_reads_of_a_forward_are_waited_for():
    """CUDA, no prefetch: each forward reads its storage hits on the side stream, held up
    before every forward; the rows placed, and the storage writes after the reads (write-backs
    into slots just freed), still give the twin's outputs and tables."""
    twin, cached = _modules(0.1, device="cuda")
    gen = torch.Generator().manual_seed(8)
    for step in range(8):
        indices, offsets = _batch(gen, 1400, False, "cuda")
        a = twin(indices, offsets)
        _slow_side_stream(cached)
        b = cached(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}")
        grad = torch.randn(a.shape, generator=gen).to("cuda")
        a.backward(grad)
        b.backward(grad)
    assert sum(s["storage_hits"] for s in cached.cache_stats().values()) > 0
    _assert_union_equals_twin(twin, cached)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.NONE, DynamicEmbPoolingMode.SUM])
def test_prefetch_of_the_next_batch_changes_nothing_but_where_rows_come_from(
    pooling: DynamicEmbPoolingMode, device: str
):
    """Each step prefetches the next batch between its forward and its backward (whose
    overflow write-backs then change some prefetched entries): the outputs, rows and scores
    stay those of the all-device twin, and most storage hits come from the prefetch. On CUDA
    the prefetch's reads are held up on its stream, so the backward's write-backs and the next
    forward must wait for them on the device."""
    twin, cached = _modules(0.1, pooling=pooling, device=device)
    pooled = pooling is not DynamicEmbPoolingMode.NONE
    gen = torch.Generator().manual_seed(4)
    batches = [_batch(gen, 1400, pooled, device) for _ in range(9)]
    for step, (indices, offsets) in enumerate(batches[:-1]):
        a, b = twin(indices, offsets), cached(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}")
        _slow_side_stream(cached)
        cached.prefetch(*batches[step + 1])
        grad = torch.randn(a.shape, generator=gen).to(device)
        a.backward(grad)
        b.backward(grad)
    stats = cached.cache_stats()
    hits = sum(s["storage_hits"] for s in stats.values())
    assert sum(s["prefetched"] for s in stats.values()) > hits // 2 > 0
    _assert_union_equals_twin(twin, cached)


@pytest.mark.cuda
def test_a_prefetch_that_waits_on_nothing_stages_what_its_bound_holds():
    """CUDA: after the first prefetch (which waits, and counts the misses) a prefetch waits on
    nothing and stages at most its bound of the misses; a bound far below them (8) leaves the
    rest to the forward: outputs and tables stay the twin's, and no forward finds more than 8
    of its storage hits staged."""
    twin, cached = _modules(0.1, device="cuda")
    assert cached.cache is not None
    bounds = cached.cache._bounds
    assert bounds.enabled
    assert bounds.bound is None
    gen = torch.Generator().manual_seed(9)
    batches = [_batch(gen, 1400, False, "cuda") for _ in range(8)]
    staged, hits = [], []
    for step, (indices, offsets) in enumerate(batches[:-1]):
        a, b = twin(indices, offsets), cached(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}")
        stats = cached.cache_stats()  # this forward's
        if step >= 2:  # forwards after a bounded prefetch
            staged.append(sum(s["prefetched"] for s in stats.values()))
            hits.append(sum(s["storage_hits"] for s in stats.values()))
        cached.prefetch(*batches[step + 1])
        if step == 0:
            assert bounds.bound is not None  # the first prefetch waited and counted
            bounds.learn = lambda misses: None  # type: ignore[method-assign]
            bounds.bound = 8
        grad = torch.randn(a.shape, generator=gen).to("cuda")
        a.backward(grad)
        b.backward(grad)
    assert max(staged) <= 8
    assert sum(staged) > 0
    assert sum(hits) > sum(staged)  # the rest were read by the forwards
    _assert_union_equals_twin(twin, cached)


@pytest.mark.cuda
def test_prefetch_for_a_forward_on_another_stream():
    """CUDA: the prefetch runs on the default stream, the next forward and backward on another
    (``forward_stream``): the outputs and tables stay the twin's."""
    twin, cached = _modules(0.1, device="cuda")
    gen = torch.Generator().manual_seed(6)
    batches = [_batch(gen, 1400, False, "cuda") for _ in range(7)]
    other = torch.cuda.Stream()
    for step, (indices, offsets) in enumerate(batches[:-1]):
        a = twin(indices, offsets)
        other.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(other):
            b = cached(indices, offsets)
            grad = torch.randn(a.shape, generator=gen).to("cuda")
            b.backward(grad)
        torch.cuda.current_stream().wait_stream(other)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}")
        a.backward(grad)
        _slow_side_stream(cached)
        cached.prefetch(*batches[step + 1], forward_stream=other)
    _assert_union_equals_twin(twin, cached)


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_after_a_prefetch_is_what_the_next_forward_reads(device: str, tmp_path: Path):
    """Prefetch reads stored keys ahead, then a checkpoint of an earlier state is loaded: the
    next forward reads the loaded rows, as the all-device twin does, not the prefetched
    ones."""
    twin, cached = _modules(0.1, device=device)
    _train_both(twin, cached, steps=3, n=1400)
    DynamicEmbDump(str(tmp_path / "ckpt"), twin, optim=True)
    _train_both(twin, cached, steps=3, n=1400, seed=1)  # both move on past the checkpoint
    stored = _storage_rows(cached, 0)[0][:50].to(device)
    indices = torch.cat([stored, stored])  # user table, then item table: the same ids
    offsets = torch.arange(indices.numel() + 1, device=device)
    _slow_side_stream(cached)
    cached.prefetch(indices, offsets)
    for module in (twin, cached):
        DynamicEmbLoad(str(tmp_path / "ckpt"), module, optim=True)
    torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets), rtol=0, atol=0)
    _assert_union_equals_twin(twin, cached)


def test_prefetch_checks_its_batch_and_is_a_no_op_without_caching():
    twin, cached = _modules(0.1)
    with pytest.raises(ValueError, match="offsets"):
        cached.prefetch(torch.tensor([1, 2]), torch.tensor([0, 5]))
    twin.prefetch(torch.tensor([1, 2]), torch.tensor([0, 1, 2]))  # no cache: nothing to do
    assert twin.tables.size(0) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_over_a_storage_that_evicts_changes_nothing(device: str):
    """A storage of 2,048 slots a table under 6,000 keys evicts every step: a module that
    prefetches each next batch trains exactly as the same module without prefetch (an entry
    the storage evicts after it was read ahead is not read from the prefetch)."""
    kw: dict[str, Any] = {"table_names": NAMES, "device": device, "optimizer": "adam"}
    kw["pooling_mode"] = DynamicEmbPoolingMode.NONE
    row_bytes = _row_bytes("adam")

    def build() -> DynamicEmbeddingTables:
        options = _options(0.1, "adam")
        for o in options:
            o.max_capacity = o.init_capacity = 2048
            o.local_hbm_for_values = 256 * row_bytes
        return DynamicEmbeddingTables(options, **kw)

    plain, ahead = build(), build()
    gen = torch.Generator().manual_seed(5)
    batches = [_batch(gen, 1400, False, device) for _ in range(9)]
    for step, (indices, offsets) in enumerate(batches[:-1]):
        a, b = plain(indices, offsets), ahead(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"step {step}")
        _slow_side_stream(ahead)
        ahead.prefetch(*batches[step + 1])
        grad = torch.randn(a.shape, generator=gen).to(device)
        a.backward(grad)
        b.backward(grad)
    stats = ahead.cache_stats()
    assert sum(s["evictions"] for s in stats.values()) > 0
    assert sum(s["prefetched"] for s in stats.values()) > 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_key_erased_after_its_prefetch_is_new_at_the_next_forward(device: str):
    """Prefetch reads a stored key ahead; erase_keys removes it; the next forward must treat
    it as a new key (its initializer's row), as the all-device twin does, not read the
    prefetched copy."""
    twin, cached = _modules(0.1, device=device)
    _train_both(twin, cached, steps=3, n=1400)
    stored = _storage_rows(cached, 0)[0][:20].to(device)
    indices = torch.cat([stored, stored])  # user table, then item table: the same ids
    offsets = torch.arange(indices.numel() + 1, device=device)
    _slow_side_stream(cached)
    cached.prefetch(indices, offsets)
    for module in (twin, cached):
        erase_keys(module, {"model": {"user": stored}})
    torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets), rtol=0, atol=0)
    _assert_union_equals_twin(twin, cached)
