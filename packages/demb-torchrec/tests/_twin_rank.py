"""One rank of test_torchrec_twins.py: for each collection kind (EC, EBC SUM, EBC MEAN) and
optimizer (SGD, Adagrad, row-wise Adagrad, Adam), the same model twice: with dynamic tables under
DistributedModelParallel over gloo (DynamicEmbeddingShardingPlanner, the dynamic-table sharders)
and with TorchRec's static tables: for SGD and the Adagrads on FBGEMM's fused CPU TBE under
DistributedModelParallel (table-wise); for Adam, which FBGEMM's CPU TBE lacks, TorchRec's
unsharded collection with sparse gradients and ``torch.optim.SparseAdam`` (the same sparse Adam:
only the batch's rows move, bias correction by the table's step count), fed the global batch and
the global gradients divided by the world size as TorchRec's all-to-alls do. Both start from the
same rows (the dynamic tables' DEBUG initializer, row ``j`` of key ``k`` = ``k % 65536 + j / 256``,
written into the static weights), fed the same batches and gradients. Writes, per configuration,
each step's largest output difference (and largest output), and at the end the static tables
this rank holds and the dynamic rows it holds.

Usage: ``python _twin_rank.py RANK WORLD STORE OUT``
"""

from __future__ import annotations

import logging
import warnings

import torch
import torch.distributed as dist

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

STEPS = 10
BATCH = 4
TABLES = (("a", "fa", 8, 40), ("b", "fb", 8, 24))  # name, feature, dim, num_embeddings
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad", "adam")
KINDS = ("ec", "ebc-sum", "ebc-mean")


def batch(step: int, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(31 * step + rank)
    lengths = [torch.randint(0, 4, (BATCH,), generator=gen) for _ in TABLES]
    values = [
        torch.randint(0, rows, (int(ln.sum()),), generator=gen)
        for ln, (_, _, _, rows) in zip(lengths, TABLES, strict=True)
    ]
    return lengths, values


def debug_rows(rows: int, dim: int) -> torch.Tensor:
    """The DEBUG initializer's rows of keys ``0..rows-1``."""
    keys = torch.arange(rows, dtype=torch.float32).unsqueeze(1) % 65536
    return keys + torch.arange(dim, dtype=torch.float32) / 256


def gradient(step: int, rank: int, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7 * step + rank)
    return torch.randn(shape, generator=gen)


class SparseAdamTwin:
    """A static TorchRec collection (unsharded, its embedding modules set to sparse gradients)
    trained by ``torch.optim.SparseAdam`` on the global batch of ``world`` ranks; hands rank
    ``rank`` its share of each step's output."""

    def __init__(self, kind: str, module: torch.nn.Module, rank: int, world: int) -> None:
        self.kind, self.module, self.rank, self.world = kind, module, rank, world
        for m in module.modules():
            if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag):
                m.sparse = True
        self.optimizer = torch.optim.SparseAdam(list(module.parameters()), lr=0.05, eps=1e-8)
        self.out: torch.Tensor | None = None

    def forward(self, step: int) -> torch.Tensor:
        from torchrec import KeyedJaggedTensor

        batches = [batch(step, r) for r in range(self.world)]
        features = range(len(TABLES))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f for _, f, _, _ in TABLES],
            values=torch.cat([batches[r][1][f] for f in features for r in range(self.world)]),
            lengths=torch.cat([batches[r][0][f] for f in features for r in range(self.world)]),
        )
        out = self.module(kjt)
        if self.kind != "ec":  # (world * B, sum of dims), rank-major
            self.out = out.values()
            return self.out[self.rank * BATCH : (self.rank + 1) * BATCH]
        per_feature = [out[f].values() for _, f, _, _ in TABLES]
        self.out = torch.cat(per_feature)
        mine = []
        for f, rows in enumerate(per_feature):
            counts = [int(batches[r][1][f].numel()) for r in range(self.world)]
            mine.append(rows.split(counts)[self.rank])
        return torch.cat(mine)

    def backward(self, step: int) -> None:
        assert self.out is not None
        batches = [batch(step, r) for r in range(self.world)]
        if self.kind != "ec":
            width = self.out.shape[1]
            grads = [gradient(step, r, (BATCH, width)) for r in range(self.world)]
            grad = torch.cat(grads)
        else:
            per_rank = []
            for r in range(self.world):
                counts = [int(v.numel()) for v in batches[r][1]]
                g = gradient(step, r, (sum(counts), TABLES[0][2]))
                per_rank.append(g.split(counts))
            grad = torch.cat(
                [per_rank[r][f] for f in range(len(TABLES)) for r in range(self.world)]
            )
        self.out.backward(grad / self.world)
        self.optimizer.step()
        self.optimizer.zero_grad()

    def tables(self) -> dict[str, torch.Tensor]:
        params = dict(self.module.named_parameters())
        prefix = "embeddings" if self.kind == "ec" else "embedding_bags"
        return {n: params[f"{prefix}.{n}.weight"].detach().clone() for n, *_ in TABLES}


