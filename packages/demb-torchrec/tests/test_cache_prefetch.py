"""Caching tables' storage reads on the side stream and ``prefetch``: a forward's reads waited
for on the device, the next batch's rows read ahead (between a step's forward and its
backward, for a forward on another stream, across a load, a storage that evicts, an erase,
and a prefetch that waits on nothing and stages only what its bound holds), each step against
an all-device twin (helpers: _cache_common.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import demb_torchrec._cache_tier as cache_tier
import pytest
import torch
from _cache_common import (
    DEVICES,
    NAMES,
    assert_union_equals_twin,
    batch,
    modules,
    slow_side_stream,
    storage_rows,
    tier_options,
    train_both,
    value_row_bytes,
)
from _launch_streams import fake_dedup_launch
from demb_torchrec import (
    DynamicEmbDump,
    DynamicEmbeddingTables,
    DynamicEmbLoad,
    DynamicEmbPoolingMode,
    erase_keys,
)


@pytest.mark.cuda
def test_the_storage_reads_of_a_forward_are_waited_for():
    """CUDA, no prefetch: each forward reads its storage hits on the side stream, held up
    before every forward; the rows placed, and the storage writes after the reads (write-backs
    into slots just freed), still give the twin's outputs and tables."""
    twin, cached = modules(0.1, device="cuda")
    gen = torch.Generator().manual_seed(8)
    for step in range(8):
        indices, offsets = batch(gen, 1400, False, "cuda")
        a = twin(indices, offsets)
        slow_side_stream(cached)
        b = cached(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}")
        grad = torch.randn(a.shape, generator=gen).to("cuda")
        a.backward(grad)
        b.backward(grad)
    assert sum(s["storage_hits"] for s in cached.cache_stats().values()) > 0
    assert_union_equals_twin(twin, cached)


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
    twin, cached = modules(0.1, pooling=pooling, device=device)
    pooled = pooling is not DynamicEmbPoolingMode.NONE
    gen = torch.Generator().manual_seed(4)
    batches = [batch(gen, 1400, pooled, device) for _ in range(9)]
    for step, (indices, offsets) in enumerate(batches[:-1]):
        a, b = twin(indices, offsets), cached(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}")
        slow_side_stream(cached)
        cached.prefetch(*batches[step + 1])
        grad = torch.randn(a.shape, generator=gen).to(device)
        a.backward(grad)
        b.backward(grad)
    stats = cached.cache_stats()
    hits = sum(s["storage_hits"] for s in stats.values())
    assert sum(s["prefetched"] for s in stats.values()) > hits // 2 > 0
    assert_union_equals_twin(twin, cached)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("small", [False, True])
def test_a_prefetch_that_waits_on_nothing_stages_what_its_bound_holds(
    device: str, small: bool, monkeypatch: pytest.MonkeyPatch
):
    """After the first prefetch (which waits, and counts the misses) a prefetch waits on
    nothing and stages at most its bound of the misses: the bound it learns (twice the misses)
    holds them all; a bound far below them (8) leaves the rest to the forward. Either way the
    outputs and tables stay the twin's. On the CPU the launched dedup (CUDA only) is a stand-in
    built on the CPU dedup, and the bounded path is switched on by hand."""
    twin, cached = modules(0.1, device=device)
    assert cached.cache is not None
    bounds = cached.cache._bounds
    if device == "cpu":
        assert not bounds.enabled
        bounds.enabled = True
        monkeypatch.setattr(cache_tier, "dedup_launch", fake_dedup_launch)
    assert bounds.enabled
    assert bounds.bound is None
    gen = torch.Generator().manual_seed(9)
    batches = [batch(gen, 1400, False, device) for _ in range(8)]
    staged, hits = [], []
    for step, (indices, offsets) in enumerate(batches[:-1]):
        a, b = twin(indices, offsets), cached(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}")
        stats = cached.cache_stats()  # this forward's
        if step >= 2:  # forwards after a bounded prefetch
            staged.append(sum(s["prefetched"] for s in stats.values()))
            hits.append(sum(s["storage_hits"] for s in stats.values()))
        slow_side_stream(cached)
        cached.prefetch(*batches[step + 1])
        if step == 0:
            assert bounds.bound is not None  # the first prefetch waited and counted
            if small:
                monkeypatch.setattr(bounds, "learn", lambda misses: None)
                bounds.bound = 8
        grad = torch.randn(a.shape, generator=gen).to(device)
        a.backward(grad)
        b.backward(grad)
    assert sum(staged) > 0
    if small:
        assert max(staged) <= 8
        assert sum(hits) > sum(staged)  # the rest were read by the forwards
    else:
        assert sum(staged) > sum(hits) // 2
    assert_union_equals_twin(twin, cached)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["two storages", "second table only"])
