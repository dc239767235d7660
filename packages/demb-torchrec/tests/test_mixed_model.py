"""End to end: a model with an EmbeddingBagCollection and an
EmbeddingCollection, each holding a dynamic and a static table, plus a dense layer, planned by
DynamicEmbeddingShardingPlanner and trained under DistributedModelParallel with
apply_optimizer_in_backward on 1, 2 and 4 gloo ranks (each rank a process), and on one GPU over
NCCL (marker ``cuda``; the GPU machine's trimmed fbgemm_gpu has no TBE kernel a static table
could run on, so there all four tables are dynamic): it trains (the loss of every rank's fixed
batch falls), dynamic tables are planned row-wise and hold keys far above their num_embeddings,
static tables are planned by TorchRec."""

from __future__ import annotations

from pathlib import Path

import pytest

RANK_SCRIPT = Path(__file__).with_name("_mixed_model_rank.py")


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_mixed_model_trains_on_gloo_ranks(run_ranks, world):
    check_training(run_ranks, world, "cpu")


@pytest.mark.cuda
def test_mixed_model_trains_on_one_gpu_over_nccl(run_ranks):
    check_training(run_ranks, 1, "cuda")


def check_training(run_ranks, world: int, device: str) -> None:
    results = run_ranks(RANK_SCRIPT, world, device)
    for r, result in enumerate(results):
        losses = result["losses"]
        assert losses[-1] < 0.5 * losses[0], f"rank {r} did not train: {losses}"
        assert result["shardings"]["user"] == "row_wise"
        assert result["shardings"]["query"] == "row_wise"
        if device == "cpu":  # on the GPU machine every table is dynamic (no FBGEMM TBE there)
            assert result["shardings"]["item"] != "row_wise"
            assert result["shardings"]["cat"] == "table_wise"
    held = [sum(r["held"][t] for r in results) for t in ("user", "query")]
    assert all(h > 0 for h in held), held  # every batch's dynamic keys are somewhere
