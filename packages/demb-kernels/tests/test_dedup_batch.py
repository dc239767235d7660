"""dedup_batch against a pure-Python model (CPU), its errors, and CUDA == CPU output for output
(marker ``cuda``)."""

from __future__ import annotations

import pytest
import torch
from demb_kernels.lookup import check_batch, dedup_batch, index_tables, status_counts
from hypothesis import given, settings
from hypothesis import strategies as st

BAGS = {
    "features": st.integers(1, 4),
    "batch": st.integers(1, 6),
    "max_bag": st.integers(0, 5),
    "seed": st.integers(0, 2**31),
}
"""What both tests of a batch draw: its features, samples per feature, longest bag and seed."""


def batch_case(gen, features, tables, batch, max_bag, key_range, counters):
    lengths = torch.randint(0, max_bag + 1, (features * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(offsets[-1])
    indices = torch.randint(-key_range, key_range, (n,), generator=gen)
    indices[indices == -1] = 0
    feature_tables = torch.randint(0, tables, (features,), generator=gen)
    weights = torch.randint(0, 5, (n,), generator=gen) if counters else None
    return indices, offsets, feature_tables, weights


def model(indices, offsets, feature_tables, tables, batch, counters):
    """Unique (table, key) pairs in (table, key) order, by plain Python."""
    idx, off = indices.tolist(), offsets.tolist()
    table_of = [
        int(feature_tables[b // batch])
        for b in range(len(off) - 1)
        for _ in range(off[b + 1] - off[b])
    ]
    order = sorted(range(len(idx)), key=lambda i: (table_of[i], idx[i], i))
    pairs = sorted({(table_of[i], idx[i]) for i in range(len(idx))})
    rank = {p: u for u, p in enumerate(pairs)}
    inverse = [rank[(table_of[i], idx[i])] for i in range(len(idx))]
    weight = [1] * len(idx) if counters is None else counters.tolist()
    counts = [0] * len(pairs)
    for i, u in enumerate(inverse):
        counts[u] += weight[i]
    starts = [order.index(next(i for i in order if inverse[i] == u)) for u in range(len(pairs))]
    bounds = [sum(1 for t, _ in pairs if t < tt) for tt in range(tables + 1)]
    return pairs, inverse, counts, order, starts, bounds


@settings(max_examples=80, deadline=None)
@given(
    tables=st.integers(1, 4),
    key_range=st.sampled_from([3, 50, 2**62]),
    counters=st.booleans(),
    **BAGS,
)
def test_dedup_batch_matches_a_python_model(
    features, tables, batch, max_bag, key_range, counters, seed
):
    gen = torch.Generator().manual_seed(seed)
    indices, offsets, ftab, weights = batch_case(
        gen, features, tables, batch, max_bag, key_range, counters
    )
    got = dedup_batch(indices, offsets, ftab, tables, batch, weights)
    pairs, inverse, counts, order, starts, bounds = model(
        indices, offsets, ftab, tables, batch, weights
    )
    assert got.keys.tolist() == [k for _, k in pairs]
    assert got.tables.tolist() == [t for t, _ in pairs]
    assert got.inverse.tolist() == inverse
    assert got.counts.tolist() == counts
    assert got.order.tolist() == order
    assert got.starts.tolist() == starts
    assert got.bounds.tolist() == bounds + offsets[::batch].tolist()
    varying = 0
    for k in indices.tolist():
        varying |= (k ^ indices.tolist()[0]) & (2**64 - 1)
    assert got.key_bits == varying.bit_length()


@settings(max_examples=40, deadline=None)
@given(**BAGS)
def test_index_tables_gives_each_index_its_features_table(features, batch, max_bag, seed):
    gen = torch.Generator().manual_seed(seed)
    indices, offsets, ftab, _ = batch_case(gen, features, 3, batch, max_bag, 50, False)
    tables, checks = index_tables(indices, offsets, ftab, 3, batch)
    lengths = offsets.diff().view(features, batch).sum(1)
    assert tables.tolist() == torch.repeat_interleave(ftab, lengths).tolist()
    assert check_batch(checks, indices.numel(), features) == offsets[::batch].tolist()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=5))
def test_status_counts_counts_new_and_failed_keys_per_table(per_table):
    status = torch.tensor([s for t in per_table for s in t], dtype=torch.long)
    bounds = [0]
    for t in per_table:
        bounds.append(bounds[-1] + len(t))
    new, failed = status_counts(status, bounds)
    assert new == [sum(s in (1, 2) for s in t) for t in per_table]  # INSERTED, EVICTED
    assert failed == [sum(s == 3 for s in t) for t in per_table]  # FAILED
    if status.numel():
        with pytest.raises(ValueError, match="bounds: must run from 0"):
            status_counts(status, [0, status.numel() - 1])


def test_bad_batches_are_named():
    ftab = torch.tensor([0, 1])
    ok = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="indices: contains -1"):
        dedup_batch(torch.tensor([5, -1]), ok, ftab, 2, 1)
    with pytest.raises(ValueError, match=r"key_bits=0: must be in \[1, 64\]"):
        dedup_batch(torch.tensor([5, 6]), ok, ftab, 2, 1, key_bits=0)
    with pytest.raises(ValueError, match="offsets: must start at 0, never decrease and end at 2"):
        dedup_batch(torch.tensor([5, 6]), torch.tensor([0, 2, 1]), ftab, 2, 1)
    with pytest.raises(ValueError, match="frequency_counters: contains a negative count"):
        dedup_batch(torch.tensor([5, 6]), ok, ftab, 2, 1, torch.tensor([1, -2]))
    with pytest.raises(ValueError, match=r"feature_tables: 1 entries outside \[0, 2\)"):
        dedup_batch(torch.tensor([5, 6]), ok, torch.tensor([0, 2]), 2, 1)
    with pytest.raises(ValueError, match="expected F \\* B \\+ 1"):
        dedup_batch(torch.tensor([5, 6]), ok, ftab, 2, 2)
    _, checks = index_tables(torch.tensor([5, -1]), ok, ftab, 2, 1)
    with pytest.raises(ValueError, match="indices: contains -1"):
        check_batch(checks, 2, 2)
    _, checks = index_tables(torch.tensor([5, 6]), torch.tensor([1, 2, 2]), ftab, 2, 1)
    with pytest.raises(ValueError, match="offsets: must start at 0"):
        check_batch(checks, 2, 2)


@pytest.mark.cuda
@pytest.mark.parametrize("counters", [False, True])
def test_cuda_equals_cpu(counters):
    """A power-law batch (hot keys, negative keys, an empty feature, a table with no feature):
    every output equal, and the same errors."""
    gen = torch.Generator().manual_seed(3)
    features, batch = 4, 50_000
    lengths = torch.randint(1, 4, (features * batch,), generator=gen)
    lengths[batch : 2 * batch] = 0  # feature 1 empty
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(offsets[-1])
    ranks = (torch.rand(n, generator=gen, dtype=torch.float64) ** -1.5).long()
    indices = ranks * 2_654_435_761 % 100_003 - 50_000
    indices[indices == -1] = 7
    ftab = torch.tensor([2, 0, 2, 3])  # table 1 has no feature
    weights = torch.randint(0, 9, (n,), generator=gen) if counters else None
    cpu = dedup_batch(indices, offsets, ftab, 5, batch, weights)
    gpu = dedup_batch(
        indices.cuda(),
        offsets.cuda(),
        ftab.cuda(),
        5,
        batch,
        None if weights is None else weights.cuda(),
    )
    for name, a, b in zip(cpu._fields[:-1], cpu[:-1], gpu[:-1], strict=True):
        assert torch.equal(a, b.cpu()), name
    assert gpu.key_bits == cpu.key_bits
    # The sort's guess of the key bits: right, short (sorted again on 64 bits), or generous.
    for guess in (cpu.key_bits, 1, 8, 64):
        on_gpu = None if weights is None else weights.cuda()
        again = dedup_batch(
            indices.cuda(), offsets.cuda(), ftab.cuda(), 5, batch, on_gpu, key_bits=guess
        )
        for name, a, b in zip(cpu._fields[:-1], cpu[:-1], again[:-1], strict=True):
            assert torch.equal(a, b.cpu()), (guess, name)
        assert again.key_bits == cpu.key_bits
    small = indices.remainder(1000)  # keys of 10 bits: a 16-bit guess sorts in two passes
    small_cpu = dedup_batch(small, offsets, ftab, 5, batch)
    # Combined (table, key) sort keys of 16 + 3 bits (sorted as uint32) and of 40 + 3 (uint64).
    for guess in (16, 40):
        small_gpu = dedup_batch(small.cuda(), offsets.cuda(), ftab.cuda(), 5, batch, key_bits=guess)
        for name, a, b in zip(small_cpu._fields[:-1], small_cpu[:-1], small_gpu[:-1], strict=True):
            assert torch.equal(a, b.cpu()), (guess, name)
        assert small_gpu.key_bits == small_cpu.key_bits == 10
    status = torch.randint(0, 4, (n,), generator=gen)
    cuts = [0, n // 3, n // 3, n - 5, n]
    assert status_counts(status.cuda(), cuts) == status_counts(status, cuts)
    many = torch.randint(0, 4, (5000,), generator=gen)  # 150 tables: three launches
    cuts_many = [0, *sorted(torch.randint(0, 5000, (149,), generator=gen).tolist()), 5000]
    assert status_counts(many.cuda(), cuts_many) == status_counts(many, cuts_many)
    tables, checks = index_tables(indices, offsets, ftab, 5, batch)
    on_gpu = index_tables(indices.cuda(), offsets.cuda(), ftab.cuda(), 5, batch)
    assert torch.equal(tables, on_gpu[0].cpu())
    assert torch.equal(checks, on_gpu[1].cpu())
    bad = indices.clone()
    bad[17] = -1
    with pytest.raises(ValueError, match="indices: contains -1"):
        check_batch(index_tables(bad.cuda(), offsets.cuda(), ftab.cuda(), 5, batch)[1], n, 4)
    with pytest.raises(ValueError, match="indices: contains -1"):
        dedup_batch(bad.cuda(), offsets.cuda(), ftab.cuda(), 5, batch)
    with pytest.raises(ValueError, match=r"feature_tables: 1 entries outside \[0, 5\)"):
        dedup_batch(indices.cuda(), offsets.cuda(), torch.tensor([0, 1, 2, 9]).cuda(), 5, batch)
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")  # no index: offsets still checked
    with pytest.raises(ValueError, match="offsets: must start at 0"):
        dedup_batch(empty, torch.tensor([0, 1]).cuda(), torch.tensor([0]).cuda(), 1, 1)