def test_a_bounded_prefetch_reads_each_storage_group_its_own_keys(
    device: str, layout: str, monkeypatch: pytest.MonkeyPatch
):
    """A prefetch that waits on nothing over two storage groups (tables of two dims), or over
    the second table only (the first all-device): each group reads only its tables' keys, and
    the module still trains as its twin (SUM pooling: the dims differ)."""

    def built(ratio: float | None) -> list[Any]:
        options = tier_options(ratio, "adam")
        if layout == "two storages":
            options[1].dim = 8
            if ratio is not None:
                options[1].local_hbm_for_values *= 2
        elif ratio is not None:
            options[0].caching, options[0].local_hbm_for_values = False, 0
        return options

    kw: dict[str, Any] = {"table_names": NAMES, "device": device, "optimizer": "adam"}
    kw["pooling_mode"] = DynamicEmbPoolingMode.SUM
    twin = DynamicEmbeddingTables(built(None), **kw)
    cached = DynamicEmbeddingTables(built(0.1), **kw)
    assert cached.cache is not None
    assert len(cached.cache.groups) == (2 if layout == "two storages" else 1)
    if device == "cpu":
        cached.cache._bounds.enabled = True
        monkeypatch.setattr(cache_tier, "dedup_launch", fake_dedup_launch)
    gen = torch.Generator().manual_seed(12)
    batches = [batch(gen, 1400, True, device) for _ in range(7)]
    staged = 0
    for step, (indices, offsets) in enumerate(batches[:-1]):
        a, b = twin(indices, offsets), cached(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6, msg=f"step {step}")
        staged += sum(s["prefetched"] for s in cached.cache_stats().values())
        slow_side_stream(cached)
        cached.prefetch(*batches[step + 1])
        grad = torch.randn(a.shape, generator=gen).to(device)
        a.backward(grad)
        b.backward(grad)
    assert staged > 0
    assert cached.cache._bounds.bound is not None


@pytest.mark.cuda
def test_prefetch_for_a_forward_on_another_stream():
    """CUDA: the prefetch runs on the default stream, the next forward and backward on another
    (``forward_stream``): the outputs and tables stay the twin's."""
    twin, cached = modules(0.1, device="cuda")
    gen = torch.Generator().manual_seed(6)
    batches = [batch(gen, 1400, False, "cuda") for _ in range(7)]
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
        slow_side_stream(cached)
        cached.prefetch(*batches[step + 1], forward_stream=other)
    assert_union_equals_twin(twin, cached)


@pytest.mark.parametrize("device", DEVICES)
def test_a_load_after_a_prefetch_is_what_the_next_forward_reads(device: str, tmp_path: Path):
    """Prefetch reads stored keys ahead, then a checkpoint of an earlier state is loaded: the
    next forward reads the loaded rows, as the all-device twin does, not the prefetched
    ones."""
    twin, cached = modules(0.1, device=device)
    train_both(twin, cached, steps=3, n=1400)
    DynamicEmbDump(str(tmp_path / "ckpt"), twin, optim=True)
    train_both(twin, cached, steps=3, n=1400, seed=1)  # both move on past the checkpoint
    stored = storage_rows(cached, 0)[0][:50].to(device)
    indices = torch.cat([stored, stored])  # user table, then item table: the same ids
    offsets = torch.arange(indices.numel() + 1, device=device)
    slow_side_stream(cached)
    cached.prefetch(indices, offsets)
    for module in (twin, cached):
        DynamicEmbLoad(str(tmp_path / "ckpt"), module, optim=True)
    torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets), rtol=0, atol=0)
    assert_union_equals_twin(twin, cached)


def test_prefetch_checks_its_batch_and_is_a_no_op_without_caching():
    twin, cached = modules(0.1)
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
    row_bytes = value_row_bytes("adam")

    def build() -> DynamicEmbeddingTables:
        options = tier_options(0.1, "adam")
        for o in options:
            o.max_capacity = o.init_capacity = 2048
            o.local_hbm_for_values = 256 * row_bytes
        return DynamicEmbeddingTables(options, **kw)

    plain, ahead = build(), build()
    gen = torch.Generator().manual_seed(5)
    batches = [batch(gen, 1400, False, device) for _ in range(9)]
    for step, (indices, offsets) in enumerate(batches[:-1]):
        a, b = plain(indices, offsets), ahead(indices, offsets)
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=f"step {step}")
        slow_side_stream(ahead)
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
    twin, cached = modules(0.1, device=device)
    train_both(twin, cached, steps=3, n=1400)
    stored = storage_rows(cached, 0)[0][:20].to(device)
    indices = torch.cat([stored, stored])  # user table, then item table: the same ids
    offsets = torch.arange(indices.numel() + 1, device=device)
    slow_side_stream(cached)
    cached.prefetch(indices, offsets)
    for module in (twin, cached):
        erase_keys(module, {"model": {"user": stored}})
    torch.testing.assert_close(cached(indices, offsets), twin(indices, offsets), rtol=0, atol=0)
    assert_union_equals_twin(twin, cached)
