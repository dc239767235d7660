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

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

EC_TABLES = (("ua", "fa", 8, 1000), ("ub", "fb", 8, 500))  # name, feature, dim, num_embeddings
EBC_TABLES = (("ia", "fc", 8, 600),)
BATCH = 5


def main() -> None:
    from _rank_join import join, leave  # beside this script (also loaded as a module by tests)

    rank, _, out_path, device, (mode, ckpt, optim_arg) = join(3)
    optim = optim_arg == "optim"
    import _rank_common as common
    from demb_torchrec import (
        DynamicEmbDump,
        DynamicEmbInitializerArgs,
        DynamicEmbInitializerMode,
        DynamicEmbLoad,
        DynamicEmbScoreStrategy,
    )
    from demb_torchrec.dump import dynamic_tables
    from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder as BagSharder
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder as SequenceSharder
    from torch import nn
    from torchrec import KeyedJaggedTensor
    from torchrec.optim import Adam
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = common.sequence_collection(EC_TABLES)
            self.ebc = common.bag_collection(EBC_TABLES)

        def forward(self, seq: KeyedJaggedTensor, pooled: KeyedJaggedTensor) -> torch.Tensor:
            rows = self.ec(seq)
            loss = sum(rows[f].values().square().sum() for _, f, _, _ in EC_TABLES)
            return loss + self.ebc(pooled).values().square().sum()

    model = Model()
    apply_optimizer_in_backward(Adam, model.parameters(), {"lr": 0.05})
    init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.1)
    lfu = DynamicEmbScoreStrategy.LFU
    constraints = {
        n: common.dynamic(initializer_args=init, dist_type=dist_type, score_strategy=lfu)
        for tables, dist_type in ((EC_TABLES, "roundrobin"), (EBC_TABLES, "continuous"))
        for n, *_ in tables
    }
    sharders = [SequenceSharder(), BagSharder()]
    dmp = common.shard(
        model, common.table_configs(model.ec, model.ebc), constraints, sharders, device
    )
    if mode == "dump":
        for step in range(4):
            gen = torch.Generator().manual_seed(100 * step + rank)

            def kjt(tables: tuple[tuple[str, str, int, int], ...]) -> KeyedJaggedTensor:
                lengths = torch.randint(0, 4, (len(tables) * BATCH,), generator=gen)  # noqa: B023
                keys = torch.randint(0, 3000, (int(lengths.sum()),), generator=gen)  # noqa: B023
                return common.features([f for _, f, _, _ in tables], [lengths], [keys], device)

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
