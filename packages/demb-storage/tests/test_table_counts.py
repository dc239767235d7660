"""per_table_counts against bincount, on both of its paths (a one-hot reduction up to
ONE_HOT_TABLES tables, index_add_ beyond), with and without a mask."""

from __future__ import annotations

import pytest
import torch
from demb_storage import per_table_counts
from demb_storage.table_counts import ONE_HOT_TABLES
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=40, deadline=None)
@given(
    num_tables=st.sampled_from([1, 3, ONE_HOT_TABLES, ONE_HOT_TABLES + 1, 200]),
    n=st.integers(0, 300),
    masked=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_counts_equal_bincount(num_tables, n, masked, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, num_tables, (n,), generator=gen)
    mask = torch.rand(n, generator=gen) < 0.5 if masked else None
    want = torch.bincount(ids if mask is None else ids[mask], minlength=num_tables)
    got = per_table_counts(ids, num_tables, mask)
    assert got.dtype == torch.int64
    assert torch.equal(got, want)


@pytest.mark.cuda
def test_counts_on_cuda_equal_the_cpu():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 10, (100_000,), generator=gen)
    mask = torch.rand(100_000, generator=gen) < 0.3
    for t, m in ((10, None), (10, mask), (100, mask)):
        cpu = per_table_counts(ids % t, t, m)
        cuda = per_table_counts((ids % t).cuda(), t, None if m is None else m.cuda())
        assert torch.equal(cuda.cpu(), cpu)
