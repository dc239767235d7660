"""``match_pairs`` (the lookup of (key, table) pairs among others that a caching table's
prefetched entries use) against a dict, over random pairs: repeated keys across tables, keys
asked twice, tables left out, the empty key, empty sides."""

from __future__ import annotations

import pytest
import torch
from demb_torchrec._cache_groups import match_pairs
from hypothesis import given, settings
from hypothesis import strategies as st

pairs = st.lists(st.tuples(st.integers(-1, 12), st.integers(0, 3)), max_size=40)


def _check(
    have: list[tuple[int, int]], want: list[tuple[int, int]], tables: list[int], device: str
) -> None:
    have = list(dict.fromkeys(have))  # distinct, as the callers' are
    position = {p: i for i, p in enumerate(have)}
    expect = [position.get(p, -1) if p[1] in tables else -1 for p in want]
    as_tensor = lambda xs, i: torch.tensor([x[i] for x in xs], dtype=torch.int64, device=device)  # noqa: E731
    got = match_pairs(
        as_tensor(have, 0), as_tensor(have, 1), as_tensor(want, 0), as_tensor(want, 1), tables
    )
    assert got.dtype == torch.int64
    assert got.device.type == device
    assert got.tolist() == expect


@settings(max_examples=200, deadline=None)
@given(have=pairs, want=pairs, tables=st.lists(st.integers(0, 3), unique=True, min_size=1))
def test_match_pairs_equals_a_dict(have, want, tables):
    _check(have, want, tables, "cpu")


@pytest.mark.cuda
@settings(max_examples=50, deadline=None)
@given(have=pairs, want=pairs, tables=st.lists(st.integers(0, 3), unique=True, min_size=1))
def test_match_pairs_equals_a_dict_on_cuda(have, want, tables):
    _check(have, want, tables, "cuda")


def test_a_large_batch_on_each_side():
    """5,000 distinct pairs over 10 tables (keys repeating across tables); 2,000 of them asked
    in another order, with 1,000 pairs that are not there."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 1000, (5000,), generator=gen) * (1 << 30)
    ids = torch.arange(5000) % 10
    keys = keys + torch.arange(5000) // 10  # distinct (key, table) pairs
    pick = torch.randperm(5000, generator=gen)[:2000]
    others = torch.randint(1 << 41, 1 << 42, (1000,), generator=gen)
    want_keys = torch.cat([keys[pick], others])
    want_ids = torch.cat([ids[pick], torch.zeros(1000, dtype=torch.int64)])
    got = match_pairs(keys, ids, want_keys, want_ids, list(range(10)))
    assert torch.equal(got, torch.cat([pick, torch.full((1000,), -1)]))
