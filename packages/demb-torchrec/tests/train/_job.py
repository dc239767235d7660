"""Running ``demb train`` / ``demb serve`` in a subprocess (each run makes its own process
group) and reading what a run wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from demb_io import Checkpoint, read_shard
from demb_torchrec.train.report import read_records

SMALL = [
    "--steps", "120", "--batch-size", "256", "--log-every", "20", "--eval-every", "40",
    "--delta-every", "40", "--ckpt-every", "80", "--no-progress",
    "--set", "data.eval_samples=2048",
]  # fmt: skip
"""A small run of the default job: 120 steps, a delta every 40, a checkpoint every 80."""


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out["PYTHONUNBUFFERED"] = "1"
    return out


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "demb_torchrec.train", *args]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run ``python -m demb_torchrec.train args`` to its end (output captured)."""
    return subprocess.run(
        command(*args), env=env(), capture_output=True, text=True, timeout=timeout, check=False
    )


def records(out: Path, name: str = "train.jsonl") -> list[dict[str, Any]]:
    return read_records(out / name)


def final_tables(out: Path, step: int) -> dict[str, dict[str, np.ndarray]]:
    """The final checkpoint's rows per table, ordered by key: keys, values, state, scores."""
    path = out / "ckpt" / f"{step:08d}.tables"
    ckpt = Checkpoint(path)
    tables: dict[str, dict[str, np.ndarray]] = {}
    for collection in ckpt.collections():
        for meta in ckpt.shards(collection):
            data = read_shard(path / collection, meta)
            order = np.argsort(data.keys)
            tables[meta.table] = {
                "keys": data.keys[order],
                "values": data.values[order],
                "state": data.state[order] if data.state is not None else np.zeros(0),
                "scores": data.scores[order],
            }
    return tables


def final_dense(out: Path, step: int) -> dict[str, torch.Tensor]:
    state = torch.load(out / "ckpt" / f"{step:08d}.pt", weights_only=True)
    return dict(state["dense"])
