"""Small demb-io files and single random mutations of them: what ``demb bench fuzz`` and
demb-io's robustness tests read back to check that a damaged checkpoint or delta ends in a
typed error (or reads back the same rows), never in anything else.

:func:`small_checkpoint` writes a two-rank checkpoint of one table and :func:`small_delta` a
delta of one table, both a few rows of every kind of array; :func:`mutate` damages one file's
bytes: a meta edited as JSON (a field deleted or set to an odd value), or the bytes truncated,
extended, or with one or several bits or bytes flipped.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from demb_io.checkpoint import CheckpointWriter
from demb_io.delta import DeltaMeta, DeltaTable, write_delta
from demb_io.meta import ShardMeta
from demb_io.shard import ShardData

__all__ = [
    "JSON_VALUES",
    "mutate",
    "mutate_bytes",
    "mutate_json",
    "small_checkpoint",
    "small_delta",
]

JSON_VALUES: tuple[Any, ...] = (
    None, True, 0, -1, 1, 2**70, 1.5, "", "x", "float16", [], ["LFU"], [1, 2], {},
)  # fmt: skip
"""The values :func:`mutate_json` sets a field to: wrong types, sizes and names."""


def small_checkpoint(path: Path) -> None:
    """Write a checkpoint at ``path``: collection ``ebc``, table ``t`` on two ranks
    (``hash_roundrobin``), 4 and 5 bfloat16 rows of dim 3 with two scores, adagrad state of
    width 3 and admission counters."""
    rng = np.random.default_rng(0)
    with CheckpointWriter(path) as w:
        for rank in range(2):
            meta = ShardMeta(
                collection="ebc",
                table="t",
                rank=rank,
                world_size=2,
                dist_type="hash_roundrobin",
                embedding_dtype="bfloat16",
                embedding_dim=3,
                rows=0,
                score_strategy=("TIMESTAMP", "LFU"),
                optimizer="adagrad",
                optim_state_dtype="float32",
                state_width=3,
                admission_rows=0,
            )
            n = 4 + rank
            w.write_shard(
                meta,
                [
                    ShardData(
                        np.arange(n, dtype=np.int64) * 2 + rank,
                        rng.integers(0, 2**16, (n, 3), dtype=np.uint16),
                        rng.integers(0, 99, (n, 2), dtype=np.int64),
                        rng.standard_normal((n, 3)).astype(np.float32),
                        np.array([7, 8], dtype=np.int64),
                        np.array([1, 2], dtype=np.int64),
                    )
                ],
            )


def small_delta(path: Path) -> None:
    """Write a delta at ``path``: table ``t`` of collection ``ebc``, 5 float16 rows of dim 2
    with their slots, one score, float16 state of width 1, an erased key and two evicted
    ones."""
    rng = np.random.default_rng(1)
    meta = DeltaMeta(
        collection="ebc",
        table="t",
        embedding_dtype="float16",
        embedding_dim=2,
        score_strategy=("TIMESTAMP",),
        current_score=99,
        current_capacity=256,
        row_capacity=(256,),
        bucket_capacity=128,
        world_size=2,
        dist_type="roundrobin",
        optim_state_dtype="float16",
        state_width=1,
        evicted_rows=0,
    )
    write_delta(
        path,
        [
            DeltaTable(
                meta,
                np.arange(5, dtype=np.int64),
                rng.standard_normal((5, 2)).astype(np.float16),
                np.arange(5, dtype=np.int64)[:, None],
                np.arange(5, dtype=np.int64),
                rng.standard_normal((5, 1)).astype(np.float16),
                np.array([9], dtype=np.int64),
                np.array([11, 12], dtype=np.int64),
            )
        ],
    )


def mutate_json(text: str, rnd: random.Random) -> bytes:
    """``text`` (a meta's JSON) with one field, of the top level or of one entry of its
    ``files``, deleted (30%) or set to one of :data:`JSON_VALUES`."""
    d = json.loads(text)
    target = d
    if rnd.random() < 0.3:
        target = d["files"][rnd.choice(sorted(d["files"]))]
    key = rnd.choice(sorted(target))
    if rnd.random() < 0.3:
        del target[key]
    else:
        target[key] = rnd.choice(JSON_VALUES)
    return json.dumps(d).encode()


def mutate_bytes(blob: bytes, rnd: random.Random) -> bytes:
    """``blob`` truncated, extended by 1-8 random bytes, with one bit flipped, or with 2-5
    bytes changed (a quarter each); an empty ``blob`` becomes one zero byte."""
    kind = rnd.randrange(4)
    if kind == 0 or not blob:  # truncate
        return blob[: rnd.randrange(len(blob) + 1)] if blob else b"\x00"
    if kind == 1:  # append
        return blob + bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 9)))
    data = bytearray(blob)
    for _ in range(1 if kind == 2 else rnd.randrange(2, 6)):  # flip one or several bytes
        i = rnd.randrange(len(data))
        data[i] ^= 1 << rnd.randrange(8) if kind == 2 else rnd.randrange(1, 256)
    return bytes(data)


def mutate(victim: Path, blob: bytes, rnd: random.Random) -> bytes:
    """A mutation of ``blob``, the bytes of the file ``victim``: a meta (``*.meta.json``) is
    edited as JSON half the time (:func:`mutate_json`), any file otherwise damaged as bytes
    (:func:`mutate_bytes`)."""
    if victim.name.endswith(".meta.json") and rnd.random() < 0.5:
        return mutate_json(blob.decode(), rnd)
    return mutate_bytes(blob, rnd)
