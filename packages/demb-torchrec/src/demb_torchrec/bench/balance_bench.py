"""``demb bench balance``: keys per rank of row-wise sharded dynamic tables under ``roundrobin``
and ``hash_roundrobin``.

One process per rank (NCCL on GPUs, gloo on the CPU) runs a DistributedModelParallel model of
two EmbeddingCollections, one sharded ``roundrobin`` and one ``hash_roundrobin``, each with two
dynamic tables fed the same key streams: ``strided`` (every key a multiple of the world size,
the pattern plain modulo routing sends to rank 0 alone) and ``power_law`` (ids drawn with
probability ~ rank^-alpha over ``rows`` ids, scattered). After ``steps`` training forwards, each
rank reports the keys its shard of each table holds; rank 0 prints, per stream and dist_type,
the keys per rank and max/mean (1.0 is perfect balance, ``world_size`` is everything on one
rank).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from demb_torchrec.bench._ranks import finish_rank, init_rank, machine, spawn_ranks
from demb_torchrec.bench.compare import check_counts
from demb_torchrec.bench.workload import power_law_ids

__all__ = ["BalanceWorkload", "run"]

DIST_TYPES = ("roundrobin", "hash_roundrobin")
STREAMS = ("strided", "power_law")


@dataclass(frozen=True)
class BalanceWorkload:
    """The benchmark's shape."""

    world_size: int = 2
    batch_size: int = 8192
    """Keys per rank, stream and step."""
    steps: int = 8
    rows: int = 1 << 22
    """Distinct ids of the power-law stream (and the strided stream's range / world size)."""
    alpha: float = 1.05

    def __post_init__(self) -> None:
        check_counts(self, *("world_size", "batch_size", "steps", "rows"))
        if not self.alpha > 1:
            raise ValueError(f"alpha={self.alpha!r}: must be > 1")


def _keys(w: BalanceWorkload, stream: str, rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * step + 104_729 * rank + STREAMS.index(stream))
    if stream == "strided":
        return torch.randint(0, w.rows, (w.batch_size,), generator=gen) * w.world_size
    return power_law_ids(gen, w.batch_size, w.rows, w.alpha)


def _rank(rank: int, w: BalanceWorkload, store_path: str, out: str) -> None:
    import torchrec.optim as trec_optim
    from torch import nn
    from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from demb_torchrec.capacity import get_table_value_bytes
    from demb_torchrec.constraints import DynamicEmbParameterConstraints
    from demb_torchrec.dump import dynamic_tables
    from demb_torchrec.options import DynamicEmbTableOptions
    from demb_torchrec.planner import DynamicEmbeddingShardingPlanner
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder

    device = init_rank(rank, w.world_size, store_path)
    # The planner gives each rank num_embeddings / world_size rows: room for twice a stream's
    # keys on any one rank, so no shard evicts and the counts are the routing's alone.
    capacity = 2 * w.batch_size * w.steps * w.world_size**2
    configs = {
        d: [
            EmbeddingConfig(
                name=f"{s}_{d}", embedding_dim=16, num_embeddings=capacity, feature_names=[s]
            )
            for s in STREAMS
        ]
        for d in DIST_TYPES
    }

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            meta = torch.device("meta")
            self.collections = nn.ModuleDict(
                {d: EmbeddingCollection(tables=configs[d], device=meta) for d in DIST_TYPES}
            )

        def forward(self, kjt: KeyedJaggedTensor) -> list[Any]:
            return [c(kjt) for c in self.collections.values()]

    model = Model()
    apply_optimizer_in_backward(trec_optim.SGD, model.parameters(), {"lr": 0.01})
    constraints = {
        c.name: DynamicEmbParameterConstraints(
            use_dynamicemb=True,
            dynamicemb_options=DynamicEmbTableOptions(  # every value row on the device
                dist_type=d, global_hbm_for_values=get_table_value_bytes(c, "sgd", w.world_size)
            ),
        )
        for d in DIST_TYPES
        for c in configs[d]
    }
    sharder = DynamicEmbeddingCollectionSharder()
    pg = dist.GroupMember.WORLD
    planner = DynamicEmbeddingShardingPlanner(
        [c for d in DIST_TYPES for c in configs[d]],
        Topology(world_size=w.world_size, compute_device=device.type),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], pg)
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), plan=plan, sharders=[sharder], device=device
    )
    with torch.no_grad():
        for step in range(w.steps):
            values = torch.cat([_keys(w, s, rank, step) for s in STREAMS])
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=list(STREAMS),
                values=values,
                lengths=torch.ones(values.numel(), dtype=torch.int32),
            ).to(device)
            for rows in dmp(kjt):  # wait for the output all-to-alls (lazy awaitables)
                for s in STREAMS:
                    rows[s].values()
    held = {t.name: t.module.tables.size(t.index) for t in dynamic_tables(dmp)}
    everyone: list[dict[str, int] | None] = [None] * w.world_size
    dist.all_gather_object(everyone, held, group=pg)
    report: dict[str, Any] | None = None
    if rank == 0:
        report = {"workload": asdict(w), **machine(device), "tables": {}}
        for s in STREAMS:
            for d in DIST_TYPES:
                per_rank = [int(h[f"{s}_{d}"]) for h in everyone if h is not None]
                mean = sum(per_rank) / len(per_rank)
                report["tables"][f"{s}/{d}"] = {
                    "keys_per_rank": per_rank,
                    "max_over_mean": max(per_rank) / mean if mean else float("nan"),
                }
    finish_rank(report, out)


def run(w: BalanceWorkload) -> dict[str, Any]:
    """Run the benchmark on ``w.world_size`` local ranks (one GPU each when CUDA is visible);
    returns rank 0's report.

    Raises:
        ValueError: more ranks than visible GPUs.
    """
    return spawn_ranks(_rank, w, w.world_size)
