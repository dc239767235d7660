"""A TorchRec EmbeddingCollection of dynamic tables, planned by DynamicEmbeddingShardingPlanner and
sharded row-wise by DynamicEmbeddingCollectionSharder under DistributedModelParallel on 1, 2 and
4 CPU ranks over gloo (each rank a process): every rank's output rows, over several training steps,
equal those of one unsharded DynamicEmbeddingTables fed the global batch (all ranks' samples) and
the global gradients (divided by the world size, as TorchRec's all-to-alls do): routing, the
all-to-alls and the fused update lose and reorder nothing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from demb_torchrec import DynamicEmbeddingTables, DynamicEmbPoolingMode

RANK_SCRIPT = Path(__file__).with_name("_sharded_ec_rank.py")


def _rank_module():
    spec = importlib.util.spec_from_file_location("_sharded_ec_rank", RANK_SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_outputs(
    world: int, options, optimizer: str, kind: str = "ec"
) -> list[list[list[torch.Tensor]]]:
    """Per step, per rank, what that rank's sharded collection should output: the rows (per
    feature, ``ec``) or the bags (``ebc-*``) one unsharded module gives the global batch (every
    feature's samples of rank 0, then of rank 1, ...)."""
    ranks = _rank_module()
    modes = {
        "ec": DynamicEmbPoolingMode.NONE,
        "ebc-sum": DynamicEmbPoolingMode.SUM,
        "ebc-mean": DynamicEmbPoolingMode.MEAN,
    }
    module = DynamicEmbeddingTables(
        options,
        table_names=[t[0] for t in ranks.TABLES],
        pooling_mode=modes[kind],
        device="cpu",
        optimizer=optimizer,
        learning_rate=0.1,
    )
    features = range(len(ranks.TABLES))
    per_step = []
    for step in range(ranks.STEPS):
        batches = [ranks.batch(step, r) for r in range(world)]
        lengths = [batches[r][0][f] for f in features for r in range(world)]
        values = [batches[r][1][f] for f in features for r in range(world)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])
        out = module(torch.cat(values), offsets)
        if kind == "ec":
            counts = [v.numel() for v in values]
            pieces = list(out.split(counts))
            grads = [
                ranks.gradient(step, r, f, counts[f * world + r], ranks.TABLES[f][2])
                for f in features
                for r in range(world)
            ]
            got = [[pieces[f * world + r].detach() for f in features] for r in range(world)]
        else:  # (B * world, sum of dims): rank r's bags are rows [r * B, (r + 1) * B)
            batch = ranks.BATCH
            grads = [ranks.gradient(step, r, 0, batch, out.shape[1]) for r in range(world)]
            got = [[out[r * batch : (r + 1) * batch].detach()] for r in range(world)]
        # TorchRec's all-to-alls divide gradients by the world size (comm_ops.GRADIENT_DIVISION,
        # on by default), as DDP averages dense gradients: the global gradient of the step.
        torch.autograd.backward([out], [torch.cat(grads) / world])
        per_step.append(got)
    return per_step


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("world", "dist_type", "optimizer"),
    [
        (1, "roundrobin", "sgd"),
        (2, "roundrobin", "adam"),
        (2, "hash_roundrobin", "sgd"),
        (4, "continuous", "sgd"),
    ],
)
def test_sharded_rows_equal_one_unsharded_module(run_ranks, world, dist_type, optimizer):
    results = run_ranks(RANK_SCRIPT, world, dist_type, optimizer, "ec")
    options = results[0]["options"]
    capacity = -(-1000 // world)
    assert options[0].max_capacity == -(-capacity // 128) * 128  # planned per rank
    unsharded = [
        type(o)(**{**o.__dict__, "max_capacity": 2048, "init_capacity": None}) for o in options
    ]
    want = reference_outputs(world, unsharded, optimizer)
    for step, per_rank in enumerate(want):
        for r in range(world):
            got = results[r]["outputs"][step]
            for f, (g, w) in enumerate(zip(got, per_rank[r], strict=True)):
                assert torch.equal(g, w), (
                    f"step {step} rank {r} feature {f}: max diff {(g - w).abs().max()}"
                )


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("world", "kind", "optimizer"),
    [(1, "ebc-sum", "sgd"), (2, "ebc-sum", "adam"), (2, "ebc-mean", "sgd")],
)
def test_sharded_bags_equal_one_unsharded_module(run_ranks, world, kind, optimizer):
    results = run_ranks(RANK_SCRIPT, world, "roundrobin", optimizer, kind)
    options = results[0]["options"]
    unsharded = [
        type(o)(**{**o.__dict__, "max_capacity": 2048, "init_capacity": None}) for o in options
    ]
    want = reference_outputs(world, unsharded, optimizer, kind)
    for step, per_rank in enumerate(want):
        for r in range(world):
            (got,) = results[r]["outputs"][step]
            # On one rank a bag is summed in bag order, as the unsharded module does. On more,
            # each rank sums the bag's keys it owns and the partial sums are added (TorchRec's
            # reduce-scatter), then MEAN divides (TorchRec's callback): equal up to rounding.
            exact = world == 1 and kind == "ebc-sum"
            tol = {"rtol": 0.0, "atol": 0.0} if exact else {"rtol": 1e-5, "atol": 1e-6}
            torch.testing.assert_close(got, per_rank[r][0], **tol, msg=f"step {step} rank {r}")
