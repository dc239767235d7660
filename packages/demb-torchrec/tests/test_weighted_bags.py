"""Weighted and unweighted EmbeddingBagCollections of dynamic tables under
DistributedModelParallel on 1 and 2 CPU ranks over gloo (each rank a process,
``_weighted_bags_rank.py``), every KJT carrying weights. A collection built ``is_weighted=True``
pools weighted sums (SUM) and weighted averages ``sum(w * row) / sum(w)`` (MEAN: TorchRec's
row-wise MEAN, whose callback divides the summed bag by its weight); one built
``is_weighted=False`` ignores the weights (plain sums and means, as TorchRec's unsharded
EmbeddingBagCollection does), in eval and in training, and the SGD update scales each
occurrence's gradient the same way. Checked against a plain-torch computation of the bags from
the known rows, and, where TorchRec's unsharded EmbeddingBagCollection pools them (it refuses
weighted MEAN), against it."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

RANK_SCRIPT = Path(__file__).with_name("_weighted_bags_rank.py")
EXACT = {"rtol": 0.0, "atol": 0.0}  # dyadic rows, weights and gradients: exact sums
# MEAN divides (TorchRec's divisor adds 1e-6 to the bag's size or weight)
MEAN = {"rtol": 1e-5, "atol": 1e-6}


def _rank_module() -> SimpleNamespace:
    """The rank script's batches and constants (its ``main`` is not run)."""
    return SimpleNamespace(**runpy.run_path(str(RANK_SCRIPT)))


def reference(world: int, weighted: dict[str, bool]) -> tuple[dict, dict]:
    """Per collection, per rank, the ``(B, 4 + 8)`` bags, each collection applying the weights
    when ``weighted`` says so; and per table, each key's row after the SGD step (TorchRec's
    all-to-alls divide the bags' gradients by the world size)."""
    m = _rank_module()
    dims = {name: dim for c in m.COLLECTIONS for name, _, dim in m.TABLES[c]}
    rows = {name: {k: m.row(name, k, d) for k in range(m.KEYS)} for name, d in dims.items()}
    updated = {name: {k: r.clone() for k, r in per_key.items()} for name, per_key in rows.items()}
    bags: dict[str, list[torch.Tensor]] = {}
    for c in m.COLLECTIONS:
        bags[c] = []
        width = sum(d for _, _, d in m.TABLES[c])
        for rank in range(world):
            lengths, values, weights = m.batch(rank, c)
            grad = m.gradient(rank, c, width)
            out = torch.zeros(m.BATCH, width)
            col = 0
            for (name, _, dim), ln, ids, w in zip(
                m.TABLES[c], lengths, values, weights, strict=True
            ):
                scale = w if weighted[c] else torch.ones_like(w)
                start = 0
                for b, n in enumerate(ln.tolist()):
                    bag = list(
                        zip(
                            ids[start : start + n].tolist(),
                            scale[start : start + n].tolist(),
                            strict=True,
                        )
                    )
                    start += n
                    if not bag:
                        continue
                    denom = sum(s for _, s in bag) if m.POOLING[c] == "mean" else 1.0
                    out[b, col : col + dim] = sum(s * rows[name][k] for k, s in bag) / denom
                    g = grad[b, col : col + dim]
                    for k, s in bag:
                        updated[name][k] -= m.LR * s * g / denom / world
                col += dim
            bags[c].append(out)
    return bags, updated


def torchrec_bags(rank: int) -> dict[str, torch.Tensor]:
    """What TorchRec's unsharded EmbeddingBagCollection gives ``rank``'s batch from the known
    rows, per collection but weighted MEAN (which it refuses): the ``(B, 4 + 8)`` bags."""
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType

    m = _rank_module()
    out = {}
    for c in m.COLLECTIONS:
        if m.WEIGHTED[c] and m.POOLING[c] == "mean":
            continue
        configs = [
            EmbeddingBagConfig(
                name=name,
                embedding_dim=dim,
                num_embeddings=m.KEYS,
                feature_names=[feature],
                pooling=PoolingType.SUM if m.POOLING[c] == "sum" else PoolingType.MEAN,
            )
            for name, feature, dim in m.TABLES[c]
        ]
        ebc = EmbeddingBagCollection(tables=configs, is_weighted=m.WEIGHTED[c])
        lengths, values, weights = m.batch(rank, c)
        with torch.no_grad():
            for name, _, dim in m.TABLES[c]:
                weight = torch.stack([m.row(name, k, dim) for k in range(m.KEYS)])
                ebc.embedding_bags[name].weight.copy_(weight)
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=[f for _, f, _ in m.TABLES[c]],
                values=torch.cat(values),
                lengths=torch.cat(lengths),
                weights=torch.cat(weights),
            )
            out[c] = ebc(kjt).values()
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_weights_pool_only_in_a_weighted_collection(run_ranks, world):
    m = _rank_module()
    results = run_ranks(RANK_SCRIPT, world)
    want_bags, want_rows = reference(world, m.WEIGHTED)
    for c in m.COLLECTIONS:
        tol = EXACT if m.POOLING[c] == "sum" else MEAN
        for rank in range(world):
            want = want_bags[c][rank]
            assert want.abs().sum() > 0
            for mode in ("eval", "train"):
                got = results[rank][mode][c]
                torch.testing.assert_close(got, want, **tol, msg=f"{c} {mode} rank {rank}")
            if c in (twins := torchrec_bags(rank)):
                torch.testing.assert_close(twins[c], want, **MEAN, msg=f"TorchRec {c}")
    # The kernels themselves, fed weights 0.5: half the unweighted bags in a weighted
    # collection, the unweighted bags in an unweighted one.
    for rank, res in enumerate(results):
        for c in m.COLLECTIONS:
            assert res["kernels"][c], f"{c}: no dynamic-table kernel on rank {rank}"
            for with_weights, without in res["kernels"][c]:
                assert without.abs().sum() > 0
                want = without * 0.5 if m.WEIGHTED[c] else without
                torch.testing.assert_close(with_weights, want, **EXACT, msg=f"{c} kernel")
    # the batch tells weighted from unweighted pooling apart in every collection
    swapped, _ = reference(world, {c: not w for c, w in m.WEIGHTED.items()})
    for c in m.COLLECTIONS:
        for rank in range(world):
            assert not torch.allclose(want_bags[c][rank], swapped[c][rank]), c
    for name, per_key in want_rows.items():
        got_rows: dict[int, torch.Tensor] = {}
        for res in results:
            keys, rows = res["tables"][name]
            for k, r in zip(keys.tolist(), rows, strict=True):
                assert k not in got_rows, f"{name}: key {k} on two ranks"
                got_rows[k] = r
        assert sorted(got_rows) == list(range(m.KEYS)), name
        tol = EXACT if m.POOLING[name[:2]] == "sum" else MEAN
        for k, want in per_key.items():
            torch.testing.assert_close(got_rows[k], want, **tol, msg=f"{name} key {k}")
        dim = m.TABLES[name[:2]][0 if name.endswith("a") else 1][2]
        assert any(not torch.equal(want, m.row(name, k, dim)) for k, want in per_key.items())
