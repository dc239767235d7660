"""Shared by the caching-table tests (test_cache_tier.py, test_cache_prefetch.py): the
all-device twin and the cached module built alike, their batches, and the checks that the
union of a cached module's tiers equals its twin."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch
from demb_storage import (
    Storage,
)
from demb_torchrec import (
    DynamicEmbeddingTables,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)


def dict_storage_class() -> type[Storage]:
    path = Path(__file__).parents[2] / "demb-storage" / "tests" / "_dict_storage.py"
    spec = importlib.util.spec_from_file_location("_demb_cache_dict_storage", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls: type[Storage] = module.PyDictStorage
    return cls


PyDictStorage = dict_storage_class()
HAS_ROCKSDICT = importlib.util.find_spec("rocksdict") is not None

DIM = 4
CAPACITY = 16384
KEYS = 6000
"""Keys drawn per table: under 40% of the twin's slots, so the twin never evicts."""
NAMES = ["user", "item"]


def value_row_bytes(optimizer: str) -> int:
    """Bytes of a value row (embedding and optimizer state) of a float32 table."""
    probe = DynamicEmbeddingTables(
        [DynamicEmbTableOptions(dim=DIM, max_capacity=128)], device="cpu", optimizer=optimizer
    )
    return int(probe.tables.values[0].shape[1]) * 4


def tier_options(
    ratio: float | None,
    optimizer: str,
    strategy: Any = DynamicEmbScoreStrategy.STEP,
    storage: Storage | None = None,
    **extra: Any,
) -> list[DynamicEmbTableOptions]:
    row_bytes = value_row_bytes(optimizer)
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


def modules(
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
    twin = DynamicEmbeddingTables(tier_options(None, optimizer, strategy), **kw)
    cached = DynamicEmbeddingTables(tier_options(ratio, optimizer, strategy, storage), **kw)
    return twin, cached


def batch(
    gen: torch.Generator, n: int, pooled: bool, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    indices = torch.randint(0, KEYS, (2 * n,), generator=gen)
    step = 2 if pooled else 1
    return indices.to(device), torch.arange(0, 2 * n + 1, step, device=device)


def train_both(
    twin: DynamicEmbeddingTables, cached: DynamicEmbeddingTables, steps: int, n: int, seed: int = 0
) -> None:
    gen = torch.Generator().manual_seed(seed)
    pooled = twin.pooling_mode is not DynamicEmbPoolingMode.NONE
    for step in range(steps):
        indices, offsets = batch(gen, n, pooled, twin.device)
        a, b = twin(indices, offsets), cached(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}: outputs differ")
        grad = torch.randn(a.shape, generator=gen).to(a.device)
        a.backward(grad)
        b.backward(grad)


def storage_rows(cached: DynamicEmbeddingTables, t: int) -> tuple[torch.Tensor, ...]:
    """Table ``t``'s keys, rows and first score word in its storage, by key."""
    assert cached.cache is not None
    below = cached.cache.below[t]
    assert below is not None
    ex = below.storage.export(below.table_id)
    order = torch.argsort(ex.keys.cpu())
    return ex.keys.cpu()[order], ex.values.cpu().float()[order], ex.scores.cpu()[0][order]


def assert_union_equals_twin(twin: DynamicEmbeddingTables, cached: DynamicEmbeddingTables) -> None:
    cached.flush()  # the cache's rows go down: the storage then holds every key
    for t in range(len(NAMES)):
        assert cached.tables.size(t) == 0
        ex = twin.tables.export(t)
        order = torch.argsort(ex.keys)
        keys, rows, scores = storage_rows(cached, t)
        assert torch.equal(keys, ex.keys[order].cpu()), f"table {t}: key sets differ"
        torch.testing.assert_close(rows, ex.values[order].float().cpu(), rtol=0, atol=1e-6)
        assert torch.equal(scores, ex.scores[order][:, 0].cpu()), f"table {t}: scores differ"


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def slow_side_stream(cached: DynamicEmbeddingTables) -> None:
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
