"""find_rows (``demb::table_find_rows``) equals a lookup then a gather of its slots, leaves the
index unchanged, names bad arguments, and on CUDA equals the CPU bit for bit (marker ``cuda``).
find_batch_rows (``demb::table_find_batch_rows``), each index's table taken from its feature,
equals find_rows of index_tables' tables; on CUDA the CPU, with few features (kept in shared
memory) and many (read from the offsets); bad offsets or feature tables read as missing keys."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from demb_kernels import table as ops
from demb_kernels.lookup import gather_table_rows, index_tables
from demb_kernels.table import ScorePolicy, TableIndex
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def filled_case(
    gen: torch.Generator,
    capacities: list[int],
    width: int,
    dtype: torch.dtype,
    inserted: int,
    queries: int,
) -> tuple[TableIndex, list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """An index of ``len(capacities)`` tables holding keys of ``[0, 4 * inserted)``, random value
    rows of ``width`` columns, and a batch of queries of which about half are present."""
    num_tables = len(capacities)
    index = TableIndex.create(capacities, [16] * num_tables, [ScorePolicy.STEP] * num_tables)
    keys = torch.randint(0, 4 * inserted, (inserted,), generator=gen)
    tables = torch.randint(0, num_tables, (inserted,), generator=gen)
    ops.find_or_insert(index, keys, tables, torch.ones(num_tables, dtype=torch.int64))
    values = [torch.randn(c, width, generator=gen).to(dtype) for c in capacities]
    q_keys = torch.randint(0, 8 * inserted, (queries,), generator=gen)
    q_tables = torch.randint(0, num_tables, (queries,), generator=gen)
    return index, values, q_keys, q_tables


def snapshot(index: TableIndex) -> list[torch.Tensor]:
    return [t.clone() for t in (index.keys, index.digests, index.scores, index.sizes)]


@settings(max_examples=40, deadline=None)
@given(
    capacities=st.lists(st.sampled_from([16, 32, 64, 128]), min_size=1, max_size=4),
    dim=st.integers(1, 140),
    extra=st.sampled_from([0, 3, 8]),
    dtype=st.sampled_from(DTYPES),
    queries=st.integers(0, 200),
    seed=st.integers(0, 2**31),
)
def test_find_rows_is_a_lookup_then_a_gather(capacities, dim, extra, dtype, queries, seed):
    gen = torch.Generator().manual_seed(seed)
    index, values, keys, tables = filled_case(gen, capacities, dim + extra, dtype, 40, queries)
    before = snapshot(index)
    rows, slots = ops.find_rows(index, values, keys, tables, dim)
    expected_slots = ops.find(index, keys, tables)
    assert torch.equal(slots, expected_slots)
    assert rows.dtype == torch.float32
    assert rows.shape == (queries, dim)
    assert torch.equal(rows, gather_table_rows(values, expected_slots, tables, None, dim))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(index), strict=True))


def test_find_rows_names_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    index, values, keys, tables = filled_case(gen, [32, 64], 8, torch.float32, 20, 10)
    with pytest.raises(ValueError, match="values: 1 buffers for an index of 2 tables"):
        ops.find_rows(index, values[:1], keys, tables, 8)
    with pytest.raises(ValueError, match=r"values\[1\] has 10 rows for a table of 64 slots"):
        ops.find_rows(index, [values[0], values[1][:10]], keys, tables, 8)
    with pytest.raises(ValueError, match="width >= 9"):
        ops.find_rows(index, values, keys, tables, 9)
    with pytest.raises(TypeError, match="one dtype for all tables"):
        ops.find_rows(index, [values[0], values[1].half()], keys, tables, 8)
    with pytest.raises(ValueError, match="out of range"):
        ops.find_rows(index, values, keys, torch.full_like(tables, 2), 8)
    with pytest.raises(ValueError, match="empty-key sentinel"):
        ops.find_rows(index, values, torch.full_like(keys, -1), tables, 8)
    with pytest.raises(TypeError, match="keys must be int64 or int32"):
        ops.find_rows(index, values, keys.float(), tables, 8)


def on_cuda(index: TableIndex) -> TableIndex:
    moved = {
        f.name: getattr(index, f.name).cuda()
        for f in dataclasses.fields(index)
        if isinstance(getattr(index, f.name), torch.Tensor)
    }
    return dataclasses.replace(index, **moved)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "extra"), [(128, 0), (64, 4), (130, 2), (256, 0), (33, 0)])
def test_cuda_find_rows_equals_cpu(dtype, dim, extra):
    """Every CUDA path (4 rows of one float4 per lane, wide 16-byte rows, scalar rows), tails of
    keys, and invalid entries (unchecked: they read as missing)."""
    gen = torch.Generator().manual_seed(3)
    index, values, keys, tables = filled_case(
        gen, [4096, 2048, 8192], dim + extra, dtype, 5000, 30_001
    )
    cpu_rows, cpu_slots = ops.find_rows(index, values, keys, tables, dim)
    gpu_index = on_cuda(index)
    before = snapshot(gpu_index)
    gpu_values = [v.cuda() for v in values]
    rows, slots = ops.find_rows(gpu_index, gpu_values, keys.cuda(), tables.cuda(), dim)
    assert torch.equal(slots.cpu(), cpu_slots)
    assert torch.equal(rows.cpu(), cpu_rows)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(gpu_index), strict=True))
    bad_keys, bad_tables = keys.clone(), tables.clone()
    bad_keys[::7] = -1
    bad_tables[3::11] = 5
    rows, slots = ops.find_rows(
        gpu_index, gpu_values, bad_keys.cuda(), bad_tables.cuda(), dim, check=False
    )
    invalid = (bad_keys == -1) | (bad_tables == 5)
    assert torch.equal(slots.cpu()[invalid], torch.full((int(invalid.sum()),), -1))
    assert not rows.cpu()[invalid].any()
    assert torch.equal(slots.cpu()[~invalid], cpu_slots[~invalid])
    assert torch.equal(rows.cpu()[~invalid], cpu_rows[~invalid])
    with pytest.raises(ValueError, match="table_ids: out of range"):
        ops.find_rows(gpu_index, gpu_values, bad_keys.cuda(), bad_tables.cuda(), dim)


def batch(gen: torch.Generator, n: int, features: int, batch_size: int, tables: int):
    """Offsets of ``features * batch_size`` random bags over ``n`` indices, and a feature->table
    map."""
    cuts = torch.sort(torch.randint(0, n + 1, (features * batch_size - 1,), generator=gen))[0]
    offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])
    feature_tables = torch.randint(0, tables, (features,), generator=gen)
    return offsets, feature_tables


@settings(max_examples=30, deadline=None)
@given(
    tables=st.integers(1, 4),
    features=st.integers(1, 6),
    batch_size=st.integers(1, 5),
    n=st.integers(0, 150),
    dim=st.integers(1, 40),
    seed=st.integers(0, 2**31),
)
def test_batch_rows_are_find_rows_of_the_feature_tables(tables, features, batch_size, n, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    index, values, _, _ = filled_case(gen, [64] * tables, dim + 2, torch.float32, 40, 0)
    keys = torch.randint(0, 160, (n,), generator=gen)
    offsets, feature_tables = batch(gen, n, features, batch_size, tables)
    rows, slots = ops.find_batch_rows(index, values, keys, offsets, feature_tables, batch_size, dim)
    per_index, _ = index_tables(keys, offsets, feature_tables, tables, batch_size)
    want_rows, want_slots = ops.find_rows(index, values, keys, per_index, dim)
    assert torch.equal(slots, want_slots)
    assert torch.equal(rows, want_rows)


def test_cpu_raises_on_a_feature_table_out_of_range():
    gen = torch.Generator().manual_seed(1)
    index, values, keys, _ = filled_case(gen, [64, 64], 8, torch.float32, 40, 20)
    offsets = torch.arange(0, 21, 10)
    bad = torch.tensor([0, 2])
    with pytest.raises(ValueError, match=r"table_ids\[10\]=2 is out of range"):
        ops.find_batch_rows(index, values, keys, offsets, bad, 1, 8, check=False)
    with pytest.raises(ValueError, match=r"feature_tables: 1 entries outside \[0, 2\)"):
        ops.find_batch_rows(index, values, keys, offsets, bad, 1, 8)
    with pytest.raises(ValueError, match="batch_size"):
        ops.find_batch_rows(index, values, keys, offsets, torch.tensor([0, 1]), 0, 8)


def check_cases(keys: torch.Tensor, offsets: torch.Tensor, tables: torch.Tensor):
    """(name, keys, offsets, feature tables, the error's pattern) of batches the checks
    refuse."""
    empty_key = keys.clone()
    empty_key[-1] = -1
    late = offsets.clone()
    late[0] = 1
    short = offsets.clone()
    short[-1] -= 1
    down = offsets.clone()
    down[1] = offsets[2] + 1  # above offsets[2]: one decrease
    bad_table = tables.clone()
    bad_table[-1] = -1
    ok = (keys, offsets, tables)
    return [
        ("empty key", (empty_key, offsets, tables), "indices: contains -1"),
        ("offsets[0]", (keys, late, tables), "offsets: must start at 0"),
        ("offsets[-1]", (keys, short, tables), "offsets: must start at 0"),
        ("decrease", (keys, down, tables), "offsets: must start at 0"),
        ("table", (keys, offsets, bad_table), r"feature_tables: 1 entries outside \[0, 2\)"),
        ("ok", ok, None),
    ]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_checked_batches_raise_naming_the_argument(device):
    gen = torch.Generator().manual_seed(2)
    index, values, keys, _ = filled_case(gen, [64, 64], 8, torch.float32, 40, 20)
    if device == "cuda":
        index, values = on_cuda(index), [v.cuda() for v in values]
    offsets = torch.tensor([0, 3, 10, 14, 20])  # 2 features x batch 2
    for name, (k, o, t), error in check_cases(keys, offsets, torch.tensor([0, 1])):
        args = (index, values, k.to(device), o.to(device), t.to(device), 2, 8)
        if error is None:
            rows, slots = ops.find_batch_rows(*args)
            assert torch.equal(rows.cpu(), ops.find_batch_rows(*args, check=False)[0].cpu())
            assert (slots >= 0).any(), name
        else:
            with pytest.raises(ValueError, match=error):
                ops.find_batch_rows(*args)


@pytest.mark.cuda
@pytest.mark.parametrize(("features", "batch_size"), [(10, 300), (3, 1000), (300, 10)])
@pytest.mark.parametrize(("dim", "extra", "dtype"), [(128, 0, torch.float32), (33, 2, torch.half)])
def test_cuda_batch_rows_equal_cpu(features, batch_size, dim, extra, dtype):
    gen = torch.Generator().manual_seed(features)
    index, values, _, _ = filled_case(gen, [4096, 2048, 8192], dim + extra, dtype, 5000, 0)
    n = 30_001
    keys = torch.randint(0, 40_000, (n,), generator=gen)
    offsets, feature_tables = batch(gen, n, features, batch_size, 3)
    cpu_rows, cpu_slots = ops.find_batch_rows(
        index, values, keys, offsets, feature_tables, batch_size, dim
    )
    gpu_index, gpu_values = on_cuda(index), [v.cuda() for v in values]
    rows, slots = ops.find_batch_rows(
        gpu_index, gpu_values, keys.cuda(), offsets.cuda(), feature_tables.cuda(), batch_size, dim
    )
    assert torch.equal(slots.cpu(), cpu_slots)
    assert torch.equal(rows.cpu(), cpu_rows)
    bad_tables = feature_tables.clone()
    bad_tables[0] = 7  # out of range: feature 0's indices read as missing
    gpu_batch = (keys.cuda(), offsets.cuda(), bad_tables.cuda(), batch_size, dim)
    rows, slots = ops.find_batch_rows(gpu_index, gpu_values, *gpu_batch, check=False)
    with pytest.raises(ValueError, match="feature_tables: 1 entries outside"):
        ops.find_batch_rows(gpu_index, gpu_values, *gpu_batch)
    mine = torch.arange(n) < offsets[batch_size]
    assert (slots.cpu()[mine] == -1).all()
    assert not rows.cpu()[mine].any()
    assert torch.equal(slots.cpu()[~mine], cpu_slots[~mine])
    bad_offsets = offsets.clone()
    bad_offsets[1:-1] = bad_offsets[1:-1].flip(0)  # decreasing: no read out of bounds
    gpu_batch = (keys.cuda(), bad_offsets.cuda(), feature_tables.cuda(), batch_size, dim)
    rows, slots = ops.find_batch_rows(gpu_index, gpu_values, *gpu_batch, check=False)
    with pytest.raises(ValueError, match="offsets: must start at 0, never decrease"):
        ops.find_batch_rows(gpu_index, gpu_values, *gpu_batch)
    assert rows.shape == (n, dim)
    assert (slots.cpu() >= -1).all()
