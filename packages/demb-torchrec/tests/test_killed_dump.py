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
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from demb_io import Checkpoint, FormatError

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
import os, sys, traceback
from pathlib import Path

import torch

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
print("ready", flush=True)
while line := sys.stdin.readline():
    command, version, *ready = line.split()
    if command == "dump":  # in this process, unkilled
        DynamicEmbDump(target, models[version], optim=True)
        print("done", flush=True)
        continue
    assert command == "fork", line
    pid = os.fork()
    if pid == 0:  # the writer, which the test kills
        code = 1
        try:
            Path(ready[0]).touch()
            DynamicEmbDump(target, models[version], optim=True)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    print(f"pid {pid}", flush=True)
    assert sys.stdin.readline().strip() == "reap"
    _, status = os.waitpid(pid, 0)
    print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
"""


class DumpServer:
    """The server (see the module's docstring), spoken to by lines on its stdin and stdout."""

    def __init__(self, target: Path, log: Path) -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER, str(target), str(ROWS)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.writer: int | None = None
        self.expect("ready", timeout=600)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def expect(self, word: str, timeout: float = 300) -> str:
        """The next line of the server, which must start with ``word``; the rest of it."""
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = "(no answer)"
        head, _, rest = line.strip().partition(" ")
        assert head == word, f"server said {line!r}:\n{self.log.read_text()[-4000:]}"
        return rest

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def dump_old(self) -> None:
        """Dump OLD in the server's own process (a normal dump)."""
        self.send("dump old")
        self.expect("done")

    def write(self, ready: Path, delay: float | None) -> tuple[int, float]:
        """Fork a writer dumping NEW; ``delay`` seconds after its ready file kill it (None:
        let it finish). Its exit code (``-SIGKILL`` if killed) and the seconds from its ready
        file to its end."""
        ready.unlink(missing_ok=True)
        self.send(f"fork new {ready}")
        self.writer = int(self.expect("pid"))
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the writer never got ready"
            time.sleep(0.001)
        start = time.monotonic()
        if delay is not None:
            time.sleep(delay)
            os.kill(self.writer, signal.SIGKILL)  # alive, or a zombie: not reaped yet
        self.send("reap")
        code = int(self.expect("exit"))
        self.writer = None
        assert code in (0, -signal.SIGKILL), self.log.read_text()[-4000:]
        return code, time.monotonic() - start

    def close(self) -> None:
        if self.writer is not None and self.proc.poll() is None:  # a failed test's writer
            os.kill(self.writer, signal.SIGKILL)
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


Content = dict[str, object]


def checkpoint_content(path: Path) -> Content:
    """Every shard meta and every array of every table of every collection of the
    checkpoint (CRC-32s verified)."""
    ckpt = Checkpoint(path)
    content: Content = {}
    for collection in ckpt.collections():
        for table in ckpt.tables(collection):
            name = f"{collection}/{table}"
            content[f"{name}/metas"] = ckpt.shards(collection, table)
            data = ckpt.read_table(collection, table, verify=True)
            for part in ("keys", "values", "scores", "state", "admit_keys", "admit_counts"):
                content[f"{name}/{part}"] = getattr(data, part)
    return content


def same(a: Content, b: Content) -> bool:
    """Whether two contents hold the same names, metas and arrays (dtype, shape, values)."""
    if a.keys() != b.keys():
        return False
    for name, x in a.items():
        y = b[name]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (
                isinstance(x, np.ndarray)
                and isinstance(y, np.ndarray)
                and x.dtype == y.dtype
                and np.array_equal(x, y)
            ):
                return False
        elif x != y:
            return False
    return True


@dataclass
class Tally:
    kills: int = 0
    """Writers sent SIGKILL."""
    landed: int = 0
    """Of them, killed mid-dump (still running)."""
    finished: int = 0
    """Of them, ended before the kill (their dump complete)."""
    old: int = 0
    new: int = 0
    """Outcomes: the target held the OLD or the NEW checkpoint."""
    new_killed: int = 0
    """NEW outcomes of kills that landed: in the commit's last steps (after the exchange)."""
    staging_left: int = 0
    """Staging folders left beside the target by the killed dumps."""
    complete_left: int = 0
    """Of them, complete with their marker (refused for their name alone)."""


def check_left_behind(out: Path, tally: Tally) -> None:
    """What the killed dump left beside ``out/target`` is its staging (or set-aside) folder,
    and the reader does not take it for a checkpoint."""
    for folder in sorted(p for p in out.iterdir() if p.name != "target"):
        assert folder.name.startswith(("target.tmp-", "target.old-")), folder
        assert folder.is_dir(), folder
        tally.staging_left += 1
        tally.complete_left += (folder / "FORMAT").exists()
        with pytest.raises(FormatError):
            Checkpoint(folder)


@pytest.mark.parametrize("kills", KILLS)
def test_a_killed_dump_leaves_the_old_or_the_new_checkpoint(tmp_path, kills):
    """A dump killed anywhere leaves its target whole, old or new; the next dump cleans up
    after it."""
    out, ctl = tmp_path / "out", tmp_path / "ctl"
    out.mkdir()
    ctl.mkdir()
    target, ready = out / "target", ctl / "ready"
    server = DumpServer(target, ctl / "server.log")
    try:
        server.dump_old()
        old = checkpoint_content(target)
        assert len([k for k in old if k.endswith("/keys")]) == 4  # two collections of two
        code, calibrated = server.write(ready, None)  # calibration: unkilled
        assert code == 0
        new = checkpoint_content(target)
        assert not same(old, new)
        server.dump_old()
        assert sorted(p.name for p in out.iterdir()) == ["target"]
        duration = calibrated

        rnd = random.Random(47)
        tally = Tally()
        for _ in range(3 * kills + 10):
            if tally.landed >= kills:
                break
            code, _ = server.write(ready, rnd.uniform(0, 0.95 * duration))
            tally.kills += 1
            after = checkpoint_content(target)
            if same(after, old):
                tally.old += 1
            else:
                assert same(after, new), "the target is neither the old checkpoint nor the new one"
                tally.new += 1
                tally.new_killed += code != 0
            if code == 0:  # the dump ended before the kill: draw shorter delays
                tally.finished += 1
                assert same(after, new)
                duration *= 0.9
                assert sorted(p.name for p in out.iterdir()) == ["target"]
            else:
                tally.landed += 1
            check_left_behind(out, tally)
            server.dump_old()  # a dump removes the staging the killed one left
            assert sorted(p.name for p in out.iterdir()) == ["target"]
    finally:
        server.close()
    print(f"\ndump: {calibrated:.2f} s (delays up to {0.95 * duration:.2f} s), {tally}")
    assert tally.landed >= kills, tally
    assert tally.old + tally.new == tally.kills
