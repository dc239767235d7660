"""lookup_rows (``demb::table_find_rows``) equals a lookup then a gather of its slots, leaves the
index unchanged, names bad arguments, and on CUDA equals the CPU bit for bit (marker ``cuda``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from demb_kernels import table as ops
from demb_kernels.lookup import gather_table_rows
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
def test_lookup_rows_is_a_lookup_then_a_gather(capacities, dim, extra, dtype, queries, seed):
    gen = torch.Generator().manual_seed(seed)
    index, values, keys, tables = filled_case(gen, capacities, dim + extra, dtype, 40, queries)
    before = snapshot(index)
    rows, slots = ops.lookup_rows(index, values, keys, tables, dim)
    expected_slots = ops.lookup(index, keys, tables)
    assert torch.equal(slots, expected_slots)
    assert rows.dtype == torch.float32
    assert rows.shape == (queries, dim)
    assert torch.equal(rows, gather_table_rows(values, expected_slots, tables, None, dim))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(index), strict=True))


def test_lookup_rows_names_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    index, values, keys, tables = filled_case(gen, [32, 64], 8, torch.float32, 20, 10)
    with pytest.raises(ValueError, match="values: 1 buffers for an index of 2 tables"):
        ops.lookup_rows(index, values[:1], keys, tables, 8)
    with pytest.raises(ValueError, match=r"values\[1\] has 10 rows for a table of 64 slots"):
        ops.lookup_rows(index, [values[0], values[1][:10]], keys, tables, 8)
    with pytest.raises(ValueError, match="width >= 9"):
        ops.lookup_rows(index, values, keys, tables, 9)
    with pytest.raises(TypeError, match="one dtype for all tables"):
        ops.lookup_rows(index, [values[0], values[1].half()], keys, tables, 8)
    with pytest.raises(ValueError, match="out of range"):
        ops.lookup_rows(index, values, keys, torch.full_like(tables, 2), 8)
    with pytest.raises(ValueError, match="empty-key sentinel"):
        ops.lookup_rows(index, values, torch.full_like(keys, -1), tables, 8)
    with pytest.raises(TypeError, match="keys must be int64 or int32"):
        ops.lookup_rows(index, values, keys.float(), tables, 8)


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
def test_cuda_lookup_rows_equals_cpu(dtype, dim, extra):
    """Every CUDA path (4 rows of one float4 per lane, wide 16-byte rows, scalar rows), tails of
    keys, and invalid entries (unchecked: they read as missing)."""
    gen = torch.Generator().manual_seed(3)
    index, values, keys, tables = filled_case(
        gen, [4096, 2048, 8192], dim + extra, dtype, 5000, 30_001
    )
    cpu_rows, cpu_slots = ops.lookup_rows(index, values, keys, tables, dim)
    gpu_index = on_cuda(index)
    before = snapshot(gpu_index)
    gpu_values = [v.cuda() for v in values]
    rows, slots = ops.lookup_rows(gpu_index, gpu_values, keys.cuda(), tables.cuda(), dim)
    assert torch.equal(slots.cpu(), cpu_slots)
    assert torch.equal(rows.cpu(), cpu_rows)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(gpu_index), strict=True))
    bad_keys, bad_tables = keys.clone(), tables.clone()
    bad_keys[::7] = -1
    bad_tables[3::11] = 5
    rows, slots = ops.lookup_rows(
        gpu_index, gpu_values, bad_keys.cuda(), bad_tables.cuda(), dim, check=False
    )
    invalid = (bad_keys == -1) | (bad_tables == 5)
    assert torch.equal(slots.cpu()[invalid], torch.full((int(invalid.sum()),), -1))
    assert not rows.cpu()[invalid].any()
    assert torch.equal(slots.cpu()[~invalid], cpu_slots[~invalid])
    assert torch.equal(rows.cpu()[~invalid], cpu_rows[~invalid])
    with pytest.raises(ValueError, match="table_ids: out of range"):
        ops.lookup_rows(gpu_index, gpu_values, bad_keys.cuda(), bad_tables.cuda(), dim)
