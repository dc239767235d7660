"""Shared by the online-training tests: a model holding one unplanned DynamicEmbeddingTables
module, training steps over chosen keys, and comparisons of two models' tables."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch
from demb_io import Checkpoint
from demb_torchrec import (
    DynamicEmbeddingTables,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EvictedItemMode,
)
from torch import nn

S = DynamicEmbScoreStrategy
NAMES = ("user", "item")


class Model(nn.Module):
    """``model.sparse`` is a DynamicEmbeddingTables of tables ``user`` and ``item``: its
    collection is ``sparse``."""

    def __init__(
        self,
        score: object = S.TIMESTAMP,
        capacity: int = 128,
        bucket: int = 16,
        dims: tuple[int, int] = (8, 4),
        optimizer: str = "adam",
        retain: bool = False,
        device: str = "cpu",
        **options: object,
    ) -> None:
        super().__init__()
        mode = EvictedItemMode.RETAIN_KEY if retain else EvictedItemMode.DISCARD
        opts = [
            DynamicEmbTableOptions(
                dim=d,
                max_capacity=capacity,
                bucket_capacity=bucket,
                score_strategy=score,  # type: ignore[arg-type]
                evicted_item_mode=mode,
                **options,  # type: ignore[arg-type]
            )
            for d in dims
        ]
        self.sparse = DynamicEmbeddingTables(
            opts,
            table_names=list(NAMES),
            pooling_mode=DynamicEmbPoolingMode.SUM,
            optimizer=optimizer,
            learning_rate=0.05,
            device=device,
        )


def step(model: Model, user: torch.Tensor, item: torch.Tensor) -> None:
    """One training step looking up ``user`` keys (feature 0, one bag) and ``item`` keys
    (feature 1, one bag)."""
    device = model.sparse.device
    keys = torch.cat([user.cpu(), item.cpu()]).to(torch.int64)
    offsets = torch.tensor([0, user.numel(), keys.numel()], dtype=torch.int64)
    model.sparse(keys.to(device), offsets.to(device)).square().sum().backward()


def random_step(model: Model, gen: torch.Generator, key_range: int = 3000, n: int = 12) -> None:
    """A step over ``n`` random keys per table drawn from ``[0, key_range)``."""
    user = torch.randint(0, key_range, (n,), generator=gen)
    item = torch.randint(0, key_range, (n,), generator=gen)
    step(model, user, item)


def table_state(model: Model) -> dict[str, tuple]:
    """Per table: keys, digests, scores of every slot, its size, and the rows of occupied slots
    (empty slots' rows are left over from former keys and mean nothing)."""
    s = model.sparse.tables
    out = {}
    for t, name in enumerate(NAMES):
        lo, hi = s.index.slot_range(t)
        keys = s.index.keys[lo:hi].clone()
        occupied = keys != -1
        out[name] = (
            keys,
            s.index.digests[lo:hi].clone(),
            s.index.scores[:, lo:hi].clone(),
            int(s.index.sizes[t]),
            s.values[t][occupied.to(s.values[t].device)].clone(),
        )
    return out


def assert_same_tables(a: Model, b: Model) -> None:
    """``b``'s tables equal ``a``'s bit for bit: keys and slots, digests, scores, sizes, rows
    with optimizer state."""
    sa, sb = table_state(a), table_state(b)
    for name in NAMES:
        fields = ("keys", "digests", "scores", "size", "rows")
        for field, x, y in zip(fields, sa[name], sb[name], strict=True):
            same = x == y if isinstance(x, int) else torch.equal(x, y)
            assert same, f"{name}: {field} differ"


def checksum(model: Model) -> str:
    """A digest of every index tensor and value buffer of the model (any change shows)."""
    s = model.sparse.tables
    h = hashlib.sha256()
    for tensor in (s.index.keys, s.index.digests, s.index.scores, s.index.sizes, *s.values):
        h.update(tensor.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def next_threshold(deltas: dict) -> dict[str, dict[str, int]]:
    """The thresholds of the next window: each table's ``current_score``."""
    return {
        c: {r.table_names[i]: r.meta[i]["current_score"] for i in range(len(r.table_names))}
        for c, r in deltas.items()
    }


def present(model: Model, t: int) -> set[int]:
    """The keys table ``t`` holds."""
    return set(model.sparse.tables.export(t).keys.tolist())


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
"""Parametrize a test over the CPU and (marker ``cuda``) the GPU."""


def checkpoint_content(path: Path, collection: str) -> dict[str, dict[int, tuple[Any, ...]]]:
    """Per table of ``collection`` in the checkpoint at ``path``, key -> (embedding, state,
    scores) over every shard (each key once)."""
    ckpt = Checkpoint(path)
    out: dict[str, dict[int, tuple[Any, ...]]] = {}
    for table in ckpt.tables(collection):
        data = ckpt.read_table(collection, table)
        rows = out.setdefault(table, {})
        for i, key in enumerate(data.keys.tolist()):
            assert key not in rows
            state = None if data.state is None else data.state[i].tolist()
            rows[key] = (data.values[i].tolist(), state, data.scores[i].tolist())
    return out
