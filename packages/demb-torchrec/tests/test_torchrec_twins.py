"""TorchRec twins: the same model with dynamic tables (under DistributedModelParallel on
1 and 2 gloo ranks) and with TorchRec's static tables, from the same rows, fed the same batches
and gradients for 10 steps: every step's outputs and, at the end, every key's row agree, for an
EmbeddingCollection and an EmbeddingBagCollection (SUM and MEAN). The static twin runs SGD,
Adagrad and row-wise Adagrad on FBGEMM's fused CPU TBE under DistributedModelParallel; FBGEMM's
CPU TBE has no Adam, so Adam's twin is TorchRec's unsharded collection with sparse gradients and
torch.optim.SparseAdam fed the global batch (see _twin_rank.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

RANK_SCRIPT = Path(__file__).with_name("_twin_rank.py")


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_dynamic_and_static_twins_agree(run_ranks, world):
    per_rank = run_ranks(RANK_SCRIPT, world)
    assert len(per_rank[0]) == 12  # 3 collection kinds x 4 optimizers
    for config in per_rank[0]:
        for r in range(world):
            for step, (diff, scale) in enumerate(per_rank[r][config]["outputs"]):
                assert diff <= 1e-5 * (1 + scale), f"{config} rank {r} step {step}: {diff}"
        static = {n: t for res in per_rank for n, t in res[config]["static"].items()}
        dynamic: dict[str, dict[int, torch.Tensor]] = {}
        for res in per_rank:
            for name, (keys, rows) in res[config]["dynamic"].items():
                dynamic.setdefault(name, {}).update(zip(keys.tolist(), rows, strict=True))
        assert sorted(static) == sorted(dynamic) == ["a", "b"]
        for name, table in static.items():
            keys = sorted(dynamic[name])
            assert keys, f"{config}: no key of table {name} was trained"
            got = torch.stack([dynamic[name][k] for k in keys])
            # Adam's step is lr * m / sqrt(v): for a key with small gradients the sums' rounding
            # (other orders of adding a key's occurrences) is amplified by 1 / sqrt(v)
            atol = 1e-4 if config[1] == "adam" else 1e-5
            torch.testing.assert_close(got, table[keys], rtol=1e-6, atol=atol, msg=str(config))
            untouched = torch.ones(table.shape[0], dtype=torch.bool)
            untouched[keys] = False  # keys never seen keep their initial rows in the static twin
            rows, dim = table.shape
            initial = torch.arange(rows, dtype=torch.float32).unsqueeze(1) + torch.arange(dim) / 256
            assert torch.equal(table[untouched], initial[untouched])
