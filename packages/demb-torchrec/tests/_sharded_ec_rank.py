"""One rank of test_sharded_collection.py: an EmbeddingCollection (KIND ``ec``; ``ec-admit``:
with frequency admission, threshold 2; ``ec-cache``: caching tables of 16 rows a rank;
``ec-cache-pipeline``: the same trained by TorchRec's PrefetchTrainPipelineSparseDist, which
prefetches each next batch between a step's forward and its backward;
``ec-hybrid``: hybrid tables, 16 rows a rank on the device) or an
EmbeddingBagCollection (``ebc-sum``, ``ebc-mean``) of dynamic tables planned by
DynamicEmbeddingShardingPlanner, sharded row-wise by the dynamic-table sharder under
DistributedModelParallel over gloo, trained a few steps on this rank's batches; writes each
step's outputs to OUT (per feature rows for ``ec``, the ``(B, sum of dims)`` bags otherwise),
the ids each step's lookup received, and every table's keys and scores at the end (``ec``
tables score LFU: deduplicated ids must still count every occurrence).

Usage: ``python _sharded_ec_rank.py RANK WORLD STORE OUT DIST_TYPE OPTIMIZER KIND [DEVICE]``
(DEVICE ``cuda``: rank ``r`` on GPU ``r`` over NCCL; outputs and tables saved on the CPU).
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

STEPS = 3
BATCH = 6  # samples per rank
CLIP = 0.05  # max_gradient of OPTIMIZER sgd-clip
ADAGRAD_EPS = 1e-8  # TorchRec's Adagrad defaults to 1e-10, demb's to 1e-8
TABLES = (("a", "fa", 8, 1000), ("b", "fb", 8, 300))  # name, feature, dim, num_embeddings


def batch(step: int, rank: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per feature, this rank's (lengths, values) at ``step``: 0-4 ids per sample, some hot
    ids shared with other ranks, some far above num_embeddings."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    lengths, values = [], []
    for _, _, _, rows in TABLES:
        ln = torch.randint(0, 5, (BATCH,), generator=gen)
        n = int(ln.sum())
        hot = torch.randint(0, 8, (n,), generator=gen)
        cold = torch.randint(0, 10 * rows, (n,), generator=gen)
        pick = torch.rand(n, generator=gen) < 0.5
        lengths.append(ln)
        values.append(torch.where(pick, hot, cold))
    return lengths, values


def gradient(step: int, rank: int, feature: int, n: int, dim: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7919 * step + 97 * rank + feature)
    return torch.randn(n, dim, generator=gen)


def pipelined(dmp: torch.nn.Module, rank: int, device: torch.device) -> list[list[torch.Tensor]]:
    """Train ``dmp`` (a DistributedModelParallel of a :func:`net`) by TorchRec's
    PrefetchTrainPipelineSparseDist over this rank's batches, with the gradients of the plain
    loop (the loss is the sum of rows times gradients); each step's rows."""
    from _rank_common import features
    from torchrec.datasets.utils import Batch
    from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist

    names = [f for _, f, _, _ in TABLES]

    class PipelineBatch(Batch):  # type: ignore[misc]
        """A Batch whose record_stream is nothing on the CPU (the pipeline calls it with the
        CPU's stand-in stream, which tensors do not take)."""

        def record_stream(self, stream: Any) -> None:
            if self.dense_features.is_cuda:
                super().record_stream(stream)

        def to(self, device: torch.device, non_blocking: bool = False) -> PipelineBatch:
            b = super().to(device, non_blocking=non_blocking)
            return PipelineBatch(b.dense_features, b.sparse_features, b.labels)

    def batches():  # type: ignore[no-untyped-def]
        for step in range(STEPS):
            lengths, values = batch(step, rank)
            grads = [gradient(step, rank, i, v.numel(), TABLES[i][2]) for i, v in enumerate(values)]
            kjt = features(names, lengths, values, device)
            yield PipelineBatch(torch.cat(grads).to(device), kjt, torch.zeros(1, device=device))

    idle = torch.zeros(1, requires_grad=True)  # the pipeline steps an optimizer: one of nothing
    pipeline = PrefetchTrainPipelineSparseDist(dmp, torch.optim.SGD([idle], lr=0.0), device)
    it = batches()
    outputs = []
    while True:
        try:
            rows = pipeline.progress(it)
        except StopIteration:
            return outputs
        outputs.append([r.detach().cpu() for r in rows])


