"""``DynamicEmbDump`` killed with SIGKILL at random points.

A server process imports torch and demb-torchrec once (seconds) and builds two CPU models
deterministically: OLD and NEW, each two ``DynamicEmbeddingTables`` collections (float32 and
bfloat16, two tables each, ~64K rows a table, adam state and LFU scores). It dumps OLD to the
target on request, in its own process (the normal, unkilled write), and forks a writer process
per kill point: the writer creates a "ready" file, then dumps NEW (``optim=True``, ~0.5 s). The
server reaps a writer only when told to, so its process id stays its own until the test has
killed it.

One unkilled dump of NEW measures the dump's duration ``T`` and gives the NEW version; then
each writer is killed at a seeded random delay in ``[0, 0.95 T]`` after its ready
file. After each kill the target reads back through demb-io (CRC-32s verified) as exactly the
OLD or exactly the NEW checkpoint (every meta and array of every collection and table equal);
whatever the killed dump left beside it (``<target>.tmp-*``) is refused by the reader with a
FormatError; and the next dump (OLD again) removes it: the target's folder then holds the
target alone.

It runs under the ``slow`` marker only (its server imports torch and TorchRec: about 10 s before
the first kill); the default suite kills demb-io's writers, whose staging and commit the dump
shares. It keeps killing until 22 kills landed mid-dump (the writer still running), drawing
another delay when a dump finished first, and prints its tally: kills, landed, finished first,
outcomes old/new, staging left.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from demb_io import Checkpoint
from demb_io.kill_harness import WriterServer, checkpoint_content, kill_writes

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "SIGKILL")
    or not hasattr(os, "fork")
    or not Path("/proc/self/stat").exists(),
    reason="SIGKILL, fork, and /proc's start times (how a dump finds a killed one's staging)",
)

KILLS = [pytest.param(22, marks=pytest.mark.slow)]
"""Kills that must land mid-dump."""

ROWS = 1 << 16
"""Rows per table."""

_SERVER = r"""
import sys
from pathlib import Path

import torch
from demb_io.kill_harness import serve

torch.set_num_threads(1)  # no thread pool for a forked writer to miss
import demb_torchrec.lookup, demb_torchrec.sharders  # what a first dump imports (seconds)
from demb_torchrec import (
    DynamicEmbDump,
    DynamicEmbeddingTables,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)
from torch import nn

target, rows = Path(sys.argv[1]), int(sys.argv[2])


def tables(names, dim, dtype, gen):
    options = [
        DynamicEmbTableOptions(
            dim=dim,
            max_capacity=2 * rows,
            init_capacity=2 * rows,
            embedding_dtype=dtype,
            score_strategy=DynamicEmbScoreStrategy.LFU,
        )
        for _ in names
    ]
    module = DynamicEmbeddingTables(
        options,
        table_names=names,
        pooling_mode=DynamicEmbPoolingMode.SUM,
        device="cpu",
        optimizer="adam",
    )
    store = module.tables
    for t in range(len(names)):  # rows keys and scores, all of the generator
        keys = torch.randperm(10 * rows, generator=gen)[:rows]
        words = max(store.configs[t].score_layout.index_words) + 1
        scores = torch.randint(0, 1000, (words, rows), generator=gen)
        values = [None] * len(names)
        values[t] = torch.randn(rows, store.values[t].shape[1], generator=gen)
        store.insert_or_assign(keys, torch.full_like(keys, t), scores, values)
    return module


class Model(nn.Module):
    def __init__(self, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.sparse = nn.ModuleDict(
            {
                "user": tables(["u0", "u1"], 32, torch.float32, gen),
                "item": tables(["i0", "i1"], 32, torch.bfloat16, gen),
            }
        )


models = {"old": Model(0), "new": Model(1)}
serve(lambda version: DynamicEmbDump(target, models[version], optim=True))
"""


@pytest.mark.parametrize("kills", KILLS)
def test_a_killed_dump_leaves_the_old_or_the_new_checkpoint(tmp_path, kills):
    """A dump killed anywhere leaves its target whole, old or new; the next dump cleans up
    after it."""
    out, ctl = tmp_path / "out", tmp_path / "ctl"
    out.mkdir()
    ctl.mkdir()
    target = out / "target"
    argv = ["-c", _SERVER, str(target), str(ROWS)]
    server = WriterServer(argv, ctl / "server.log", timeout=300)
    try:
        server.run("old")
        old = checkpoint_content(target)
        assert len([k for k in old if k.endswith("/keys")]) == 4  # two collections of two
        tally, calibrated = kill_writes(
            server,
            target,
            ctl / "ready",
            checkpoint_content,
            lambda: server.run("old"),
            kills=kills,
            seed=47,
            readers=[Checkpoint],
        )
    finally:
        server.close()
    print(f"\ndump: {calibrated:.2f} s, {tally}")
    assert tally.old + tally.new == tally.kills
