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
from typing import Any

import torch
from torch import nn

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

STEPS = 12
BATCH = 8
DIM = 8
# name, feature, dim, num_embeddings
BAG_TABLES = (("user", "u", DIM, 10_000), ("item", "i", DIM, 200))
SEQUENCE_TABLES = (("query", "q", DIM, 5_000), ("cat", "c", DIM, 50))


def main() -> None:
    from _rank_join import join, leave  # beside this script (also loaded as a module by tests)

    rank, _, out_path, device, _ = join(0)
    on_gpu = device.type == "cuda"
    import _rank_common as common
    from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder as BagSharder
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder as SequenceSharder
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.optim import SGD
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(0)  # the same dense layer and static tables on every rank

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = common.bag_collection(BAG_TABLES)
            self.ec = common.sequence_collection(SEQUENCE_TABLES)
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
    apply_optimizer_in_backward(SGD, model.ebc.parameters(), {"lr": 0.5})
    apply_optimizer_in_backward(SGD, model.ec.parameters(), {"lr": 0.5})
    configs = common.table_configs(model.ebc, model.ec)
    # On the CPU: "cat" static and table-wise (TorchRec 1.6.1's own data-parallel
    # EmbeddingCollection fails there: split_with_sizes in construct_jagged_tensors), "item"
    # static as TorchRec plans it. The GPU machine's trimmed fbgemm_gpu has neither FBGEMM's
    # fused nor its dense TBE kernels, which every static table needs: there all are dynamic.
    dynamic_tables = {"user", "query", "cat", "item"} if on_gpu else {"user", "query"}
    static_types = {"cat": ["table_wise"], "item": None}
    constraints = {
        c.name: common.dynamic(dist_type="hash_roundrobin")
        if c.name in dynamic_tables
        else ParameterConstraints(sharding_types=static_types[c.name])
        for c in configs
    }
    sharders: list[Any] = [BagSharder(), SequenceSharder()]
    dmp = common.shard(model, configs, constraints, sharders, device)
    plan = dmp.plan
    dense_opt = torch.optim.SGD(dmp.module.dense.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(rank)
    lens = [torch.randint(1, 4, (BATCH,), generator=gen) for _ in range(4)]

    def ids(n: torch.Tensor, high: int) -> torch.Tensor:
        return torch.randint(0, high, (int(n.sum()),), generator=gen)

    # dynamic features draw ids up to 1e9, far above num_embeddings; static ones stay in range
    bags = common.features(["u", "i"], lens[:2], [ids(lens[0], 10**9), ids(lens[1], 200)], device)
    seqs = common.features(["q", "c"], lens[2:], [ids(lens[2], 10**9), ids(lens[3], 50)], device)
    target = torch.randn(BATCH, generator=gen).to(device)
    losses = []
    for _ in range(STEPS):
        loss = ((dmp(bags, seqs) - target) ** 2).mean()
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        losses.append(float(loss))
    kernels = common.dynamic_kernels(dmp.module.ebc, dmp.module.ec)
    held = {name: int(ex.keys.numel()) for name, ex in common.held_rows(kernels).items()}
    shardings = {t: s.sharding_type for p in plan.plan.values() for t, s in p.items()}
    torch.save({"losses": losses, "held": held, "shardings": shardings}, out_path)
    leave()


if __name__ == "__main__":
    main()
