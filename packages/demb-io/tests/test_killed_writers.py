"""Writers killed with SIGKILL at random points: a checkpoint write
(``CheckpointWriter``), ``apply_delta``, ``merge_delta_files`` and the delta writer
(``write_delta``, i.e. ``DeltaWriter``).

Per writer, the target already holds a complete OLD version, written by the same writer from
other inputs. A server process (this file run as a script, :mod:`demb_io.kill_harness`) makes
or reads the NEW version's inputs once, then forks a writer process per request: the writer
creates a "ready" file, then writes the NEW version to the same target (~0.2-0.5 s of work:
tens of MB over dozens of files). One unkilled write measures the write's duration ``T``
and gives the NEW version; then each writer is killed with SIGKILL at a seeded random delay in
``[0, 0.95 T]`` after its ready file. After each kill the target reads back through the public
readers (CRC-32s verified) as exactly the OLD or exactly the NEW version (every meta and array
equal); whatever the killed writer left beside it (``<target>.tmp-*``) is refused by both
readers with a FormatError; and the next write (the OLD version again, in this process)
removes it: the target's folder then holds the target alone.

The default suite kills 2 writes per writer; the ``slow`` variant keeps killing until 22 kills
landed mid-write (the writer still running), drawing another delay when a write finished first.
Each run prints its tally: kills, landed, finished first, outcomes old/new, staging left.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from demb_io import (
    Checkpoint,
    CheckpointWriter,
    DeltaMeta,
    DeltaTable,
    DeltaWriter,
    ShardData,
    ShardMeta,
    apply_delta,
    merge_delta_files,
    read_delta,
    write_delta,
)
from demb_io.kill_harness import (
    Content,
    WriterServer,
    checkpoint_content,
    delta_content,
    kill_writes,
    serve,
)
from demb_planner import owner_rank

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "SIGKILL")
    or not hasattr(os, "fork")
    or not Path("/proc/self/stat").exists(),
    reason="SIGKILL, fork, and /proc's start times (how a write finds a killed one's staging)",
)

KILLS = [2, pytest.param(22, marks=pytest.mark.slow)]
"""Kills that must land mid-write per writer: the default suite's, and the slow variant's."""

WRITERS = ("checkpoint", "apply", "merge", "delta")

TABLES = 12
"""Tables per version (in two collections), each on RANKS ranks in CHUNKS chunks."""
RANKS = 2
CHUNKS = 2
ROWS = 2048
"""Rows per chunk of a checkpoint's shard."""
DELTA_ROWS = 2 * ROWS
"""Rows per table of a delta."""
DIM = 32
SCORES = ("TIMESTAMP", "LFU")
KEY_SPACE = 10 * TABLES * RANKS * CHUNKS * ROWS
OLD_SEED, NEW_SEED = 10, 11
"""The seeds of the OLD and NEW versions of the checkpoint and delta writers."""


def _table_layout(t: int) -> tuple[str, str, str]:
    """Table ``t``'s collection, name and embedding dtype (float32 and bfloat16 in turn)."""
    return ("user", "item")[t % 2], f"t{t}", ("float32", "bfloat16")[t % 2]


def _values(rng: np.random.Generator, shape: tuple[int, int], dtype: str) -> np.ndarray:
    if dtype == "bfloat16":  # stored as its 16-bit words
        return rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    return rng.random(shape, dtype=np.float32)


