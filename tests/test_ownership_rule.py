"""One ownership rule: demb_planner (numpy) == demb_kernels CPU op == pure-torch reference,
and the CUDA ops equal to the CPU ops (on a GPU machine)."""

from __future__ import annotations

import demb_planner
import numpy as np
import pytest
import torch
from demb_kernels import bucketize_by_owner, hash64, route_keys
from demb_kernels.reference import hash64_reference, route_keys_reference
from hypothesis import given, settings
from hypothesis import strategies as st

DISTS = ["continuous", "roundrobin", "hash_roundrobin"]
EXTREMES = [0, 1, -1, 2**63 - 1, -(2**63), -(2**63) + 1, 2**32, 2**31 - 1, -(2**31)]


def random_keys(n: int, seed: int) -> torch.Tensor:
    """``n`` int64 keys: full-range random ones (half negative), small ids, the extremes."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randint(-(2**63), 2**63 - 1, (n - n // 4 - len(EXTREMES),), generator=g)
    small = torch.randint(-1000, 100_000, (n // 4,), generator=g)
    return torch.cat([torch.tensor(EXTREMES, dtype=torch.int64), wide, small])


def planner_route(keys: torch.Tensor, world: int, dist: str, block: int | None):
    owner, local = demb_planner.route_keys(keys.numpy(), world, dist, block)
    return torch.from_numpy(owner), torch.from_numpy(local.view(np.int64))


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("world", [1, 3, 8])
def test_planner_equals_cpu_op_equals_reference_on_a_million_keys(dist, world):
    keys = random_keys(10**6, seed=world)
    assert (keys < 0).any()
    assert (keys == 0).any()
    block = demb_planner.continuous_block_size(50_000, world) if dist == "continuous" else None
    expected_owner, expected_local = planner_route(keys, world, dist, block)
    owner, local = route_keys(keys, world, dist, block)
    ref_owner, ref_local = route_keys_reference(keys, world, dist, block)
    for got in (owner, ref_owner):
        torch.testing.assert_close(got, expected_owner, rtol=0, atol=0)
    for got in (local, ref_local):
        torch.testing.assert_close(got, expected_local, rtol=0, atol=0)


def test_hash64_planner_equals_cpu_op_equals_reference():
    keys = random_keys(10**6, seed=7)
    expected = torch.from_numpy(demb_planner.hash64(keys.numpy()).view(np.int64))
    torch.testing.assert_close(hash64(keys), expected, rtol=0, atol=0)
    torch.testing.assert_close(hash64_reference(keys), expected, rtol=0, atol=0)


@settings(max_examples=200, deadline=None)
@given(
    world=st.integers(1, 16),
    dist=st.sampled_from(DISTS),
    rows=st.integers(1, 10**9),
    seed=st.integers(0, 2**31),
)
def test_rule_agrees_for_every_world_size_and_dist_type(world, dist, rows, seed):
    keys = random_keys(512, seed)
    block = demb_planner.continuous_block_size(rows, world) if dist == "continuous" else None
    expected_owner, expected_local = planner_route(keys, world, dist, block)
    owner, local = route_keys(keys, world, dist, block)
    torch.testing.assert_close(owner, expected_owner, rtol=0, atol=0)
    torch.testing.assert_close(local, expected_local, rtol=0, atol=0)
    # bucketizing routes each key to the planner's owner
    lengths = torch.tensor([200, 0, 312])
    out = bucketize_by_owner(
        lengths, keys, world, dist, block_sizes=None if block is None else torch.tensor([block])
    )
    per_rank = out.lengths.view(world, -1).sum(1)
    assert per_rank.tolist() == torch.bincount(expected_owner, minlength=world).tolist()


# ---------------------------------------------------------------------------- CUDA == CPU

TEN_MILLION = 10**7


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_cuda_hash64_equals_cpu(dtype):
    keys = random_keys(TEN_MILLION, seed=11).to(dtype)
    torch.testing.assert_close(hash64(keys.cuda()).cpu(), hash64(keys), rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("world", [1, 2, 7, 16])
def test_cuda_route_keys_equals_cpu_and_planner(dist, world):
    keys = random_keys(TEN_MILLION, seed=world)
    block = demb_planner.continuous_block_size(10**6, world) if dist == "continuous" else None
    owner, local = route_keys(keys.cuda(), world, dist, block)
    cpu_owner, cpu_local = route_keys(keys, world, dist, block)
    torch.testing.assert_close(owner.cpu(), cpu_owner, rtol=0, atol=0)
    torch.testing.assert_close(local.cpu(), cpu_local, rtol=0, atol=0)
    planner_owner, _ = planner_route(keys, world, dist, block)
    torch.testing.assert_close(owner.cpu(), planner_owner, rtol=0, atol=0)


@pytest.mark.cuda
@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("world", [1, 4, 16])
@pytest.mark.parametrize("len_dtype", [torch.int32, torch.int64])
def test_cuda_bucketize_equals_cpu(dist, world, len_dtype):
    features, batch = 4, 4096
    g = torch.Generator().manual_seed(world)
    lengths = torch.randint(0, 1200, (features * batch,), generator=g).to(len_dtype)
    lengths[5] = 0
    lengths[-1] = max(100_000, TEN_MILLION - int(lengths[:-1].sum()))  # one long segment
    keys = random_keys(int(lengths.sum()), seed=3)
    weights = torch.rand(keys.numel(), generator=g)
    blocks = (
        torch.tensor(
            [demb_planner.continuous_block_size(r, world) for r in (10, 10**3, 10**5, 10**9)]
        )
        if dist == "continuous"
        else None
    )
    assert keys.numel() >= TEN_MILLION
    got = bucketize_by_owner(
        lengths.cuda(),
        keys.cuda(),
        world,
        dist,
        weights.cuda(),
        None if blocks is None else blocks.cuda(),
    )
    expected = bucketize_by_owner(lengths, keys, world, dist, weights, blocks)
    torch.testing.assert_close(got.lengths.cpu(), expected.lengths, rtol=0, atol=0)
    torch.testing.assert_close(got.values.cpu(), expected.values, rtol=0, atol=0)
    assert got.weights is not None
    assert expected.weights is not None
    torch.testing.assert_close(got.weights.cpu(), expected.weights, rtol=0, atol=0)
    torch.testing.assert_close(
        got.unbucketize_permute.cpu(), expected.unbucketize_permute, rtol=0, atol=0
    )


@pytest.mark.cuda
def test_cuda_route_keys_bad_input():
    with pytest.raises(ValueError, match="world_size=0"):
        route_keys(torch.tensor([1], device="cuda"), 0, "roundrobin")
    with pytest.raises(TypeError, match="keys must be int64 or int32"):
        hash64(torch.tensor([1.0], device="cuda"))


@pytest.mark.cuda
def test_cuda_bucketize_int32_keys_and_bad_input():
    lengths = torch.tensor([3, 0, 2], device="cuda")
    keys = torch.tensor([5, -7, 2**31 - 1, 0, -1], dtype=torch.int32, device="cuda")
    got = bucketize_by_owner(lengths, keys, 3, "hash_roundrobin")
    expected = bucketize_by_owner(lengths.cpu(), keys.cpu(), 3, "hash_roundrobin")
    torch.testing.assert_close(got.values.cpu(), expected.values, rtol=0, atol=0)
    with pytest.raises(ValueError, match="lengths sum to 4"):
        bucketize_by_owner(torch.tensor([2, 2], device="cuda"), keys, 3, "roundrobin")
    with pytest.raises(ValueError, match="block_size=0"):
        bucketize_by_owner(
            lengths, keys, 3, "continuous", block_sizes=torch.tensor([0], device="cuda")
        )
    empty = bucketize_by_owner(
        torch.zeros(4, dtype=torch.int64, device="cuda"),
        torch.empty(0, dtype=torch.int64, device="cuda"),
        2,
        "roundrobin",
    )
    assert empty.lengths.tolist() == [0] * 8
    assert empty.values.numel() == 0
