"""Entries of the empty key (-1) in an unchecked batch are skipped by every table op, on the CPU
as on CUDA: the other entries end exactly as in the batch without them, the skipped ones get
slot -1 (find_or_insert / insert_or_assign: FAILED) and change nothing. And find_or_insert with
``wait=False`` (no sync for the all-found flag) ends exactly as with ``wait=True``."""

from __future__ import annotations

import pytest
import torch
from demb_kernels import table as ops
from demb_kernels.table import EMPTY_KEY, InsertStatus, ScorePolicy, TableIndex

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def make(device: str) -> TableIndex:
    """Two tables (TIMESTAMP and LFU), 64 slots in buckets of 16, filled past full (some keys
    evicted), so that the batches below both hit, insert and evict."""
    index = TableIndex.create(
        [64, 64], [16, 16], [ScorePolicy.TIMESTAMP, ScorePolicy.LFU], device=device
    )
    gen = torch.Generator().manual_seed(0)
    keys = torch.randperm(400, generator=gen)[:200].to(device)
    ids = (keys % 2).to(device)
    ops.find_or_insert(index, keys, ids, torch.tensor([1, 1], device=device))
    return index


def state(index: TableIndex) -> list[torch.Tensor]:
    return [t.cpu().clone() for t in (index.keys, index.digests, index.scores, index.sizes)]


def batch(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct keys of both tables (present, new), and where -1 entries go among them."""
    gen = torch.Generator().manual_seed(1)
    keys = torch.randperm(600, generator=gen)[:120]
    ids = keys % 2
    masked = torch.rand(120, generator=gen) < 0.4
    return keys.to(device), ids.to(device), masked.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("wait", [True, False])
def test_find_or_insert_skips_empty_keys(device, wait):
    keys, ids, masked = batch(device)
    args = torch.tensor([2, 2], device=device)
    compact, with_empty = make(device), make(device)
    kept = (~masked).nonzero().squeeze(1)
    want = ops.find_or_insert(compact, keys[kept], ids[kept], args, check=False)
    padded = torch.where(masked, EMPTY_KEY, keys)
    got = ops.find_or_insert(with_empty, padded, ids, args, check=False, wait=wait)
    assert torch.equal(got.slots[kept], want.slots)
    assert torch.equal(got.status[kept], want.status)
    assert torch.equal(got.victim_keys[kept], want.victim_keys)
    assert bool((got.slots[masked] == -1).all())
    assert bool((got.status[masked] == int(InsertStatus.FAILED)).all())
    assert bool((got.victim_keys[masked] == EMPTY_KEY).all())
    for a, b in zip(state(with_empty), state(compact), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_find_erase_and_assign_skip_empty_keys(device):
    keys, ids, masked = batch(device)
    kept = (~masked).nonzero().squeeze(1)
    padded = torch.where(masked, EMPTY_KEY, keys)
    compact, with_empty = make(device), make(device)
    found = ops.find(with_empty, padded, ids, check=False)
    assert torch.equal(found[kept], ops.find(compact, keys[kept], ids[kept], check=False))
    assert bool((found[masked] == -1).all())
    words = torch.arange(keys.numel(), device=device).unsqueeze(0) + 5
    want = ops.insert_or_assign(compact, keys[kept], ids[kept], words[:, kept], check=False)
    got = ops.insert_or_assign(with_empty, padded, ids, words, check=False)
    assert torch.equal(got.slots[kept], want.slots)
    assert torch.equal(got.status[kept], want.status)
    assert bool((got.status[masked] == int(InsertStatus.FAILED)).all())
    erased = ops.erase(with_empty, padded, ids, check=False)
    assert torch.equal(erased[kept], ops.erase(compact, keys[kept], ids[kept], check=False))
    assert bool((erased[masked] == -1).all())
    for a, b in zip(state(with_empty), state(compact), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_a_checked_batch_still_rejects_the_empty_key(device):
    index = make(device)
    before = state(index)
    keys = torch.tensor([3, -1], device=device)
    with pytest.raises(ValueError, match="empty-key sentinel"):
        ops.find_or_insert(
            index, keys, torch.tensor([1, 0], device=device), torch.tensor([2, 2], device=device)
        )
    for a, b in zip(state(index), before, strict=True):
        assert torch.equal(a, b)
