"""The ownership rule in numpy against an independent model in Python integers."""

from __future__ import annotations

import numpy as np
import pytest
from demb_planner import (
    DistType,
    PlannerConfigError,
    continuous_block_size,
    hash64,
    local_position,
    owner_rank,
    route_keys,
)
from hypothesis import given
from hypothesis import strategies as st

MASK = 2**64 - 1
INT64 = st.integers(-(2**63), 2**63 - 1)


def fmix64_int(k: int) -> int:
    """MurmurHash3 fmix64 in Python integers (the published algorithm)."""
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & MASK
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & MASK
    return k ^ (k >> 33)


def route_int(key: int, world: int, dist: str, block: int | None) -> tuple[int, int]:
    u = key & MASK
    if dist == "hash_roundrobin":
        u = fmix64_int(u)
    if dist == "continuous" and block is not None and u < block * world:
        return u // block, u % block
    return u % world, u // world


def test_fmix64_known_values():
    # Published fmix64 values: fmix64(0) == 0 and the avalanche of 1.
    assert hash64(np.array([0]))[0] == 0
    assert int(hash64(np.array([1]))[0]) == 0xB456BCFC34C2CB2C


@given(keys=st.lists(INT64, max_size=64))
def test_hash64_matches_python_integers(keys):
    got = hash64(np.array(keys, dtype=np.int64))
    assert [int(h) for h in got] == [fmix64_int(k & MASK) for k in keys]


@given(
    keys=st.lists(INT64, max_size=64),
    world=st.integers(1, 16),
    dist=st.sampled_from([d.value for d in DistType]),
    rows=st.integers(1, 2**40),
)
def test_route_matches_python_integers(keys, world, dist, rows):
    block = continuous_block_size(rows, world) if dist == "continuous" else None
    owner, local = route_keys(np.array(keys, dtype=np.int64), world, dist, block)
    expected = [route_int(k, world, dist, block) for k in keys]
    assert [(int(o), int(p)) for o, p in zip(owner, local, strict=True)] == expected
    assert ((owner >= 0) & (owner < world)).all()


@given(
    keys=st.sets(INT64, max_size=200),
    world=st.integers(1, 16),
    dist=st.sampled_from([d.value for d in DistType]),
)
def test_owner_and_local_identify_the_key(keys, world, dist):
    block = 7 if dist == "continuous" else None
    owner, local = route_keys(np.array(sorted(keys), dtype=np.int64), world, dist, block)
    assert len(set(zip(owner.tolist(), local.tolist(), strict=True))) == len(keys)


def test_worked_examples():
    keys = np.array([0, 1, 5, 9, -1, 2**63 - 1, -(2**63)], dtype=np.int64)
    assert owner_rank(keys, 4, "roundrobin").tolist() == [0, 1, 1, 1, 3, 3, 0]
    assert local_position(keys, 4, "roundrobin").tolist() == [
        0,
        0,
        1,
        2,
        2**62 - 1,
        2**61 - 1,
        2**61,
    ]
    # continuous, 10 rows over 4 ranks: block 3; rows 0-2 rank 0, ..., 9-11 rank 3; the rest
    # (and every negative key) falls back to round-robin
    block = continuous_block_size(10, 4)
    assert block == 3
    assert owner_rank(np.arange(14), 4, "continuous", block).tolist() == [
        0,
        0,
        0,
        1,
        1,
        1,
        2,
        2,
        2,
        3,
        3,
        3,
        0,
        1,
    ]
    assert local_position(np.arange(14), 4, "continuous", block).tolist() == [
        0,
        1,
        2,
        0,
        1,
        2,
        0,
        1,
        2,
        0,
        1,
        2,
        3,
        3,
    ]
    assert owner_rank(np.array([-1]), 4, "continuous", block).tolist() == [3]


def test_int32_keys_are_sign_extended():
    small = np.array([-5, -1, 0, 7], dtype=np.int32)
    for dist in ("roundrobin", "hash_roundrobin"):
        np.testing.assert_array_equal(
            owner_rank(small, 5, dist), owner_rank(small.astype(np.int64), 5, dist)
        )


def test_hash_roundrobin_spreads_strided_keys():
    # Plain modulo sends every multiple of 8 to rank 0; the hash spreads them.
    keys = np.arange(0, 8 * 4096, 8, dtype=np.int64)
    assert set(owner_rank(keys, 8, "roundrobin").tolist()) == {0}
    counts = np.bincount(owner_rank(keys, 8, "hash_roundrobin"), minlength=8)
    assert counts.min() > 4096 / 8 * 0.8


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"world_size": 0, "dist_type": "roundrobin"}, "world_size=0"),
        ({"world_size": -3, "dist_type": "roundrobin"}, "world_size=-3"),
        ({"world_size": 2, "dist_type": "modulo"}, "dist_type='modulo'"),
        ({"world_size": 2, "dist_type": "continuous"}, "block_size=None"),
        ({"world_size": 2, "dist_type": "continuous", "block_size": 0}, "block_size=0"),
        ({"world_size": 2, "dist_type": "roundrobin", "block_size": 4}, "block_size=4"),
        ({"world_size": 2, "dist_type": "continuous", "block_size": 2**63}, "block_size="),
    ],
)
def test_bad_routing_arguments(kwargs, argument):
    with pytest.raises(PlannerConfigError, match=argument):
        route_keys(np.array([1, 2], dtype=np.int64), **kwargs)


@pytest.mark.parametrize(
    "keys", [np.array([1.0, 2.0]), np.array([True, False]), np.array(["a"]), [0.5]]
)
def test_non_integer_keys_are_rejected(keys):
    with pytest.raises(PlannerConfigError, match="keys="):
        route_keys(keys, 2, "roundrobin")
    with pytest.raises(PlannerConfigError, match="keys="):
        hash64(keys)
