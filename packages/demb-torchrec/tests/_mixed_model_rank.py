"""One rank of test_mixed_model.py: a model in the spirit of the spec's examples, an
EmbeddingBagCollection and an EmbeddingCollection, each with a dynamic and a static table, and a
dense layer, planned by DynamicEmbeddingShardingPlanner, wrapped in DistributedModelParallel with
the dynamic-table sharders (gloo on the CPU, or NCCL on CUDA with DEVICE ``cuda``), sparse
tables trained by apply_optimizer_in_backward, the dense layer by SGD. Trains STEPS steps on this
rank's fixed batch; writes the losses, the plan's sharding per table and the keys each dynamic
shard holds to OUT.

Usage: ``python _mixed_model_rank.py RANK WORLD STORE OUT [DEVICE]``
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist
from torch import nn

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

STEPS = 12
BATCH = 8
DIM = 8


def main() -> None:
    from _rank_join import join, leave  # beside this script (also loaded as a module by tests)

    rank, world, out_path, device, _ = join(0)
    on_gpu = device.type == "cuda"
    import torchrec.optim as trec_optim
    from demb_torchrec import DynamicEmbParameterConstraints, DynamicEmbTableOptions
    from demb_torchrec.lookup import DynamicEmbeddingKernel
    from demb_torchrec.planner import DynamicEmbeddingShardingPlanner
    from demb_torchrec.sharders import (
        DynamicEmbeddingBagCollectionSharder,
        DynamicEmbeddingCollectionSharder,
    )
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        KeyedJaggedTensor,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(0)  # the same dense layer and static tables on every rank

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name="user", embedding_dim=DIM, num_embeddings=10_000, feature_names=["u"]
                    ),
                    EmbeddingBagConfig(
                        name="item", embedding_dim=DIM, num_embeddings=200, feature_names=["i"]
                    ),
                ],
                device=torch.device("meta"),
            )
            self.ec = EmbeddingCollection(
                tables=[
                    EmbeddingConfig(
                        name="query", embedding_dim=DIM, num_embeddings=5_000, feature_names=["q"]
                    ),
                    EmbeddingConfig(
                        name="cat", embedding_dim=DIM, num_embeddings=50, feature_names=["c"]
                    ),
                ],
                device=torch.device("meta"),
            )
            self.dense = nn.Linear(4 * DIM, 1)

        def forward(self, bags: KeyedJaggedTensor, seqs: KeyedJaggedTensor) -> torch.Tensor:
            pooled = self.ebc(bags).values()  # (B, 2 * DIM)
            per_seq = []
            sequences = self.ec(seqs)
            for feature in ("q", "c"):
                jt = sequences[feature]
                sample = torch.repeat_interleave(torch.arange(BATCH, device=device), jt.lengths())
                zeros = torch.zeros(BATCH, DIM, device=device)
                per_seq.append(zeros.index_add(0, sample, jt.values()))
            return self.dense(torch.cat([pooled, *per_seq], dim=1)).squeeze(1)

    model = Model()
    model.dense.to(device)
    apply_optimizer_in_backward(trec_optim.SGD, model.ebc.parameters(), {"lr": 0.5})
    apply_optimizer_in_backward(trec_optim.SGD, model.ec.parameters(), {"lr": 0.5})
    configs = [*model.ebc.embedding_bag_configs(), *model.ec.embedding_configs()]
    # On the CPU: "cat" static and table-wise (TorchRec 1.6.1's own data-parallel
    # EmbeddingCollection fails there: split_with_sizes in construct_jagged_tensors), "item"
    # static as TorchRec plans it. The GPU machine's trimmed fbgemm_gpu has neither FBGEMM's
    # fused nor its dense TBE kernels, which every static table needs: there all are dynamic.
    dynamic = {"user", "query", "cat", "item"} if on_gpu else {"user", "query"}
    static_types = {"cat": ["table_wise"], "item": None}
    constraints = {
        c.name: DynamicEmbParameterConstraints(
            use_dynamicemb=True,
            dynamicemb_options=DynamicEmbTableOptions(dist_type="hash_roundrobin"),
        )
        if c.name in dynamic
        else ParameterConstraints(sharding_types=static_types[c.name])
        for c in configs
    }
    sharders = [DynamicEmbeddingBagCollectionSharder(), DynamicEmbeddingCollectionSharder()]
    planner = DynamicEmbeddingShardingPlanner(
        configs, Topology(world_size=world, compute_device=device.type), constraints=constraints
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        plan=plan,
        sharders=sharders,
        device=device,
    )
    dense_opt = torch.optim.SGD(dmp.module.dense.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(rank)
    lens = [torch.randint(1, 4, (BATCH,), generator=gen) for _ in range(4)]

    def ids(n: torch.Tensor, high: int) -> torch.Tensor:
        return torch.randint(0, high, (int(n.sum()),), generator=gen)

    # dynamic features draw ids up to 1e9, far above num_embeddings; static ones stay in range
    bag_values = torch.cat([ids(lens[0], 10**9), ids(lens[1], 200)])
    seq_values = torch.cat([ids(lens[2], 10**9), ids(lens[3], 50)])
    bags = KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "i"], values=bag_values, lengths=torch.cat(lens[:2])
    )
    seqs = KeyedJaggedTensor.from_lengths_sync(
        keys=["q", "c"], values=seq_values, lengths=torch.cat(lens[2:])
    )
    target = torch.randn(BATCH, generator=gen).to(device)
    bags, seqs = bags.to(device), seqs.to(device)
    losses = []
    for _ in range(STEPS):
        loss = ((dmp(bags, seqs) - target) ** 2).mean()
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        losses.append(float(loss))
    lookups = [*dmp.module.ebc._lookups, *dmp.module.ec._lookups]
    kernels = [k for lookup in lookups for k in lookup.modules()]
    kernels = [k for k in kernels if isinstance(k, DynamicEmbeddingKernel)]
    held = {
        name: int(k.tables.tables.export(t).keys.numel())
        for k in kernels
        for t, name in enumerate(k.tables.table_names)
    }
    shardings = {t: s.sharding_type for p in plan.plan.values() for t, s in p.items()}
    torch.save({"losses": losses, "held": held, "shardings": shardings}, out_path)
    leave()


if __name__ == "__main__":
    main()
