"""Writers killed with SIGKILL at random points: what the SIGKILL tests of demb-io's writers and
of demb-torchrec's ``DynamicEmbDump`` share (like :mod:`demb_io.mutations`, test support).

A server process (:func:`serve`) holds the writes of a target's versions ready and, per
request, forks a writer that creates a "ready" file and then writes; it reaps the writer only
when told to, so its process id cannot be reused before the test has killed it.
:func:`kill_writes` calibrates the write's duration with one unkilled write, then kills writes
at seeded random delays after their ready file until enough kills landed mid-write, checking
after each that the target reads back as exactly the old or the new version, that whatever the
killed writer left is refused by the readers, and that the next write removes it.
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from demb_io._errors import FormatError
from demb_io.checkpoint import Checkpoint
from demb_io.delta import read_delta

__all__ = [
    "Content",
    "Tally",
    "WriterServer",
    "checkpoint_content",
    "delta_content",
    "kill_writes",
    "same",
    "serve",
]

Content = dict[str, object]
"""What a directory holds: each meta and array by name."""


def checkpoint_content(path: Path) -> Content:
    """Every shard meta and every array of every table of the checkpoint (CRC-32s verified)."""
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
    """A server process (``argv`` run by this Python, its loop :func:`serve`), spoken to by
    lines on its stdin and stdout; its stderr goes to ``log``."""

    def __init__(self, argv: Sequence[str], log: Path, timeout: float = 120) -> None:
        self.log = log
        self.timeout = timeout
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, *argv],
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

    def expect(self, word: str, timeout: float | None = None) -> str:
        """The next line of the server, which must start with ``word``; the rest of it."""
        try:
            line = self.lines.get(timeout=timeout or self.timeout)
        except queue.Empty:
            line = "(no answer)"
        head, _, rest = line.strip().partition(" ")
        assert head == word, f"server said {line!r}:\n{self.log.read_text()[-4000:]}"
        return rest

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def run(self, version: str) -> None:
        """Write ``version`` in the server's own process (a normal write, unkilled)."""
        self.send(f"write {version}")
        self.expect("done")

    def write(self, ready: Path, delay: float | None, version: str = "new") -> tuple[int, float]:
        """Fork a writer of ``version``; ``delay`` seconds after its ready file kill it (None:
        let it finish). Its exit code (``-SIGKILL`` if killed) and the seconds from its ready
        file to its end."""
        ready.unlink(missing_ok=True)
        self.send(f"fork {version} {ready}")
        self.writer = int(self.expect("pid"))
        deadline = time.monotonic() + self.timeout
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


def serve(write: Callable[[str], object]) -> None:
    """The server's loop (see :class:`WriterServer`): ``write V`` calls ``write(V)`` here and
    answers ``done``; ``fork V READY`` forks a writer that creates READY then calls
    ``write(V)``, and answers its pid; ``reap`` then waits for it and answers its exit code."""
    print("ready", flush=True)
    while line := sys.stdin.readline():
        command, version, *ready = line.split()
        if command == "write":
            write(version)
            print("done", flush=True)
            continue
        assert command == "fork", line
        pid = os.fork()
        if pid == 0:  # the writer, which the test kills
            code = 1
            try:
                Path(ready[0]).touch()
                write(version)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        print(f"pid {pid}", flush=True)
        assert sys.stdin.readline().strip() == "reap"
        _, status = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)


def _check_left_behind(
    out: Path, tally: Tally, readers: Sequence[Callable[[Path], object]]
) -> None:
    """What the killed writer left beside ``out/target`` is its staging (or set-aside)
    folder, and no reader takes it for a committed directory."""
    for folder in sorted(p for p in out.iterdir() if p.name != "target"):
        assert folder.name.startswith(("target.tmp-", "target.old-")), folder
        assert folder.is_dir(), folder
        tally.staging_left += 1
        tally.complete_left += (folder / "FORMAT").exists()
        for read in readers:
            try:
                read(folder)
            except FormatError:
                continue
            raise AssertionError(f"{read} took the staging folder {folder} for a committed one")


def kill_writes(
    server: WriterServer,
    target: Path,
    ready: Path,
    read: Callable[[Path], Content],
    reset: Callable[[], None],
    *,
    kills: int,
    seed: int,
    readers: Sequence[Callable[[Path], object]],
) -> tuple[Tally, float]:
    """Kill ``server``'s writes of ``target`` until ``kills`` kills landed mid-write (at most
    ``3 * kills + 10`` tries); the tally and the calibrated write's seconds.

    Args:
        target: ``<out>/target``, holding the OLD version (``reset`` writes it); nothing else
            may lie in ``<out>``.
        read: the content of a version (checked with CRC-32s).
        reset: writes the OLD version, unkilled.
        readers: each must refuse what a killed writer left (FormatError).
    """
    out = target.parent
    old = read(target)
    code, calibrated = server.write(ready, None)  # calibration: unkilled
    assert code == 0
    new = read(target)
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
        after = read(target)
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
        _check_left_behind(out, tally, readers)
        reset()  # a write removes the staging the killed one left
        assert sorted(p.name for p in out.iterdir()) == ["target"]
    assert tally.landed >= kills, tally
    return tally, calibrated
