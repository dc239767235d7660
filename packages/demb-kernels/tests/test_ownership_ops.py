"""The ownership ops (CPU kernels) against the pure-PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from demb_kernels import bucketize_by_owner, hash64, route_keys
from demb_kernels.reference import (
    bucketize_by_owner_reference,
    hash64_reference,
    route_keys_reference,
)
from hypothesis import given, settings
from hypothesis import strategies as st

DISTS = ["continuous", "roundrobin", "hash_roundrobin"]
INT64 = st.integers(-(2**63), 2**63 - 1)
EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), 2**32, 2**32 - 1, -(2**32)]


def assert_bucketized_equal(got, expected):
    torch.testing.assert_close(got.lengths, expected.lengths, rtol=0, atol=0)
    torch.testing.assert_close(got.values, expected.values, rtol=0, atol=0)
    torch.testing.assert_close(
        got.unbucketize_permute, expected.unbucketize_permute, rtol=0, atol=0
    )
    if expected.weights is None:
        assert got.weights is None
    else:
        torch.testing.assert_close(got.weights, expected.weights, rtol=0, atol=0)


@given(keys=st.lists(INT64, max_size=100), dtype=st.sampled_from([torch.int64, torch.int32]))
def test_hash64_matches_reference(keys, dtype):
    t = torch.tensor(keys + EXTREMES, dtype=torch.int64)
    if dtype == torch.int32:
        t = t.to(torch.int32)  # wraps; both sides see the same int32 keys
    torch.testing.assert_close(hash64(t), hash64_reference(t), rtol=0, atol=0)


@given(
    keys=st.lists(INT64, max_size=100),
    world=st.integers(1, 16),
    dist=st.sampled_from(DISTS),
    block=st.integers(1, 2**30),
    dtype=st.sampled_from([torch.int64, torch.int32]),
)
def test_route_keys_matches_reference(keys, world, dist, block, dtype):
    t = torch.tensor(keys + EXTREMES, dtype=torch.int64).to(dtype)
    block_size = block if dist == "continuous" else None
    owner, local = route_keys(t, world, dist, block_size)
    ref_owner, ref_local = route_keys_reference(t, world, dist, block_size)
    torch.testing.assert_close(owner, ref_owner, rtol=0, atol=0)
    torch.testing.assert_close(local, ref_local, rtol=0, atol=0)


@st.composite
def jagged_batches(draw):
    features = draw(st.integers(1, 4))
    batch = draw(st.integers(0, 6))
    lengths = draw(
        st.lists(st.integers(0, 8), min_size=features * batch, max_size=features * batch)
    )
    n = sum(lengths)
    small = draw(st.booleans())  # small keys exercise continuous' in-range branch
    keys = st.integers(-5, 60) if small else INT64
    values = draw(st.lists(keys, min_size=n, max_size=n))
    return features, lengths, values


@settings(max_examples=150)
@given(
    batch=jagged_batches(),
    world=st.integers(1, 16),
    dist=st.sampled_from(DISTS),
    len_dtype=st.sampled_from([torch.int64, torch.int32]),
    key_dtype=st.sampled_from([torch.int64, torch.int32]),
    weighted=st.sampled_from([None, torch.float32, torch.float16, torch.float64]),
    blocks=st.lists(st.integers(1, 20), min_size=4, max_size=4),
)
def test_bucketize_matches_reference(batch, world, dist, len_dtype, key_dtype, weighted, blocks):
    features, lengths_list, values_list = batch
    lengths = torch.tensor(lengths_list, dtype=len_dtype)
    values = torch.tensor(values_list, dtype=torch.int64).to(key_dtype)
    weights = None if weighted is None else torch.randn(values.numel()).to(weighted)
    block_sizes = (
        torch.tensor(blocks[:features], dtype=torch.int64) if dist == "continuous" else None
    )
    got = bucketize_by_owner(lengths, values, world, dist, weights, block_sizes)
    expected = bucketize_by_owner_reference(lengths, values, world, dist, weights, block_sizes)
    assert_bucketized_equal(got, expected)
    assert got.lengths.dtype == len_dtype
    assert got.values.dtype == key_dtype
    # the permutation puts results back in input order
    torch.testing.assert_close(got.values[got.unbucketize_permute], values, rtol=0, atol=0)


def test_bucketize_worked_example():
    # two features x two samples, world 2, roundrobin
    lengths = torch.tensor([2, 1, 0, 3])
    values = torch.tensor([10, 11, 12, 13, 14, 15])
    w = torch.arange(6, dtype=torch.float32)
    out = bucketize_by_owner(lengths, values, 2, "roundrobin", weights=w)
    assert out.lengths.tolist() == [1, 1, 0, 1, 1, 0, 0, 2]
    assert out.values.tolist() == [10, 12, 14, 11, 13, 15]
    assert out.weights is not None
    assert out.weights.tolist() == [0.0, 2.0, 4.0, 1.0, 3.0, 5.0]
    assert out.unbucketize_permute.tolist() == [0, 3, 1, 4, 2, 5]


def test_bucketize_continuous_uses_each_features_block():
    # feature 0 has block 2, feature 1 block 5; world 2; one sample per feature
    lengths = torch.tensor([4, 4])
    values = torch.tensor([0, 1, 2, 3, 0, 4, 5, 9])
    out = bucketize_by_owner(lengths, values, 2, "continuous", block_sizes=torch.tensor([2, 5]))
    # f0: 0,1 -> rank 0; 2,3 -> rank 1.  f1: 0,4 -> rank 0; 5,9 -> rank 1
    assert out.lengths.tolist() == [2, 2, 2, 2]
    assert out.values.tolist() == [0, 1, 0, 4, 2, 3, 5, 9]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"world_size": 0}, ValueError, "world_size=0"),
        ({"dist_type": "modulo"}, ValueError, "dist_type='modulo'"),
        ({"values": torch.tensor([1.0, 2.0, 3.0])}, TypeError, "values must be int64 or int32"),
        ({"lengths": torch.tensor([1.0, 2.0])}, TypeError, "lengths must be int64 or int32"),
        ({"lengths": torch.tensor([1, 1])}, ValueError, "lengths sum to 2"),
        ({"lengths": torch.tensor([4, -1])}, ValueError, "non-negative"),
        ({"weights": torch.tensor([1, 2, 3])}, TypeError, "weights must be floating"),
        ({"weights": torch.ones(2)}, ValueError, "one weight per value"),
        ({"block_sizes": torch.tensor([3])}, ValueError, "block_sizes only applies"),
        ({"dist_type": "continuous"}, ValueError, "needs block_sizes"),
        (
            {"dist_type": "continuous", "block_sizes": torch.tensor([0, 1])},
            ValueError,
            "block_size=0",
        ),
        (
            {"dist_type": "continuous", "block_sizes": torch.tensor([1, 2, 3])},
            ValueError,
            "not a multiple of the 3 features",
        ),
    ],
)
def test_bucketize_bad_input(kwargs, error, match):
    args = {
        "lengths": torch.tensor([1, 2]),
        "values": torch.tensor([1, 2, 3]),
        "world_size": 2,
        "dist_type": "roundrobin",
    } | kwargs
    with pytest.raises(error, match=match):
        bucketize_by_owner(**args)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((torch.tensor([1.5]), 2, "roundrobin"), TypeError, "keys must be int64 or int32"),
        ((torch.tensor([True]), 2, "roundrobin"), TypeError, "keys must be int64 or int32"),
        ((torch.tensor([1]), 0, "roundrobin"), ValueError, "world_size=0"),
        ((torch.tensor([1]), 2, "hash"), ValueError, "dist_type='hash'"),
        ((torch.tensor([1]), 2, "continuous"), ValueError, "block_size=0"),
        ((torch.tensor([1]), 2, "roundrobin", 3), ValueError, "block_size=3"),
        ((torch.tensor([1]), 4, "continuous", 2**62), ValueError, "must be < 2\\*\\*64"),
    ],
)
def test_route_keys_bad_input(args, error, match):
    with pytest.raises(error, match=match):
        route_keys(*args)


def test_hash64_rejects_float_keys():
    with pytest.raises(TypeError, match="keys must be int64 or int32"):
        hash64(torch.tensor([0.5]))


def test_fake_kernels_give_shapes_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        lengths = torch.empty(6, dtype=torch.int32)
        values = torch.empty(40, dtype=torch.int64)
        out = bucketize_by_owner(lengths, values, 4, "roundrobin", torch.empty(40))
        assert out.lengths.shape == (24,)
        assert out.lengths.dtype == torch.int32
        assert out.values.shape == (40,)
        assert out.weights is not None
        assert out.weights.shape == (40,)
        owner, local = route_keys(values, 4, "hash_roundrobin")
        assert owner.shape == local.shape == (40,)
        assert hash64(values).dtype == torch.int64
