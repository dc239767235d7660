"""A TorchRec EmbeddingCollection of dynamic tables, planned by DynamicEmbeddingShardingPlanner and
sharded row-wise by DynamicEmbeddingCollectionSharder under DistributedModelParallel on 1, 2 and
4 CPU ranks over gloo (each rank a process): every rank's output rows, over several training steps,
equal those of one unsharded DynamicEmbeddingTables fed the global batch (all ranks' samples) and
the global gradients (divided by the world size, as TorchRec's all-to-alls do): routing, the
all-to-alls and the fused update lose and reorder nothing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
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


def run_ranks(tmp_path: Path, world: int, dist_type: str, optimizer: str) -> list[dict]:
    store = tmp_path / "store"
    outs = [tmp_path / f"rank{r}.pt" for r in range(world)]
    extra = (dist_type, optimizer)
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANK_SCRIPT), *map(str, (r, world, store, outs[r])), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(world)
    ]
    logs = [p.communicate(timeout=600)[0].decode(errors="replace") for p in procs]
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
    return [torch.load(o, weights_only=False) for o in outs]


def reference_outputs(world: int, options, optimizer: str) -> list[list[list[torch.Tensor]]]:
    """Per step, per rank, per feature: the rows one unsharded module gives the global batch."""
    ranks = _rank_module()
    module = DynamicEmbeddingTables(
        options,
        table_names=[t[0] for t in ranks.TABLES],
        pooling_mode=DynamicEmbPoolingMode.NONE,
        device="cpu",
        optimizer=optimizer,
        learning_rate=0.1,
    )
    per_step = []
    for step in range(ranks.STEPS):
        batches = [ranks.batch(step, r) for r in range(world)]
        lengths, values, counts = [], [], []
        for f in range(len(ranks.TABLES)):
            for r in range(world):
                lengths.append(batches[r][0][f])
                values.append(batches[r][1][f])
                counts.append(int(batches[r][1][f].numel()))
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])
        out = module(torch.cat(values), offsets)
        pieces = list(out.split(counts))
        grads = [
            ranks.gradient(step, r, f, counts[f * world + r], dim)
            for f, (_, _, dim, _) in enumerate(ranks.TABLES)
            for r in range(world)
        ]
        # TorchRec's all-to-alls divide gradients by the world size (comm_ops.GRADIENT_DIVISION,
        # on by default), as DDP averages dense gradients: the global gradient of the step.
        torch.autograd.backward([out], [torch.cat(grads) / world])
        features = range(len(ranks.TABLES))
        per_step.append([[pieces[f * world + r].detach() for f in features] for r in range(world)])
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
def test_sharded_rows_equal_one_unsharded_module(tmp_path, world, dist_type, optimizer):
    results = run_ranks(tmp_path, world, dist_type, optimizer)
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
