"""The planner on a model mixing dynamic and static tables (CPU topologies): dynamic tables are
planned row-wise on CUSTOMIZED_KERNEL with their prepared options, static ones as TorchRec plans
them; the storage estimate of a dynamic table uses its optimizer's real state size; FTRL is
refused at plan time on static tables that are not data-parallel (spec seed 000)."""

from __future__ import annotations

import pytest
import torch
import torchrec.optim as trec_optim
from demb_torchrec import (
    FTRL,
    DynamicEmbParameterConstraints,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)
from demb_torchrec.planner import (
    DynamicEmbeddingEnumerator,
    DynamicEmbeddingShardingPlanner,
    DynamicEmbParameterSharding,
)
from demb_torchrec.sharders import (
    DynamicEmbeddingBagCollectionSharder,
    DynamicEmbeddingCollectionSharder,
)
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value


class _AlsoDense:
    """Test sharders: the dynamic-table sharders that also offer the DENSE kernel for every
    sharding type (as other trainers' topologies do: seed 000's review; TorchRec drops it
    wherever FUSED is allowed too, unless constraints pin it)."""

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        kernels = super().compute_kernels(sharding_type, compute_device_type)  # type: ignore[misc]
        return kernels if "dense" in kernels else [*kernels, "dense"]


class EBCSharder(_AlsoDense, DynamicEmbeddingBagCollectionSharder):
    pass


class ECSharder(_AlsoDense, DynamicEmbeddingCollectionSharder):
    pass


SHARDERS = [EBCSharder(), ECSharder()]


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="user", embedding_dim=16, num_embeddings=1000, feature_names=["u"]
                ),
                EmbeddingBagConfig(
                    name="item", embedding_dim=8, num_embeddings=500, feature_names=["i"]
                ),
            ],
            device=torch.device("meta"),
        )
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="query", embedding_dim=16, num_embeddings=3000, feature_names=["q"]
                )
            ],
            device=torch.device("meta"),
        )

    def configs(self) -> list:
        return [*self.ebc.embedding_bag_configs(), *self.ec.embedding_configs()]


def dynamic(**options) -> DynamicEmbParameterConstraints:
    return DynamicEmbParameterConstraints(
        use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions(**options)
    )


def test_dynamic_tables_are_planned_row_wise_on_the_customized_kernel():
    model = Model()
    constraints = {
        "user": dynamic(bucket_capacity=64, init_capacity=100),
        "item": ParameterConstraints(),
        "query": dynamic(score_strategy=DynamicEmbScoreStrategy.STEP),
    }
    topology = Topology(world_size=2, compute_device="cpu")
    planner = DynamicEmbeddingShardingPlanner(model.configs(), topology, constraints=constraints)
    user = constraints["user"].dynamicemb_options  # prepared in place for 2 ranks
    shape = (user.dim, user.max_capacity, user.init_capacity, user.bucket_capacity)
    assert shape == (16, 512, 128, 64)
    plan = planner.plan(model, SHARDERS)
    for path, table in (("ebc", "user"), ("ec", "query")):
        sharding = plan.plan[path][table]
        assert isinstance(sharding, DynamicEmbParameterSharding)
        assert (sharding.sharding_type, sharding.compute_kernel) == ("row_wise", CUSTOMIZED)
        assert sharding.ranks == [0, 1]
        options = constraints[table].dynamicemb_options
        assert sharding.dynamicemb_options is options
        assert sharding.get_additional_fused_params()["dynamicemb_tables"][table] is options
    item = plan.plan["ebc"]["item"]
    assert not isinstance(item, DynamicEmbParameterSharding)
    assert item.compute_kernel != CUSTOMIZED
    assert constraints["query"].dynamicemb_options.max_capacity == 1536  # ceil(3000/2) -> 128s


def test_constraints_must_allow_row_wise_and_the_kernel():
    model = Model()
    bad_constraints = [
        ({"sharding_types": ["table_wise"]}, "row_wise"),
        ({"compute_kernels": ["fused"]}, CUSTOMIZED),
    ]
    for bad, word in bad_constraints:
        constraints = {
            "user": DynamicEmbParameterConstraints(use_dynamicemb=True, **bad),
            "item": ParameterConstraints(),
            "query": ParameterConstraints(),
        }
        topology = Topology(world_size=1, compute_device="cpu")
        planner = DynamicEmbeddingShardingPlanner(
            model.configs(), topology, constraints=constraints
        )
        with pytest.raises(ValueError, match=f"table 'user': dynamic tables .*{word}"):
            planner.plan(model, SHARDERS)
    with pytest.raises(ValueError, match=r"constraints: no entry for tables \['query'\]"):
        DynamicEmbeddingShardingPlanner(
            model.configs(), constraints={"user": dynamic(), "item": dynamic()}
        )


STATES = [(FTRL, 2), (trec_optim.Adam, 2), (trec_optim.SGD, 0), (trec_optim.Adagrad, 1)]


