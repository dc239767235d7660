"""DynamicEmbDump on 2 CPU ranks (gloo), DynamicEmbLoad on 1 (marker ``slow``: on 4 too;
marker ``cuda``: the same between every pair of GPU world sizes the machine has, over NCCL): a
model with an EmbeddingCollection and an EmbeddingBagCollection of dynamic tables holds, after
the load, the same keys with the same embeddings, scores and (``optim``) optimizer state as the
trained model that was dumped, each key on the rank that owns it under the new world size."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from demb_planner import continuous_block_size, owner_rank

RANK_SCRIPT = Path(__file__).with_name("_dump_load_rank.py")
DIMS = {"ua": 8, "ub": 8, "ia": 8}
ROUTING = {"ua": ("roundrobin", None), "ub": ("roundrobin", None), "ia": ("continuous", 600)}


def _merged(results: list[dict], world: int) -> dict:
    """Per (collection, table), key -> (row, scores) over every rank, checking that each key
    is on its owner rank and on no other."""
    merged: dict = {}
    for rank, content in enumerate(results):
        for (collection, table), (keys, rows, scores) in content.items():
            dist_type, n = ROUTING[table]
            block = continuous_block_size(n, world) if n else None
            owners = owner_rank(keys.numpy(), world, dist_type, block)
            assert (owners == rank).all(), f"{table}: keys on rank {rank} owned elsewhere"
            table_rows = merged.setdefault((collection, table), {})
            for k, r, s in zip(keys.tolist(), rows.tolist(), scores.tolist(), strict=True):
                assert k not in table_rows, f"{table}: key {k} on two ranks"
                table_rows[k] = (r, s)
    return merged


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("optim", "loads"),
    [
        ("optim", [1]),
        pytest.param("optim", [1, 4], marks=pytest.mark.slow),
        pytest.param("rows", [1, 4], marks=pytest.mark.slow),
    ],
)
def test_dump_on_two_ranks_loads_on_one_and_four(run_ranks, tmp_path, optim, loads):
    check_round_trips(run_ranks, tmp_path / "ckpt", 2, loads, optim, "cpu")


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4, 8])
def test_dump_on_gpus_loads_on_every_gpu_world_size(run_ranks, tmp_path, world):
    gpus = torch.cuda.device_count()
    if gpus < world:
        pytest.skip(f"needs {world} GPUs, {gpus} visible")
    loads = [w for w in (1, 2, 4, 8) if w <= gpus]
    check_round_trips(run_ranks, tmp_path / "ckpt", world, loads, "optim", "cuda")


def check_round_trips(
    run_ranks, ckpt: Path, world: int, loads: list[int], optim: str, device: str
) -> None:
    dumped = _merged(run_ranks(RANK_SCRIPT, world, "dump", str(ckpt), optim, device), world)
    assert set(dumped) == {("ec", "ua"), ("ec", "ub"), ("ebc", "ia")}
    assert all(len(rows) > 20 for rows in dumped.values())
    for load in loads:
        loaded = _merged(run_ranks(RANK_SCRIPT, load, "load", str(ckpt), optim, device), load)
        assert loaded.keys() == dumped.keys()
        for name, want in dumped.items():
            got = loaded[name]
            assert got.keys() == want.keys(), f"{name} on {load} ranks"
            dim = DIMS[name[1]]
            for k, (row, scores) in want.items():
                assert got[k][1] == scores, f"{name} key {k}"
                if optim == "optim":
                    assert got[k][0] == row, f"{name} key {k}"
                else:  # rows exact; Adam's moments start over
                    assert got[k][0][:dim] == row[:dim], f"{name} key {k}"
                    assert got[k][0][dim:] == [0.0] * (2 * dim)
                    assert any(v != 0.0 for v in row[dim:])  # the dump had trained state