def main() -> None:
    from _rank_join import join, leave  # beside this script (also loaded as a module by tests)

    rank, world, out_path, _, _ = join(0)  # the CPU over gloo
    import _rank_common as common
    from demb_torchrec import DynamicEmbInitializerArgs, DynamicEmbInitializerMode
    from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder as BagSharder
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder as SequenceSharder
    from torchrec import PoolingType
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner
    from torchrec.distributed.planner.types import ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    pg = dist.GroupMember.WORLD
    env = ShardingEnv.from_process_group(pg)
    topology = Topology(world_size=world, compute_device="cpu")
    cpu = torch.device("cpu")

    def collection(kind: str, device: torch.device) -> torch.nn.Module:
        if kind == "ec":
            return common.sequence_collection(TABLES, device)
        pooling = PoolingType.SUM if kind == "ebc-sum" else PoolingType.MEAN
        return common.bag_collection(TABLES, pooling, device)

    def outputs(kind: str, out: object) -> torch.Tensor:
        if kind == "ec":
            return torch.cat([out[f].values() for _, f, _, _ in TABLES])  # type: ignore[index]
        return out.values()  # type: ignore[attr-defined]

    results = {}
    debug = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.DEBUG)
    for kind in KINDS:
        for opt in OPTIMIZERS:
            kwargs = {"lr": 0.05} if opt == "sgd" else {"lr": 0.05, "eps": 1e-8}
            opt_class = common.OPTIMIZER_CLASSES[opt]
            # the static twin: real weights set to the DEBUG rows, table-wise on FBGEMM's CPU TBE
            # (Adam: unsharded, SparseAdam)
            static = collection(kind, cpu)
            with torch.no_grad():
                for (name, _, dim, rows), param in zip(TABLES, static.parameters(), strict=True):
                    assert param.shape == (rows, dim), name
                    param.copy_(debug_rows(rows, dim))
            twin = SparseAdamTwin(kind, static, rank, world) if opt == "adam" else None
            prefix = "embeddings" if kind == "ec" else "embedding_bags"
            if twin is None:
                apply_optimizer_in_backward(opt_class, static.parameters(), dict(kwargs))
                stock = (
                    EmbeddingCollectionSharder()
                    if kind == "ec"
                    else EmbeddingBagCollectionSharder()
                )
                static_constraints = {
                    n: ParameterConstraints(sharding_types=["table_wise"]) for n, *_ in TABLES
                }
                static_plan = EmbeddingShardingPlanner(
                    topology, constraints=static_constraints
                ).collective_plan(static, [stock], pg)
                static_dmp = DistributedModelParallel(
                    static, env=env, plan=static_plan, sharders=[stock], device=cpu
                )
                # TorchRec copies a CPU EmbeddingBagCollection's weights into its shards only off
                # the CPU: write the DEBUG rows into every local shard (views of the TBE weights)
                state = static_dmp.state_dict()
                with torch.no_grad():
                    for name, _, dim, rows in TABLES:
                        for local in state[f"{prefix}.{name}.weight"].local_shards():
                            r0, c0 = local.metadata.shard_offsets
                            r1, c1 = local.metadata.shard_sizes
                            local.tensor.copy_(debug_rows(rows, dim)[r0 : r0 + r1, c0 : c0 + c1])
            # the dynamic model
            dynamic_model = collection(kind, torch.device("meta"))
            apply_optimizer_in_backward(opt_class, dynamic_model.parameters(), dict(kwargs))
            sharder = SequenceSharder() if kind == "ec" else BagSharder()
            constraints = {n: common.dynamic(initializer_args=debug) for n, *_ in TABLES}
            configs = common.table_configs(dynamic_model)
            dynamic_dmp = common.shard(dynamic_model, configs, constraints, [sharder], cpu)
            diffs = []
            for step in range(STEPS):
                lengths, values = batch(step, rank)
                kjt = common.features([f for _, f, _, _ in TABLES], lengths, values, cpu)
                got = outputs(kind, dynamic_dmp(kjt))
                want = outputs(kind, static_dmp(kjt)) if twin is None else twin.forward(step)
                if got.numel():
                    diffs.append((float((got - want).abs().max()), float(want.abs().max())))
                grad = gradient(step, rank, got.shape)
                got.backward(grad)
                if twin is None:
                    want.backward(grad)
                else:
                    twin.backward(step)
            # the rows at the end: the static tables this rank holds, the dynamic rows it holds
            static_tables = {}
            if twin is not None:
                static_tables = twin.tables()
            else:
                state = static_dmp.state_dict()
                for name, _, _, _ in TABLES:
                    shards = state[f"{prefix}.{name}.weight"].local_shards()
                    if shards:  # table-wise: a rank holds whole tables
                        static_tables[name] = shards[0].tensor.detach().clone()
            kernels = common.dynamic_kernels(dynamic_dmp.module)
            dims = {
                n: d
                for k in kernels
                for n, d in zip(k.tables.table_names, k.tables.dims, strict=True)
            }
            dynamic_rows = {
                name: (ex.keys, ex.values[:, : dims[name]].clone())
                for name, ex in common.held_rows(kernels).items()
            }
            results[(kind, opt)] = {
                "outputs": diffs,
                "static": static_tables,
                "dynamic": dynamic_rows,
            }
    torch.save(results, out_path)
    leave()


if __name__ == "__main__":
    main()
