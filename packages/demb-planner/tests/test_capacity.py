"""Capacity math against worked cases derived by hand from the spec's planner rules."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from demb_planner import (
    BUCKET_ALIGNMENT,
    MAX_BUCKET_CAPACITY,
    BucketLayout,
    PlannerConfigError,
    align_init_capacity,
    dtype_bytes,
    get_sharded_table_capacity,
    get_table_value_bytes,
    local_hbm_for_values,
    sharded_table_bucket_layout,
)
from hypothesis import given
from hypothesis import strategies as st


@dataclass(frozen=True)
class Config:
    num_embeddings: int
    embedding_dim: int = 8


# (num_embeddings, world_size, bucket_capacity) -> (num_buckets, bucket_width)
LAYOUT_CASES = [
    (1000, 1, 128, (8, 128)),  # 1000 -> 1024 = 8 * 128
    (1000, 3, 128, (3, 128)),  # ceil(1000/3) = 334 -> 384
    (1024, 8, 128, (1, 128)),  # 128 per rank exactly
    (1025, 8, 128, (2, 128)),  # ceil(1025/8) = 129 -> 256
    (10, 4, 16, (1, 16)),  # 3 rows per rank still take one bucket
    (10, 4, 1024, (1, 1024)),  # a bucket wider than the shard
    (1, 16, 16, (1, 16)),  # more ranks than rows
    (100, 2, MAX_BUCKET_CAPACITY, (1, 64)),  # sentinel: 50 -> aligned to 16 = 64
    (1000, 3, MAX_BUCKET_CAPACITY, (1, 336)),  # 334 -> 336
    (32, 2, MAX_BUCKET_CAPACITY, (1, 16)),  # 16 already aligned
    (2**40, 4, 128, (2**38 // 128, 128)),  # large tables stay exact (Python ints)
]


@pytest.mark.parametrize(("rows", "world", "bucket", "expected"), LAYOUT_CASES)
def test_layout_worked_cases(rows, world, bucket, expected):
    layout = sharded_table_bucket_layout(Config(rows), world, bucket)
    assert layout == BucketLayout(*expected)
    assert get_sharded_table_capacity(Config(rows), world, bucket) == expected[0] * expected[1]


@given(
    rows=st.integers(1, 10**12),
    world=st.integers(1, 64),
    width=st.one_of(
        st.integers(1, 64).map(lambda k: k * BUCKET_ALIGNMENT), st.just(MAX_BUCKET_CAPACITY)
    ),
)
def test_layout_invariants(rows, world, width):
    layout = sharded_table_bucket_layout(Config(rows), world, width)
    per_rank = -(-rows // world)
    assert layout.capacity >= per_rank  # every rank can hold its share
    assert layout.bucket_width % BUCKET_ALIGNMENT == 0
    if width == MAX_BUCKET_CAPACITY:
        assert layout.num_buckets == 1
        assert layout.bucket_width - per_rank < BUCKET_ALIGNMENT
    else:
        assert layout.bucket_width == width
        assert layout.capacity - per_rank < width  # no more than one bucket of slack


# (init_capacity, bucket_width, max_capacity) -> planner's init_capacity
INIT_CASES = [
    (None, 128, 1024, 1024),  # unset -> max_capacity
    (1, 128, 1024, 128),  # aligned up to the bucket width
    (128, 128, 1024, 128),
    (129, 128, 1024, 256),
    (1000, 128, 1024, 1024),  # aligned 1024, not clamped
    (5000, 128, 1024, 1024),  # clamped
    (1000, 128, 384, 384),
]


@pytest.mark.parametrize(("init", "width", "cap", "expected"), INIT_CASES)
def test_init_capacity_worked_cases(init, width, cap, expected):
    assert align_init_capacity(init, width, cap) == expected


@pytest.mark.parametrize(
    ("global_bytes", "world", "expected"),
    [(0, 4, 0), (10, 4, 3), (12, 4, 3), (13, 4, 4), (2**40 + 1, 2, 2**39 + 1), (7, 1, 7)],
)
def test_local_hbm_is_ceil_division(global_bytes, world, expected):
    assert local_hbm_for_values(global_bytes, world) == expected


# optimizer state per row for dim=8 float32 (then float16): SGD 0, Adam 2*dim, Adagrad dim,
# row-wise Adagrad 16 bytes, FTRL 2*dim
@pytest.mark.parametrize(
    ("dtype", "size"), [("float32", 4), ("torch.bfloat16", 2), ("fp16", 2), ("half", 2)]
)
def test_dtype_bytes(dtype, size):
    assert dtype_bytes(dtype) == size


def test_table_value_bytes_worked_case():
    # 1000 rows over 3 ranks, bucket 128 -> 384 slots per rank; dim 8 fp32 Adam: 32 + 64 bytes.
    assert get_table_value_bytes(Config(1000, 8), 64, 3, 128, 4) == 3 * 384 * 96
    # sentinel layout: 336 slots per rank; dim 8 bf16 row-wise Adagrad: 16 + 16 bytes
    assert get_table_value_bytes(Config(1000, 8), 16, 3, MAX_BUCKET_CAPACITY, 2) == 3 * 336 * 32
    # SGD keeps no state
    assert get_table_value_bytes(Config(1024, 4), 0, 8) == 8 * 128 * 16


@pytest.mark.parametrize("bucket", [0, -16, 8, 100, 130, 2**62 + 8])
def test_bad_bucket_capacity_names_it(bucket):
    with pytest.raises(PlannerConfigError, match=rf"bucket_capacity={bucket}"):
        get_sharded_table_capacity(Config(100), 2, bucket)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: get_sharded_table_capacity(Config(100), 0), "world_size=0"),
        (lambda: get_sharded_table_capacity(Config(100), -2), "world_size=-2"),
        (lambda: get_sharded_table_capacity(Config(0), 2), "num_embeddings=0"),
        (lambda: get_sharded_table_capacity(Config(100), 2.0), "world_size=2.0"),  # type: ignore[arg-type]
        (lambda: get_sharded_table_capacity(Config(100), True), "world_size=True"),
        (lambda: align_init_capacity(0, 128, 1024), "init_capacity=0"),
        (lambda: local_hbm_for_values(-1, 2), "global_hbm_for_values=-1"),
        (lambda: local_hbm_for_values(10, 0), "world_size=0"),
        (lambda: get_table_value_bytes(Config(10, 0), 0, 1), "embedding_dim=0"),
        (lambda: get_table_value_bytes(Config(10, 4), -4, 1), "optimizer_state_bytes=-4"),
        (lambda: dtype_bytes("int4"), "embedding_dtype='int4'"),
    ],
)
def test_bad_sizes_raise_value_error_naming_argument(call, argument):
    with pytest.raises(ValueError, match=argument.replace("(", r"\(").replace(".", r"\.")):
        call()
