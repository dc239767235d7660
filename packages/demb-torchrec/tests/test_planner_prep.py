"""The planner's checks of its inputs and its per-rank preparation of a dynamic table's options
(spec: "Sharding planner", steps 1-3), against the spec's rules written out independently."""

from __future__ import annotations

import math

import pytest
from demb_planner import MAX_BUCKET_CAPACITY, PlannerConfigError
from demb_storage import TableConfigError
from demb_torchrec import (
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbParameterConstraints,
    DynamicEmbTableOptions,
)
from demb_torchrec.constraints import (
    check_constraints,
    complete_initializer_args,
    prepare_table_options,
)
from demb_torchrec.options import table_config
from hypothesis import given, settings
from hypothesis import strategies as st
from torchrec import EmbeddingBagConfig, EmbeddingConfig
from torchrec.distributed.planner.types import ParameterConstraints

UNIFORM = DynamicEmbInitializerMode.UNIFORM


def config(name: str = "t", rows: int = 1000, dim: int = 16) -> EmbeddingConfig:
    return EmbeddingConfig(name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[name])


def test_constraints_are_torchrec_constraints_with_their_own_options():
    a, b = DynamicEmbParameterConstraints(), DynamicEmbParameterConstraints(use_dynamicemb=True)
    assert isinstance(a, ParameterConstraints)
    assert a.use_dynamicemb is False
    assert b.use_dynamicemb is True
    assert a.dynamicemb_options == DynamicEmbTableOptions()
    assert a.dynamicemb_options is not b.dynamicemb_options  # no shared mutable default
    c = DynamicEmbParameterConstraints(sharding_types=["row_wise"], use_dynamicemb=True)
    assert isinstance(hash(c), int)  # hashable, as TorchRec's planner needs
    assert c.sharding_types == ["row_wise"]


def test_every_table_once_and_constraints_match():
    bag = EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=10, feature_names=["fb"])
    configs = [config("a"), bag]
    both = {"a": DynamicEmbParameterConstraints(use_dynamicemb=True), "b": ParameterConstraints()}
    check_constraints(configs, both)
    check_constraints(configs, None)
    with pytest.raises(ValueError, match=r"eb_configs: tables \['a'\] appear more than once"):
        check_constraints([*configs, config("a")], both)
    with pytest.raises(ValueError, match=r"constraints: no entry for tables \['b'\]"):
        check_constraints(configs, {"a": both["a"]})
    with pytest.raises(ValueError, match=r"constraints: keys \['c'\] are not tables"):
        check_constraints(configs, {**both, "c": ParameterConstraints()})


def test_the_worked_example():
    options = DynamicEmbTableOptions(global_hbm_for_values=1000)
    got = prepare_table_options(options, config(rows=1000, dim=16), world_size=3)
    assert (got.max_capacity, got.init_capacity, got.bucket_capacity) == (384, 384, 128)
    assert (got.dim, got.local_hbm_for_values) == (16, 334)
    bound = 1 / math.sqrt(1000)
    assert (got.initializer_args.lower, got.initializer_args.upper) == (-bound, bound)
    assert options.max_capacity is None  # prepared on a copy
    assert options.initializer_args.lower is None
    one_bucket = prepare_table_options(
        DynamicEmbTableOptions(bucket_capacity=MAX_BUCKET_CAPACITY), config(rows=1000), 3
    )
    assert (one_bucket.bucket_capacity, one_bucket.max_capacity) == (336, 336)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 10**7),
    world=st.integers(1, 64),
    width=st.sampled_from([16, 32, 128, 1024, MAX_BUCKET_CAPACITY]),
    init=st.one_of(st.none(), st.integers(1, 10**7)),
    hbm=st.integers(0, 10**12),
)
def test_steps_two_and_three_follow_the_spec(rows, world, width, init, hbm):
    options = DynamicEmbTableOptions(
        bucket_capacity=width, init_capacity=init, global_hbm_for_values=hbm
    )
    got = prepare_table_options(options, config(rows=rows), world)
    per_rank = -(-rows // world)
    if width == MAX_BUCKET_CAPACITY:
        want_width = -(-per_rank // 16) * 16
        want_capacity = want_width
    else:
        want_width = width
        want_capacity = -(-per_rank // width) * width
    assert got.bucket_capacity == want_width
    assert got.max_capacity == want_capacity
    if init is None:
        assert got.init_capacity == want_capacity
    else:
        assert got.init_capacity == min(-(-init // want_width) * want_width, want_capacity)
        assert got.init_capacity % want_width == 0 or got.init_capacity == want_capacity
    assert got.local_hbm_for_values == -(-hbm // world)


def test_initializer_completion():
    partial = DynamicEmbInitializerArgs(mode=UNIFORM, lower=-0.5)
    assert complete_initializer_args(partial, config(rows=100)).upper == pytest.approx(0.1)
    assert complete_initializer_args(partial, config(rows=100)).lower == -0.5
    no_config = complete_initializer_args(DynamicEmbInitializerArgs(mode=UNIFORM))
    assert (no_config.lower, no_config.upper) == (0.0, 1.0)
    constant = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=3.0)
    assert complete_initializer_args(constant, config()) == constant


def test_bad_options_name_themselves():
    with pytest.raises(PlannerConfigError, match="bucket_capacity"):
        prepare_table_options(DynamicEmbTableOptions(bucket_capacity=100), config(), 2)
    with pytest.raises(PlannerConfigError, match="world_size"):
        prepare_table_options(DynamicEmbTableOptions(), config(), 0)
    with pytest.raises(PlannerConfigError, match="init_capacity"):
        prepare_table_options(DynamicEmbTableOptions(init_capacity=0), config(), 2)
    with pytest.raises(PlannerConfigError, match="dist_type='modulo': unknown"):
        prepare_table_options(DynamicEmbTableOptions(dist_type="modulo"), config(), 2)
    with pytest.raises(TableConfigError, match="dist_type"):
        table_config(DynamicEmbTableOptions(dim=4, max_capacity=128, dist_type="modulo"), 0, "t")