@pytest.mark.parametrize(("optimizer", "state"), STATES)
def test_storage_of_a_dynamic_shard_uses_its_optimizers_state(registry, optimizer, state):
    model = Model()
    kwargs = {"lr": 0.01}
    apply_optimizer_in_backward(optimizer, model.ebc.parameters(), kwargs)
    constraints = {"user": dynamic(), "item": ParameterConstraints(), "query": dynamic()}
    topology = Topology(world_size=2, compute_device="cpu")
    DynamicEmbeddingShardingPlanner(model.configs(), topology, constraints=constraints)
    enumerator = DynamicEmbeddingEnumerator(topology, 512, constraints)
    options = [o for o in enumerator.enumerate(model, SHARDERS) if o.name == "user"]
    assert len(options) == 1
    slots = constraints["user"].dynamicemb_options.max_capacity  # 512 per rank
    index = 8 + 1 + 8  # key, digest, one score word
    want = slots * (16 * 4 + state * 16 * 4 + index)
    for shard in options[0].shards:
        assert (shard.storage.hbm, shard.storage.ddr) == (0, want)
    if optimizer is FTRL:  # what TorchRec's default multiplier of 1 would have planned
        assert want != slots * (16 * 4 + 1 * 16 * 4 + index)


@pytest.mark.parametrize("caching", [True, False])
def test_a_tiered_shard_plans_its_budget_on_the_gpu_and_its_other_rows_on_the_host(caching):
    """A caching shard: its cache's rows and the index on the GPU, every row on the host. A
    hybrid shard (a budget without caching): its first rows on the GPU, the others on the
    host."""
    model = Model()
    apply_optimizer_in_backward(trec_optim.SGD, model.ebc.parameters(), {"lr": 0.01})
    budget = 2 * 100 * 16 * 4  # two ranks' 100 rows of 16 floats
    constraints = {
        "user": dynamic(caching=caching, global_hbm_for_values=budget),
        "item": ParameterConstraints(),
        "query": dynamic(),
    }
    topology = Topology(world_size=2, compute_device="cuda")
    DynamicEmbeddingShardingPlanner(model.configs(), topology, constraints=constraints)
    enumerator = DynamicEmbeddingEnumerator(topology, 512, constraints)
    (option,) = [o for o in enumerator.enumerate(model, SHARDERS) if o.name == "user"]
    slots = constraints["user"].dynamicemb_options.max_capacity
    values = slots * 16 * 4
    index = slots * (8 + 1 + 8)
    host = values if caching else values - budget // 2
    for shard in option.shards:
        assert (shard.storage.hbm, shard.storage.ddr) == (index + budget // 2, host)


def ftrl_model(constraints_item: ParameterConstraints) -> tuple[nn.Module, dict]:
    model = Model()
    apply_optimizer_in_backward(FTRL, model.ebc.parameters(), {"lr": 0.01})
    return model, {"user": dynamic(), "item": constraints_item, "query": dynamic()}


def test_ftrl_on_a_static_table_is_refused_at_plan_time_naming_it(registry):
    topology = Topology(world_size=2, compute_device="cpu")
    cases = [
        (ParameterConstraints(compute_kernels=["fused"]), True),
        (ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["dense"]), True),
        (ParameterConstraints(sharding_types=["data_parallel"]), False),
    ]
    for item, refused in cases:
        model, constraints = ftrl_model(item)
        planner = DynamicEmbeddingShardingPlanner(
            model.configs(), topology, constraints=constraints
        )
        if refused:
            with pytest.raises(ValueError, match="table 'item': FTRL runs only on dynamic tables"):
                planner.plan(model, SHARDERS)
        else:
            plan = planner.plan(model, SHARDERS)
            assert plan.plan["ebc"]["item"].sharding_type == "data_parallel"
            assert isinstance(plan.plan["ebc"]["user"], DynamicEmbParameterSharding)


def test_collective_plan_on_a_one_rank_group_equals_plan(tmp_path):
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = Model()
        constraints = {"user": dynamic(), "item": ParameterConstraints(), "query": dynamic()}
        planner = DynamicEmbeddingShardingPlanner(model.configs(), constraints=constraints)
        assert planner.topology.world_size == 1
        collective = planner.collective_plan(model, SHARDERS)
        local = planner.plan(model, SHARDERS)
        assert str(collective) == str(local)
        sharding = collective.plan["ec"]["query"]
        assert isinstance(sharding, DynamicEmbParameterSharding)
        assert sharding.dynamicemb_options.max_capacity == 3072  # one rank: all 3000 rows
    finally:
        dist.destroy_process_group()


def test_storage_of_a_dynamic_shard_counts_its_admission_counter(registry):
    """Frequency admission adds the counter's slots (key, digest, count) to every rank's
    shard; probabilistic admission keeps no counter and adds nothing."""
    from demb_torchrec import FrequencyAdmissionStrategy, KVCounter, ProbabilisticAdmissionStrategy

    model = Model()
    apply_optimizer_in_backward(trec_optim.SGD, model.ebc.parameters(), {"lr": 0.01})
    counted = FrequencyAdmissionStrategy(2, KVCounter(1000, bucket_capacity=128))
    constraints = {
        "user": dynamic(admit_strategy=counted),
        "item": ParameterConstraints(),
        "query": dynamic(admit_strategy=ProbabilisticAdmissionStrategy(0.5)),
    }
    topology = Topology(world_size=2, compute_device="cpu")
    DynamicEmbeddingShardingPlanner(model.configs(), topology, constraints=constraints)
    enumerator = DynamicEmbeddingEnumerator(topology, 512, constraints)
    storage = {o.name: o.shards[0].storage.ddr for o in enumerator.enumerate(model, SHARDERS)}
    index = 8 + 1 + 8
    for name, extra in (("user", 1024 * (8 + 1 + 8)), ("query", 0)):
        slots = constraints[name].dynamicemb_options.max_capacity
        assert storage[name] == slots * (16 * 4 + index) + extra, name
