"""Robustness of the readers and the writer: mutated or truncated checkpoints and deltas (300
of each by default, 10,000 under the ``slow`` marker; the default suite's 2,000-case fuzz of
every reader, tree mutations included, is demb-torchrec's ``test_fuzz_readers.py``) never end
in anything but a FormatError naming a file, and a writer killed with SIGKILL
mid-checkpoint leaves the previous checkpoint loadable and verified."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from demb_io import Checkpoint, FormatError, read_delta
from demb_io.mutations import mutate, small_checkpoint, small_delta

MUTATIONS = [300, pytest.param(10_000, marks=pytest.mark.slow)]
"""Mutations per fuzz run: the default suite's (a smoke run of demb-io alone: the 2,000-case
fuzz over every reader is ``packages/demb-torchrec/tests/test_fuzz_readers.py``), and the slow
variant's."""


def read_all(path: Path) -> FormatError | None:
    """Open, list and read every table (verifying CRCs); the FormatError, if any."""
    try:
        ckpt = Checkpoint(path)
        for collection in ckpt.collections():
            for table in ckpt.tables(collection):
                ckpt.read_table(collection, table)
    except FormatError as err:
        return err
    return None


def read_delta_error(path: Path) -> FormatError | None:
    try:
        read_delta(path)
    except FormatError as err:
        return err
    return None


def fuzz(
    path: Path, read: Callable[[Path], FormatError | None], seed: int, mutations: int
) -> dict[str, int]:
    """``mutations`` single mutations of the files under ``path``, each undone after its read."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    original = {p: p.read_bytes() for p in files}
    rnd = random.Random(seed)
    outcomes = {"format_error": 0, "read": 0}
    for _ in range(mutations):
        victim = rnd.choice(files)
        blob = original[victim]
        mutated = mutate(victim, blob, rnd)
        victim.write_bytes(mutated)
        error = read(path)
        if error is None:
            outcomes["read"] += 1
            # a changed data file never reads back (CRC-32s and sizes); the marker and the
            # metas may change harmlessly (whitespace, a hyper-parameter)
            data_file = victim.suffix != ".json" and victim.name != "FORMAT"
            assert not data_file or mutated == blob, (victim, mutated)
        else:
            assert error.path.is_relative_to(path), error
            outcomes["format_error"] += 1
        victim.write_bytes(blob)
    assert sum(outcomes.values()) == mutations
    assert outcomes["format_error"] > mutations // 2
    return outcomes


@pytest.mark.parametrize("mutations", MUTATIONS)
def test_mutated_deltas_raise_only_format_errors(tmp_path, mutations):
    small_delta(tmp_path / "d")
    outcomes = fuzz(tmp_path / "d", read_delta_error, 1, mutations)
    print(f"{mutations} mutated deltas: {outcomes}")


@pytest.mark.parametrize("mutations", MUTATIONS)
def test_mutated_inputs_raise_only_format_errors(tmp_path, mutations):
    path = tmp_path / "c"
    small_checkpoint(path)
    print(f"{mutations} mutated checkpoints: {fuzz(path, read_all, 0, mutations)}")


_KILLED_WRITER = """
import sys, time
import numpy as np
from demb_io import CheckpointWriter, ShardData, ShardMeta

path, ready = sys.argv[1], sys.argv[2]
meta = ShardMeta(collection="ebc", table="t", rank=0, world_size=1, dist_type="roundrobin",
                 embedding_dtype="float32", embedding_dim=64, rows=0)

def chunks():
    for i in range(10_000):
        keys = np.arange(i * 1000, (i + 1) * 1000, dtype=np.int64)
        yield ShardData(keys, np.full((1000, 64), i, np.float32), np.zeros((1000, 1), np.int64))
        if i == 3:
            open(ready, "w").close()
        time.sleep(0.01)

with CheckpointWriter(path) as w:
    w.write_shard(meta, chunks())
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_a_writer_killed_mid_checkpoint_leaves_the_previous_one_whole(tmp_path):
    path = tmp_path / "c"
    small_checkpoint(path)
    before = Checkpoint(path).read_table("ebc", "t")
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(path), str(ready)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, "the writer ended before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    after = Checkpoint(path).read_table("ebc", "t", verify=True)
    np.testing.assert_array_equal(after.keys, before.keys)
    np.testing.assert_array_equal(after.values, before.values)
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith("c.tmp-")]
    assert len(leftovers) == 1  # the killed write's staging directory
    with pytest.raises(FormatError, match="staging or set-aside folder"):
        Checkpoint(leftovers[0])  # never read as a checkpoint
    small_checkpoint(path)  # the next write removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "ready"]


def _dead_writer_tag() -> str:
    """The ``<host>-<pid>-<start>`` of a process that ran and ended."""
    code = "from demb_io._staging import _owner_tag; print(_owner_tag())"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process start times")
def test_a_write_removes_only_the_staging_of_writers_that_ended(tmp_path):
    """Before a write stages, the staging folders of its target's ended writers go; a live
    writer's (here: this process's), another host's, an unknown one's, and a set-aside previous
    version while the target is missing all stay."""
    from demb_io._staging import _owner_tag, remove_stale_staging

    target = tmp_path / "c"
    dead = _dead_writer_tag()
    host, _, _ = dead.split("-")
    folders = {
        "dead": f"c.tmp-{dead}-0a1b",
        "live": f"c.tmp-{_owner_tag()}-0a1b",
        "other_host": f"c.tmp-{'f' * 8 if host != 'f' * 8 else 'e' * 8}-1-1-0a1b",
        "unknown": "c.tmp-unattributed",
        "dead_set_aside": f"c.old-{dead}-0a1b",
    }
    for name in folders.values():
        (tmp_path / name).mkdir()
    assert remove_stale_staging(target) == [tmp_path / folders["dead"]]  # target missing
    small_checkpoint(target)  # a write: now the target exists, the set-aside goes too
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["c", folders["live"], folders["other_host"], folders["unknown"]]
    )
