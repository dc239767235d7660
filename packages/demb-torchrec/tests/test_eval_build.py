"""An eval (export) build of a model with dynamic tables under DistributedModelParallel on 1 and
2 CPU ranks over gloo (each rank a process, ``_eval_build_rank.py``): collections sharded
without any in-backward optimizer, and tables planned with ``training=False`` (with or without
one), build; their tables hold no optimizer state; DynamicEmbLoad (rows only) fills them from
a checkpoint a trained twin dumped; their eval lookups give every key its trained row (keys the
checkpoint lacks: the eval initializer's zeros), as the trained model's own eval lookups do;
and a training step's backward raises ``RuntimeError`` naming the tables and saying they have
no optimizer, leaving every loaded row as it was."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

RANK_SCRIPT = Path(__file__).with_name("_eval_build_rank.py")


def _rank_module() -> SimpleNamespace:
    """The rank script's batches and constants (its ``main`` is not run)."""
    return SimpleNamespace(**runpy.run_path(str(RANK_SCRIPT)))


def _merged(results: list[dict]) -> dict[str, dict[int, torch.Tensor]]:
    """Per table, key -> row over every rank (each key on one rank only)."""
    merged: dict[str, dict[int, torch.Tensor]] = {}
    for res in results:
        for name, (keys, rows) in res["tables"].items():
            table = merged.setdefault(name, {})
            for k, r in zip(keys.tolist(), rows, strict=True):
                assert k not in table, f"{name}: key {k} on two ranks"
                table[k] = r
    return merged


def expected_outputs(rank: int, rows: dict[str, dict[int, torch.Tensor]]) -> dict:
    """Plain torch: ``rank``'s eval outputs from the rows (per feature rows of each id for an
    EmbeddingCollection, the ``(B, dim)`` bag sums for the EmbeddingBagCollection); a key
    without a row reads zeros."""
    m = _rank_module()
    out: dict = {}
    for c, tables in m.COLLECTIONS.items():
        lengths, values = m.batch(m.EVAL_STEP, rank, c)
        per_feature = lengths.view(len(tables), m.BATCH)
        ids = values.split(per_feature.sum(1).tolist())
        found = {}
        for (name, feature, dim, _), ln, keys in zip(tables, per_feature, ids, strict=True):
            zero = torch.zeros(dim)
            looked_up = [rows[name].get(k, zero) for k in keys.tolist()]
            found[feature] = torch.stack(looked_up) if looked_up else torch.zeros(0, dim)
            if c == "bags":
                bags = [b.sum(0) for b in found[feature].split(ln.tolist())]
                found[feature] = torch.stack(bags)
        out[c] = found["fc"] if c == "bags" else found
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_an_eval_build_loads_looks_up_and_refuses_to_train(run_ranks, tmp_path, world):
    m = _rank_module()
    ckpt = str(tmp_path / "ckpt")
    trained = run_ranks(RANK_SCRIPT, world, "train", ckpt)
    built = run_ranks(RANK_SCRIPT, world, "eval", ckpt)
    rows = _merged(trained)
    names = [n for tables in m.COLLECTIONS.values() for n, *_ in tables]
    assert sorted(rows) == sorted(names)
    assert all(len(rows[n]) >= 8 for n in names)  # trained keys
    # nothing inserted by the eval lookup: each table holds the checkpoint's keys
    for n in names:
        assert sum(res["eval_sizes"][n] for res in built) == len(rows[n]), n
    close = {"rtol": 0.0, "atol": 0.0} if world == 1 else {"rtol": 1e-6, "atol": 1e-6}
    for rank in range(world):
        res = built[rank]
        assert res["state_dims"] == dict.fromkeys(names, 0)
        want = expected_outputs(rank, rows)
        got, twin = res["eval"], trained[rank]["eval"]
        torch.testing.assert_close(got["bags"], want["bags"], **close)
        assert torch.equal(got["bags"], twin["bags"])  # the trained model's own lookup
        for c in ("seq", "frozen"):
            for f, rows_f in want[c].items():
                assert torch.equal(got[c][f], rows_f), f"rank {rank} {f}"
                assert torch.equal(twin[c][f], rows_f), f"rank {rank} {f}"
        # some looked-up keys were never trained (zeros), most were
        seq = torch.cat(list(want["seq"].values()))
        assert (seq.abs().sum(1) == 0).any()
        assert (seq.abs().sum(1) > 0).sum() > seq.shape[0] // 2
        # a training step's backward raises, naming the tables and the missing optimizer
        errors = res["errors"]
        for c, tables in m.COLLECTIONS.items():
            assert errors[c] is not None, f"{c}: the training step did not raise"
            stage, message = errors[c]
            assert stage == "backward", message
            assert str([n for n, *_ in tables]) in message
            if c in m.NO_OPTIMIZER:
                assert "no optimizer, so they cannot train" in message
            else:
                assert "training=False, so they hold no optimizer state" in message
    # ... and changes no loaded row
    after = _merged(built)
    for n in names:
        for k, row in rows[n].items():
            assert torch.equal(after[n][k], row), f"{n} key {k}"


def test_a_table_without_optimizer_gets_none_and_refuses_its_hyper_parameters():
    from demb_torchrec import DynamicEmbTableOptions
    from demb_torchrec.lookup import kernel_arguments
    from demb_torchrec.planner import TABLES_KEY, PlannedTables

    planned = PlannedTables({"t": DynamicEmbTableOptions(dim=4, max_capacity=128)})
    options, optimizer, hyper = kernel_arguments("t", {TABLES_KEY: planned, "enforce_hbm": False})
    assert options is planned["t"]
    assert optimizer is None
    assert hyper == {}
    with pytest.raises(ValueError, match=r"table 't': learning_rate given, but no optimizer"):
        kernel_arguments("t", {TABLES_KEY: planned, "learning_rate": 0.1})
