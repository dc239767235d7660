"""Writers killed with SIGKILL at random points: a checkpoint write
(``CheckpointWriter``), ``apply_delta``, ``merge_delta_files`` and the delta writer
(``write_delta``, i.e. ``DeltaWriter``).

Per writer, the target already holds a complete OLD version, written by the same writer from
other inputs. A server process (this file run as a script) makes or reads the NEW version's
inputs once, then forks a writer process per request: the writer creates a "ready" file, then
writes the NEW version to the same target (~0.2-0.5 s of work: tens of MB over dozens of
files). The server reaps a writer only when told to, so its process id stays its own until the
test has killed it. One unkilled write measures the write's duration ``T`` and gives the NEW
version; then each writer is killed with SIGKILL at a seeded random delay in
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
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from demb_io import (
    Checkpoint,
    CheckpointWriter,
    DeltaMeta,
    DeltaTable,
    DeltaWriter,
    FormatError,
    ShardData,
    ShardMeta,
    apply_delta,
    merge_delta_files,
    read_delta,
    write_delta,
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


Content = dict[str, object]


def checkpoint_content(path: Path) -> Content:
    """Every shard meta and every array of every table of the checkpoint (CRC-32s
    verified)."""
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


def delta_content(path: Path) -> Content:
    """Every table meta and array of the delta (CRC-32s verified)."""
    content: Content = {}
    for t in read_delta(path, verify=True):
        name = f"{t.meta.collection}/{t.meta.table}"
        content[f"{name}/meta"] = t.meta
        for part in ("keys", "values", "scores", "slots", "state", "erased", "evicted"):
            content[f"{name}/{part}"] = getattr(t, part)
    return content


def read_version(writer: str, target: Path) -> Content:
    return (checkpoint_content if writer in ("checkpoint", "apply") else delta_content)(target)


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
    """Children sent SIGKILL."""
    landed: int = 0
    """Of them, killed mid-write (still running)."""
    finished: int = 0
    """Of them, ended before the kill (their write complete)."""
    old: int = 0
    new: int = 0
    """Outcomes: the target held the OLD or the NEW version."""
    new_killed: int = 0
    """NEW outcomes of kills that landed: in the commit's last steps (after the exchange)."""
    staging_left: int = 0
    """Staging folders left beside the target by the killed writers."""
    complete_left: int = 0
    """Of them, complete with their marker (refused for their name alone)."""


class WriterServer:
    """A process (this file run as a script) that holds the NEW version's write ready, its
    inputs made or read, and forks a writer per request: the writer creates the ready file
    and writes. The server reaps a writer only when told to, so until then its process id
    cannot be reused and the SIGKILL cannot hit another process."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *args],
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

    def expect(self, word: str, timeout: float = 120) -> str:
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

    def write(self, ready: Path, delay: float | None) -> tuple[int, float]:
        """Fork a writer; ``delay`` seconds after its ready file kill it (None: let it
        finish). Its exit code (``-SIGKILL`` if killed) and the seconds from its ready file
        to its end."""
        ready.unlink(missing_ok=True)
        self.send(f"fork {ready}")
        self.writer = int(self.expect("pid"))
        deadline = time.monotonic() + 120
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


def serve(write: Callable[[], object]) -> None:
    """The server's loop (see :class:`WriterServer`): ``fork READY`` forks a writer that
    creates READY then calls ``write``; ``reap`` waits for it and answers its exit code."""
    print("ready", flush=True)
    while line := sys.stdin.readline():
        command, _, ready = line.strip().partition(" ")
        assert command == "fork", line
        pid = os.fork()
        if pid == 0:  # the writer
            code = 1
            try:
                Path(ready).touch()
                write()
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        print(f"pid {pid}", flush=True)
        assert sys.stdin.readline().strip() == "reap"
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


def check_left_behind(out: Path, tally: Tally) -> None:
    """What the killed writer left beside ``out/target`` is its staging (or set-aside)
    folder, and neither reader takes it for a checkpoint or a delta."""
    for folder in sorted(p for p in out.iterdir() if p.name != "target"):
        assert folder.name.startswith(("target.tmp-", "target.old-")), folder
        assert folder.is_dir(), folder
        tally.staging_left += 1
        tally.complete_left += (folder / "FORMAT").exists()
        with pytest.raises(FormatError):
            Checkpoint(folder)
        with pytest.raises(FormatError):
            read_delta(folder)


def kill_writer(writer: str, kills: int, seed: int, tmp_path: Path) -> Tally:
    """Kill ``writer`` until ``kills`` kills landed mid-write (at most ``3 * kills + 10``
    tries), checking each outcome; the tally."""
    inputs, out, ctl = tmp_path / "in", tmp_path / "out", tmp_path / "ctl"
    for folder in (inputs, out, ctl):
        folder.mkdir()
    target, ready = out / "target", ctl / "ready"
    make_inputs(writer, inputs)
    reset = plan(writer, "old", target, inputs)
    reset()
    old = read_version(writer, target)
    server = WriterServer([__file__, writer, str(target), str(inputs)], ctl / "server.log")
    try:
        code, calibrated = server.write(ready, None)  # calibration: unkilled
        assert code == 0
        new = read_version(writer, target)
        assert not same(old, new)
        reset()
        assert sorted(p.name for p in out.iterdir()) == ["target"]
        duration = calibrated

        rnd = random.Random(seed)
        tally = Tally()
        for _ in range(3 * kills + 10):
            if tally.landed >= kills:
                break
            code, _ = server.write(ready, rnd.uniform(0, 0.95 * duration))
            tally.kills += 1
            after = read_version(writer, target)
            if same(after, old):
                tally.old += 1
            else:
                assert same(after, new), "the target is neither the old version nor the new one"
                tally.new += 1
                tally.new_killed += code != 0
            if code == 0:  # the write ended before the kill: draw shorter delays
                tally.finished += 1
                assert same(after, new)
                duration *= 0.9
                assert sorted(p.name for p in out.iterdir()) == ["target"]
            else:
                tally.landed += 1
            check_left_behind(out, tally)
            reset()  # a write removes the staging the killed one left
            assert sorted(p.name for p in out.iterdir()) == ["target"]
    finally:
        server.close()
    print(f"\n{writer}: write {calibrated:.2f} s (delays up to {0.95 * duration:.2f} s), {tally}")
    assert tally.landed >= kills, tally
    return tally


@pytest.mark.parametrize("kills", KILLS)
@pytest.mark.parametrize("writer", WRITERS)
def test_a_killed_writer_leaves_the_old_or_the_new_version(tmp_path, writer, kills):
    """A writer killed anywhere leaves its target whole, old or new; the next write cleans
    up after it."""
    tally = kill_writer(writer, kills, WRITERS.index(writer), tmp_path)
    assert tally.old + tally.new == tally.kills


if __name__ == "__main__":  # the server of the writers of a target's NEW version
    _writer, _target, _inputs = sys.argv[1:]
    serve(plan(_writer, "new", Path(_target), Path(_inputs)))
