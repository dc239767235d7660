"""The specification's import paths and sizing helpers, as code written for it uses them."""

from __future__ import annotations

import importlib
import math

import demb_torchrec
import pytest
import torch
from demb_torchrec import (
    BUCKET_ALIGNMENT,
    MAX_BUCKET_CAPACITY,
    DembError,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbOptimType,
    DynamicEmbParameterConstraints,
    DynamicEmbTableOptions,
    InputError,
    get_sharded_table_capacity,
    get_table_value_bytes,
)
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec.modules.embedding_configs import DataType, EmbeddingConfig

SPEC_PATHS = {  # what the spec imports, by module (its "dynamicemb" becomes "demb_torchrec")
    "demb_torchrec": [
        "BUCKET_ALIGNMENT",
        "MAX_BUCKET_CAPACITY",
        "BatchedDynamicEmbeddingTablesV2",
        "DynamicEmbCheckMode",
        "DynamicEmbDump",
        "DynamicEmbEvictStrategy",
        "DynamicEmbInitializerArgs",
        "DynamicEmbInitializerMode",
        "DynamicEmbLoad",
        "DynamicEmbOptimType",
        "DynamicEmbPoolingMode",
        "DynamicEmbScoreStrategy",
        "DynamicEmbTableOptions",
        "EvictedItemMode",
        "FTRL",
        "get_sharded_table_capacity",
        "get_table_value_bytes",
    ],
    "demb_torchrec.planner": [
        "DynamicEmbParameterConstraints",
        "DynamicEmbeddingEnumerator",
        "DynamicEmbeddingShardingPlanner",
    ],
    "demb_torchrec.shard": ["DynamicEmbeddingCollectionSharder"],
    "demb_torchrec.dynamicemb_config": ["DynamicEmbTableOptions", "complete_initializer_args"],
}


@pytest.mark.parametrize(("module", "names"), SPEC_PATHS.items())
def test_the_spec_s_import_paths_exist(module, names):
    imported = importlib.import_module(module)
    for name in names:
        assert getattr(imported, name) is not None, f"{module}.{name}"


def test_the_aliases_are_the_same_objects():
    from demb_torchrec import dynamicemb_config, planner, shard, sharders

    assert shard.DynamicEmbeddingCollectionSharder is sharders.DynamicEmbeddingCollectionSharder
    assert planner.DynamicEmbParameterConstraints is DynamicEmbParameterConstraints
    assert dynamicemb_config.DynamicEmbTableOptions is DynamicEmbTableOptions
    assert demb_torchrec.complete_initializer_args is dynamicemb_config.complete_initializer_args
    assert BUCKET_ALIGNMENT == 16
    assert MAX_BUCKET_CAPACITY == 2**63 - 1


def test_complete_initializer_args_fills_uniform_bounds():
    config = EmbeddingConfig(name="t", embedding_dim=4, num_embeddings=400, feature_names=["f"])
    partial = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.UNIFORM, upper=0.5)
    done = demb_torchrec.complete_initializer_args(partial, config)
    assert done.lower == pytest.approx(-math.sqrt(1 / 400))
    assert done.upper == 0.5


STATE_ELEMENTS = {  # per-row optimizer state, in elements of dim (row-wise Adagrad: bytes)
    EmbOptimType.SGD: lambda dim: 0,
    EmbOptimType.EXACT_SGD: lambda dim: 0,
    EmbOptimType.ADAM: lambda dim: 2 * dim,
    EmbOptimType.EXACT_ADAGRAD: lambda dim: dim,
    DynamicEmbOptimType.FTRL: lambda dim: 2 * dim,
}


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 10**7),
    dim=st.integers(1, 512),
    world=st.integers(1, 16),
    width=st.sampled_from([16, 64, 128, 1024, MAX_BUCKET_CAPACITY]),
    optimizer=st.sampled_from(list(STATE_ELEMENTS)),
    data_type=st.sampled_from([(DataType.FP32, 4), (DataType.FP16, 2), (DataType.BF16, 2)]),
)
def test_value_bytes_are_capacity_times_row_bytes(rows, dim, world, width, optimizer, data_type):
    dt, elem = data_type
    config = EmbeddingConfig(
        name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"], data_type=dt
    )
    per_rank = math.ceil(rows / world)
    if width == MAX_BUCKET_CAPACITY:
        capacity = math.ceil(per_rank / 16) * 16
    else:
        capacity = math.ceil(per_rank / width) * width
    assert get_sharded_table_capacity(config, world, width) == capacity
    row_bytes = (dim + STATE_ELEMENTS[optimizer](dim)) * elem
    assert get_table_value_bytes(config, optimizer, world, width) == world * capacity * row_bytes


def test_value_bytes_of_row_wise_adagrad_and_an_explicit_dtype():
    config = EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=1000, feature_names=["f"])
    rowwise = get_table_value_bytes(config, EmbOptimType.EXACT_ROWWISE_ADAGRAD, 2, 128)
    assert rowwise == 2 * 512 * (8 * 4 + 16)
    half = get_table_value_bytes(config, "sgd", 2, 128, embedding_dtype=torch.bfloat16)
    assert half == 2 * 512 * 8 * 2


def test_value_bytes_match_what_the_planner_plans():
    from demb_torchrec.constraints import prepare_table_options

    config = EmbeddingConfig(name="t", embedding_dim=16, num_embeddings=1000, feature_names=["f"])
    planned = prepare_table_options(DynamicEmbTableOptions(bucket_capacity=64), config, 3)
    assert planned.max_capacity == get_sharded_table_capacity(config, 3, 64)


def test_a_data_type_dynamic_tables_cannot_hold_is_named():
    config = EmbeddingConfig(
        name="clicks",
        embedding_dim=8,
        num_embeddings=10,
        feature_names=["f"],
        data_type=DataType.INT8,
    )
    with pytest.raises(InputError, match=r"table 'clicks': embedding_config.data_type: INT8"):
        get_table_value_bytes(config, "sgd", 1)
    with pytest.raises(DembError, match="optimizer"):
        get_table_value_bytes(
            EmbeddingConfig(name="t", embedding_dim=8, num_embeddings=10, feature_names=["f"]),
            "lamb",
            1,
        )