def net(collection: torch.nn.Module) -> torch.nn.Module:
    """A module whose forward takes a torchrec ``Batch`` and returns ``(loss, rows)``: the
    collection's rows per feature of ``batch.sparse_features`` and the sum of the rows times
    ``batch.dense_features`` (each feature's gradients, concatenated)."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = collection

        def forward(self, b: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
            out = self.ec(b.sparse_features)
            rows = [out[f].values() for _, f, _, _ in TABLES]
            grads = b.dense_features.split([r.shape[0] for r in rows])
            loss = sum((rows[i] * grads[i]).sum() for i in range(len(rows)))
            return loss.reshape(1), rows

    return Net()


def main() -> None:
    from _rank_join import join, leave  # beside this script (also loaded as a module by tests)

    rank, world, out_path, device, (dist_type, optimizer, kind) = join(3)
    import _rank_common as common
    from demb_torchrec import (
        DynamicEmbInitializerArgs,
        DynamicEmbInitializerMode,
        DynamicEmbScoreStrategy,
    )
    from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder as BagSharder
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder as SequenceSharder
    from torchrec import PoolingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    model: torch.nn.Module
    admit = kind == "ec-admit"  # ec with frequency admission on every table
    pipeline = kind == "ec-cache-pipeline"  # ec-cache trained by TorchRec's prefetch pipeline
    cache = kind in ("ec-cache", "ec-cache-pipeline")  # a small device cache, every table
    hybrid = kind == "ec-hybrid"  # ec with hybrid tables: 16 rows a rank on the device
    kind = "ec" if admit or cache or hybrid else kind
    if kind == "ec":
        model = common.sequence_collection(TABLES)
        # sgd-clip: clipping knobs given through the sharder's fused params
        clip = {"gradient_clipping": True, "max_gradient": CLIP} if optimizer == "sgd-clip" else {}
        sharder: Any = SequenceSharder(fused_params=clip or None)
    else:
        pooling = PoolingType.SUM if kind == "ebc-sum" else PoolingType.MEAN
        model = common.bag_collection(TABLES, pooling)
        sharder = BagSharder()
    kwargs = {"lr": 0.1, **({"eps": ADAGRAD_EPS} if "adagrad" in optimizer else {})}
    opt_class = common.OPTIMIZER_CLASSES[optimizer.removesuffix("-clip")]
    apply_optimizer_in_backward(opt_class, model.parameters(), kwargs)
    init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.1)
    strategy = DynamicEmbScoreStrategy.LFU if kind == "ec" else DynamicEmbScoreStrategy.STEP
    extra: dict[str, Any] = {}
    if admit:
        from demb_torchrec import FrequencyAdmissionStrategy, KVCounter

        extra["admit_strategy"] = FrequencyAdmissionStrategy(2, KVCounter(4096))
    if cache or hybrid:  # 16 rows a rank: a cache of one bucket, or a hybrid table's
        from demb_torchrec import DynamicEmbeddingTables, DynamicEmbTableOptions

        probe = DynamicEmbeddingTables(
            [DynamicEmbTableOptions(dim=8, max_capacity=128)], device="cpu", optimizer=optimizer
        )
        row_bytes = probe.tables.values[0].shape[1] * 4
        extra.update(caching=cache, global_hbm_for_values=16 * row_bytes * world)
    constraints = {
        n: common.dynamic(
            initializer_args=init, dist_type=dist_type, score_strategy=strategy, **extra
        )
        for n, _, _, _ in TABLES
    }
    configs = common.table_configs(model)
    if pipeline:
        model = net(model)
    dmp = common.shard(model, configs, constraints, [sharder], device)
    kernels = common.dynamic_kernels(dmp.module.ec if pipeline else dmp.module)
    assert kernels
    received: list[int] = []
    for k in kernels:
        k.register_forward_pre_hook(lambda _, args: received.append(args[0].values().numel()))
    outputs = pipelined(dmp, rank, device) if pipeline else []
    for step in range(0 if pipeline else STEPS):
        lengths, values = batch(step, rank)
        out = dmp(common.features([f for _, f, _, _ in TABLES], lengths, values, device))
        # ec: rows per feature; ebc: the (B, sum of dims) bags, features in order
        rows = [out[f].values() for _, f, _, _ in TABLES] if kind == "ec" else [out.values()]
        outputs.append([r.detach().cpu() for r in rows])
        grads = [
            gradient(step, rank, i, r.shape[0], r.shape[1]).to(device) for i, r in enumerate(rows)
        ]
        torch.autograd.backward(rows, grads)
    cache_stats = [k.tables.cache_stats() for k in kernels]
    tables = {
        name: (ex.keys.cpu(), ex.scores.cpu()) for name, ex in common.held_rows(kernels).items()
    }
    torch.save(
        {
            "outputs": outputs,
            "options": [constraints[n].dynamicemb_options for n, *_ in TABLES],
            "received": received,
            "tables": tables,
            "cache_stats": cache_stats,
        },
        out_path,
    )
    leave()


if __name__ == "__main__":
    main()
