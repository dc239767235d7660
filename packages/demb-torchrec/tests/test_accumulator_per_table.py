"""Spec seed 001: ``initial_accumulator_value`` reaches each dynamic table per table, through the
parameter sharding's additional fused params (the hook where dynamic and static tables can be
told apart): a key a table inserts holds that table's value in its accumulator state, for
Adagrad, row-wise Adagrad and FTRL. DistributedModelParallel on one gloo rank, in process."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.distributed as dist
import torchrec.optim as trec_optim
from demb_torchrec import (
    FTRL,
    DynamicEmbParameterConstraints,
    DynamicEmbTableOptions,
)
from demb_torchrec.lookup import DynamicEmbeddingKernel, kernel_arguments
from demb_torchrec.planner import (
    TABLES_KEY,
    DynamicEmbeddingShardingPlanner,
    DynamicEmbParameterSharding,
    PlannedTables,
)
from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

DIM = 4
VALUES = {"a": 0.1, "b": 0.25, "c": 0.5}


def accumulator(optimizer: str, state: torch.Tensor) -> torch.Tensor:
    """The accumulator part of a row's state columns (demb_optim's layouts)."""
    return {"adagrad": state[:DIM], "rowwise_adagrad": state[:1], "ftrl": state[DIM:]}[optimizer]


@pytest.fixture
def one_rank(tmp_path):
    logging.disable(logging.WARNING)
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1
    )
    yield dist.GroupMember.WORLD
    dist.destroy_process_group()
    logging.disable(logging.NOTSET)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad", "ftrl"])
def test_each_table_gets_its_own_accumulator_value(one_rank, registry, optimizer):
    classes = {"adagrad": trec_optim.Adagrad, "rowwise_adagrad": trec_optim.RowWiseAdagrad}
    configs = [
        EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=100, feature_names=[f"f{n}"])
        for n in VALUES
    ]
    model = EmbeddingCollection(tables=configs, device=torch.device("meta"))
    apply_optimizer_in_backward(classes.get(optimizer, FTRL), model.parameters(), {"lr": 0.1})
    constraints = {
        n: DynamicEmbParameterConstraints(
            use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions()
        )
        for n in VALUES
    }
    sharder = DynamicEmbeddingCollectionSharder()
    planner = DynamicEmbeddingShardingPlanner(
        configs, Topology(world_size=1, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, [sharder], one_rank)
    for name, value in VALUES.items():  # what a trainer does with the plan (seed 001)
        sharding = plan.plan[""][name]
        assert isinstance(sharding, DynamicEmbParameterSharding)
        sharding.additional_fused_params["initial_accumulator_value"] = value
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(one_rank),
            plan=plan,
            sharders=[sharder],
            device=torch.device("cpu"),
        )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{n}" for n in VALUES],
        values=torch.tensor([7, 8, 9]),
        lengths=torch.ones(3, dtype=torch.int64),
    )
    with torch.no_grad():
        dmp(kjt)  # inserts key 7 in a, 8 in b, 9 in c: their state is the initial one
    kernels = [k for lookup in dmp.module._lookups for k in lookup.modules()]
    seen = {}
    for kernel in kernels:
        if isinstance(kernel, DynamicEmbeddingKernel):
            spec = kernel.tables.optimizer
            for t, name in enumerate(kernel.tables.table_names):
                rows = kernel.tables.tables.export(t).values
                assert rows.shape[0] == 1, name
                seen[name] = (spec.initial_accumulator_value, accumulator(optimizer, rows[0, DIM:]))
    assert sorted(seen) == sorted(VALUES)
    for name, value in VALUES.items():
        spec_value, state = seen[name]
        assert spec_value == value
        torch.testing.assert_close(state, torch.full_like(state, value))


def test_canary_the_kernel_takes_the_value_from_the_fused_params():
    """Fails loudly if initial_accumulator_value stops reaching the table's optimizer."""
    planned = PlannedTables({"t": DynamicEmbTableOptions(dim=4, max_capacity=128)})
    fused = {
        "optimizer": "adagrad",
        "learning_rate": 0.1,
        "initial_accumulator_value": 0.3,
        TABLES_KEY: planned,
    }
    options, optimizer, hyper = kernel_arguments("t", fused)
    assert options is planned["t"]
    assert optimizer == "adagrad"
    assert hyper == {"learning_rate": 0.1, "initial_accumulator_value": 0.3}
    with pytest.raises(ValueError, match="no planned dynamic-table options"):
        kernel_arguments("t", {"optimizer": "adagrad"})
    with pytest.raises(NotImplementedError, match="stochastic_rounding=True"):
        kernel_arguments("t", {**fused, "stochastic_rounding": True})
    with pytest.raises(NotImplementedError, match="cache_load_factor"):
        kernel_arguments("t", {**fused, "cache_load_factor": 0.2})
