"""One rank of test_dump_load_ranks.py: a model with an EmbeddingCollection (two dynamic tables,
roundrobin) and an EmbeddingBagCollection (one dynamic table, continuous), planned and sharded
row-wise under DistributedModelParallel over gloo, Adam applied in backward.

MODE ``dump``: trains a few steps, then ``DynamicEmbDump(CKPT, model, optim=OPTIM)``.
MODE ``load``: ``DynamicEmbLoad(CKPT, model, optim=OPTIM)`` into the freshly built model.
Either way, saves to OUT this rank's content of every table: ``{(collection, table): (keys,
rows with optimizer state, scores)}``.

Usage: ``python _dump_load_rank.py RANK WORLD STORE OUT MODE CKPT OPTIM [DEVICE]`` (DEVICE
``cuda``: rank ``r`` on GPU ``r`` over NCCL).
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

EC_TABLES = (("ua", "fa", 8, 1000), ("ub", "fb", 8, 500))  # name, feature, dim, num_embeddings
EBC_TABLES = (("ia", "fc", 8, 600),)
BATCH = 5


def main() -> None:
    from _rank_join import join, leave  # beside this script (also loaded as a module by tests)

    rank, world, out_path, device, (mode, ckpt, optim_arg) = join(3)
    optim = optim_arg == "optim"
    import torchrec.optim as trec_optim
    from demb_torchrec import (
        DynamicEmbDump,
        DynamicEmbInitializerArgs,
        DynamicEmbInitializerMode,
        DynamicEmbLoad,
        DynamicEmbParameterConstraints,
        DynamicEmbScoreStrategy,
        DynamicEmbTableOptions,
    )
    from demb_torchrec.dump import dynamic_tables
    from demb_torchrec.planner import DynamicEmbeddingShardingPlanner
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
        KeyedJaggedTensor,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    meta = torch.device("meta")
    ec_configs = [
        EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f])
        for n, f, d, r in EC_TABLES
    ]
    ebc_configs = [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f])
        for n, f, d, r in EBC_TABLES
    ]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = EmbeddingCollection(tables=ec_configs, device=meta)
            self.ebc = EmbeddingBagCollection(tables=ebc_configs, device=meta)

        def forward(self, seq: KeyedJaggedTensor, pooled: KeyedJaggedTensor) -> torch.Tensor:
            rows = self.ec(seq)
            loss = sum(rows[f].values().square().sum() for _, f, _, _ in EC_TABLES)
            return loss + self.ebc(pooled).values().square().sum()

    model = Model()
    apply_optimizer_in_backward(trec_optim.Adam, model.parameters(), {"lr": 0.05})
    init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.1)

    def constraint(dist_type: str) -> DynamicEmbParameterConstraints:
        return DynamicEmbParameterConstraints(
            use_dynamicemb=True,
            dynamicemb_options=DynamicEmbTableOptions(
                initializer_args=init,
                dist_type=dist_type,
                score_strategy=DynamicEmbScoreStrategy.LFU,
            ),
        )

    constraints = {n: constraint("roundrobin") for n, *_ in EC_TABLES}
    constraints.update({n: constraint("continuous") for n, *_ in EBC_TABLES})
    sharders = [DynamicEmbeddingCollectionSharder(), DynamicEmbeddingBagCollectionSharder()]
    planner = DynamicEmbeddingShardingPlanner(
        [*ec_configs, *ebc_configs],
        Topology(world_size=world, compute_device=device.type),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        plan=plan,
        sharders=sharders,
        device=device,
    )
    if mode == "dump":
        for step in range(4):
            gen = torch.Generator().manual_seed(100 * step + rank)

            def kjt(tables: tuple[tuple[str, str, int, int], ...]) -> KeyedJaggedTensor:
                lengths = torch.randint(0, 4, (len(tables) * BATCH,), generator=gen)  # noqa: B023
                keys = torch.randint(0, 3000, (int(lengths.sum()),), generator=gen)  # noqa: B023
                return KeyedJaggedTensor.from_lengths_sync(
                    keys=[f for _, f, _, _ in tables], values=keys, lengths=lengths
                ).to(device)

            dmp(kjt(EC_TABLES), kjt(EBC_TABLES)).backward()
        DynamicEmbDump(ckpt, dmp, optim=optim)
    else:
        DynamicEmbLoad(ckpt, dmp, optim=optim)
    content = {}
    for t in dynamic_tables(dmp):
        export = t.module.tables.export(t.index)
        content[(t.collection, t.name)] = (
            export.keys.cpu(),
            export.values.cpu(),
            export.scores.cpu(),
        )
    torch.save(content, out_path)
    leave()


if __name__ == "__main__":
    main()