def _keys(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.choice(KEY_SPACE, n, replace=False).astype(np.int64)


def checkpoint_shards(seed: int) -> list[tuple[ShardMeta, list[ShardData]]]:
    """A checkpoint's shards and their chunks, made from ``seed``: TABLES tables, each of
    RANKS ranks (every key on its roundrobin owner) of CHUNKS chunks of ROWS rows, with adam
    state, two scores and admission counters."""
    rng = np.random.default_rng(seed)
    shards = []
    for t in range(TABLES):
        collection, table, dtype = _table_layout(t)
        keys = _keys(rng, RANKS * CHUNKS * ROWS)
        owners = owner_rank(keys, RANKS, "roundrobin")
        for rank in range(RANKS):
            mine = keys[owners == rank]
            meta = ShardMeta(
                collection=collection,
                table=table,
                rank=rank,
                world_size=RANKS,
                dist_type="roundrobin",
                embedding_dtype=dtype,
                embedding_dim=DIM,
                rows=0,
                score_strategy=SCORES,
                optimizer="adam",
                optim_state_dtype="float32",
                state_width=2 * DIM,
                hyper_parameters={"lr": 0.01},
                admission_rows=0,
            )
            chunks = [
                ShardData(
                    part,
                    _values(rng, (part.size, DIM), dtype),
                    rng.integers(0, 1000, (part.size, len(SCORES)), dtype=np.int64),
                    rng.random((part.size, 2 * DIM), dtype=np.float32),
                    _keys(rng, 16),
                    rng.integers(1, 9, 16, dtype=np.int64),
                )
                for part in np.array_split(mine, CHUNKS)
            ]
            shards.append((meta, chunks))
    return shards


def delta_tables(seed: int) -> list[DeltaTable]:
    """A delta made from ``seed``: TABLES tables of DELTA_ROWS rows (the checkpoint's layout,
    so it applies to one), with slots, erased and retained evicted keys; every delta shares the
    layout, so any may be merged with any."""
    rng = np.random.default_rng(seed)
    tables = []
    for t in range(TABLES):
        collection, table, dtype = _table_layout(t)
        meta = DeltaMeta(
            collection=collection,
            table=table,
            embedding_dtype=dtype,
            embedding_dim=DIM,
            score_strategy=SCORES,
            current_score=1000 + seed,
            current_capacity=1 << 20,
            row_capacity=(1 << 19,) * RANKS,
            bucket_capacity=128,
            world_size=RANKS,
            dist_type="roundrobin",
            optim_state_dtype="float32",
            state_width=2 * DIM,
            evicted_rows=0,
        )
        keys = _keys(rng, DELTA_ROWS + 64)
        tables.append(
            DeltaTable(
                meta,
                keys[:DELTA_ROWS],
                _values(rng, (DELTA_ROWS, DIM), dtype),
                rng.integers(0, 1000, (DELTA_ROWS, len(SCORES)), dtype=np.int64),
                rng.permutation(1 << 19)[:DELTA_ROWS].astype(np.int64),
                rng.random((DELTA_ROWS, 2 * DIM), dtype=np.float32),
                keys[DELTA_ROWS : DELTA_ROWS + 32],
                keys[DELTA_ROWS + 32 :],
            )
        )
    return tables


def make_inputs(writer: str, inputs: Path) -> None:
    """The inputs that ``apply`` (a source checkpoint, two deltas) and ``merge`` (three
    deltas) read."""
    if writer == "apply":
        write_shards(inputs / "source", checkpoint_shards(0))
    for seed in {"apply": (1, 2), "merge": (1, 2, 3)}.get(writer, ()):
        write_tables(inputs / f"delta-{seed}", delta_tables(seed))


def write_shards(path: Path, shards: list[tuple[ShardMeta, list[ShardData]]]) -> None:
    with CheckpointWriter(path) as w:
        for meta, chunks in shards:
            w.write_shard(meta, chunks)


def write_tables(path: Path, tables: list[DeltaTable]) -> None:
    with DeltaWriter(path) as w:
        for table in tables:
            w.write(table)


def plan(writer: str, version: str, target: Path, inputs: Path) -> Callable[[], object]:
    """The write of ``writer``'s ``version`` ("old" or "new") of ``target``, its inputs made
    or read ahead: the call returned does the write alone."""
    new = version == "new"
    if writer == "checkpoint":
        shards = checkpoint_shards(NEW_SEED if new else OLD_SEED)
        return lambda: write_shards(target, shards)
    if writer == "delta":
        tables = delta_tables(NEW_SEED if new else OLD_SEED)
        return lambda: write_delta(target, tables)
    if writer == "apply":
        delta = read_delta(inputs / f"delta-{2 if new else 1}")
        return lambda: apply_delta(inputs / "source", delta, target)
    assert writer == "merge"
    paths = [inputs / f"delta-{s}" for s in ((2, 3) if new else (1, 2))]
    return lambda: merge_delta_files(paths, target)


def read_version(writer: str, target: Path) -> Content:
    return (checkpoint_content if writer in ("checkpoint", "apply") else delta_content)(target)


@pytest.mark.parametrize("kills", KILLS)
@pytest.mark.parametrize("writer", WRITERS)
def test_a_killed_writer_leaves_the_old_or_the_new_version(tmp_path, writer, kills):
    """A writer killed anywhere leaves its target whole, old or new; the next write cleans
    up after it."""
    inputs, out, ctl = tmp_path / "in", tmp_path / "out", tmp_path / "ctl"
    for folder in (inputs, out, ctl):
        folder.mkdir()
    target = out / "target"
    make_inputs(writer, inputs)
    reset = plan(writer, "old", target, inputs)
    reset()
    server = WriterServer([__file__, writer, str(target), str(inputs)], ctl / "server.log")
    try:
        tally, calibrated = kill_writes(
            server,
            target,
            ctl / "ready",
            lambda path: read_version(writer, path),
            reset,
            kills=kills,
            seed=WRITERS.index(writer),
            readers=[Checkpoint, read_delta],
        )
    finally:
        server.close()
    print(f"\n{writer}: write {calibrated:.2f} s, {tally}")
    assert tally.old + tally.new == tally.kills


if __name__ == "__main__":  # the server of the writers of a target's NEW version
    _writer, _target, _inputs = sys.argv[1:]
    _new = plan(_writer, "new", Path(_target), Path(_inputs))
    serve(lambda version: _new())
