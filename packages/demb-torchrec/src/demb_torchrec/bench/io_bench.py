"""``demb bench io``: write and read throughput of a checkpoint (:mod:`demb_io`) beside raw
numpy file writes and reads of the same arrays, in the same run.

One table of ``rows`` float32 rows of ``dim`` (plus int64 keys and two int64 score words) is
written with demb-io's streaming writer (CRC-32s, fsync, atomic commit) and read back (all
chunks, with and without CRC checks); in the same run the same arrays are written with plain
file writes into one file and fsync, and read back into one reused buffer the size of a
chunk's values (demb-io's read with ``reuse=True``, its chunks in reused buffers too). The
chunks are made before the timing starts, so neither side is charged for making them. Each
repeat starts from an empty folder after ``os.sync()``; the two writes, and the three reads, run
in an order that rotates from repeat to repeat, so no side always comes first; a first,
untimed repeat warms up. A disk may take a burst of writes fast and the next one slowly, so
each side's writes are also summed up by their place in the repeat (first or second write),
each place compared with the other side's at the same place. Each read runs twice: first from
the disk (the files' clean pages dropped from the page cache with ``posix_fadvise(DONTNEED)``),
then again from the page cache. Figures are the medians' bytes/s; each baseline is the raw side
of the same step; the ratio is the fraction of raw reached.

The default (262,144 rows, 0.14 GB) finishes in seconds; ``--rows 4000000 --repeats 16`` is the
full size (a 2.1 GB checkpoint).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from demb_io import Checkpoint, CheckpointWriter, ShardData, ShardMeta

from demb_torchrec.bench.compare import Comparison, machine_info, print_comparisons

__all__ = ["CHUNK", "FULL_ROWS", "IoWorkload", "chunks", "raw_read", "raw_write", "run"]

CHUNK = 1 << 18
"""Rows per chunk written."""
FULL_ROWS = 4_000_000
"""The full-size run's rows."""
_READS = ("read", "verified", "raw_read")
_KINDS = ("write", "raw_write", *_READS, *(f"{k}_cold" for k in _READS))


@dataclass(frozen=True)
class IoWorkload:
    """A checkpoint of one table of ``rows`` rows of ``dim`` float32, written and read
    ``repeats`` times (even: each side writes first equally often) in a temporary folder under
    ``directory`` (default: the system's temporary folder)."""

    rows: int = 262_144
    dim: int = 128
    repeats: int = 6
    directory: str | None = None

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"rows={self.rows!r}: must be >= 1")
        if self.dim < 1:
            raise ValueError(f"dim={self.dim!r}: must be >= 1")
        if self.repeats < 2 or self.repeats % 2:
            raise ValueError(f"repeats={self.repeats!r}: must be even and >= 2")

    @property
    def total_bytes(self) -> int:
        """Bytes of the table's arrays: int64 keys, float32 values, two int64 score words."""
        return self.rows * (8 + 4 * self.dim + 2 * 8)

    def as_dict(self) -> dict[str, Any]:
        """The workload as JSON fields."""
        return {**asdict(self), "bytes": self.total_bytes}


def chunks(rows: int, dim: int) -> Iterator[ShardData]:
    """The table's chunks of :data:`CHUNK` rows: keys ``0..rows-1``, random values (one block,
    reused), both score words the key."""
    rng = np.random.default_rng(0)
    block = rng.standard_normal((min(CHUNK, rows), dim)).astype(np.float32)
    for begin in range(0, rows, CHUNK):
        n = min(CHUNK, rows - begin)
        keys = np.arange(begin, begin + n, dtype=np.int64)
        yield ShardData(keys, block[:n], np.stack([keys, keys], 1))


def raw_write(path: Path, data: list[ShardData]) -> int:
    """The chunks' arrays, in order, appended to one file with plain writes; fsync. Bytes."""
    written = 0
    with open(path, "wb") as f:
        for chunk in data:
            for array in (chunk.keys, chunk.values, chunk.scores):
                written += f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
        f.flush()
        os.fsync(f.fileno())
    return written


def raw_read(path: Path, block: int) -> int:
    """Read the file into one reused buffer of ``block`` bytes (allocated as demb-io's reader
    allocates); bytes read."""
    got = 0
    buf = np.empty(block, dtype=np.uint8).data
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            got += n
    return got


def _drop_cached(paths: list[Path]) -> None:
    """Drop the files' (clean, synced) pages from the page cache: the next read is from disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _meta(dim: int) -> ShardMeta:
    return ShardMeta(
        collection="ebc",
        table="t",
        rank=0,
        world_size=1,
        dist_type="roundrobin",
        embedding_dtype="float32",
        embedding_dim=dim,
        rows=0,
        score_strategy=("TIMESTAMP", "LFU"),
    )


class _Sides:
    """The timed steps of one repeat, in a work folder."""

    def __init__(self, w: IoWorkload, work: Path, data: list[ShardData]) -> None:
        self.w, self.work, self.data, self.meta = w, work, data, _meta(w.dim)

    def demb_write(self) -> None:
        with CheckpointWriter(self.work / "ckpt") as writer:
            written = writer.write_shard(self.meta, self.data)
        if sum(e.bytes or 0 for e in written.files.values()) != self.w.total_bytes:
            raise RuntimeError("the checkpoint's files do not hold the table's bytes")

    def demb_read(self, verify: bool) -> None:
        table = Checkpoint(self.work / "ckpt").iter_table(
            "ebc", "t", CHUNK, verify=verify, reuse=True
        )
        if sum(c.rows for _, c in table) != self.w.rows:
            raise RuntimeError("the checkpoint did not read back every row")

    def raw_write(self) -> None:
        if raw_write(self.work / "raw.bin", self.data) != self.w.total_bytes:
            raise RuntimeError("the raw write did not write every byte")

    def raw_read(self) -> None:
        if raw_read(self.work / "raw.bin", CHUNK * self.w.dim * 4) != self.w.total_bytes:
            raise RuntimeError("the raw read did not read every byte")


def _repeat(
    sides: _Sides, r: int, times: dict[str, list[float]], placed: dict[str, list[float]]
) -> None:
    """Repeat ``r`` (0: the untimed warm-up): both writes, then the three reads, from the disk
    and from the page cache, in an order that rotates with ``r``."""
    work = sides.work
    # Both writes start from the same state: no previous output, nothing pending.
    shutil.rmtree(work / "ckpt", ignore_errors=True)
    (work / "raw.bin").unlink(missing_ok=True)
    os.sync()
    writes: list[tuple[str, Callable[[], None]]] = [
        ("write", sides.demb_write),
        ("raw_write", sides.raw_write),
    ]
    for place, (name, step) in enumerate(writes[r % 2 :] + writes[: r % 2], 1):
        t0 = time.perf_counter()
        step()
        if r:
            times[name].append(time.perf_counter() - t0)
            placed[f"{name}@{place}"].append(times[name][-1])
        os.sync()
    demb_files = [p for p in (work / "ckpt").rglob("*") if p.is_file()]
    reads: list[tuple[str, Callable[[], None], list[Path]]] = [
        ("read", lambda: sides.demb_read(False), demb_files),
        ("verified", lambda: sides.demb_read(True), demb_files),
        ("raw_read", sides.raw_read, [work / "raw.bin"]),
    ]
    for name, step, files in reads[r % 3 :] + reads[: r % 3]:
        _drop_cached(files)
        for key in (f"{name}_cold", name):  # from the disk, then from the page cache
            t0 = time.perf_counter()
            step()
            if r:
                times[key].append(time.perf_counter() - t0)


def _comparisons(rates: dict[str, float]) -> list[Comparison]:
    raw_write = "raw numpy write + fsync"
    out = [Comparison("write", rates["write"], rates["raw_write"], "B/s", raw_write)]
    for place, nth in ((1, "first"), (2, "second")):
        out.append(
            Comparison(
                f"write, {nth} in a repeat",
                rates[f"write@{place}"],
                rates[f"raw_write@{place}"],
                "B/s",
                f"{raw_write}, {nth}",
            )
        )
    for suffix, where in (("_cold", "from disk"), ("", "from page cache")):
        raw = rates[f"raw_read{suffix}"]
        for name, checked in (("read", ""), ("verified", ", CRC checked")):
            case = f"read {where}{checked}"
            out.append(Comparison(case, rates[name + suffix], raw, "B/s", f"raw read {where}"))
    return out


def run(w: IoWorkload) -> dict[str, Any]:
    """Write and read the checkpoint of ``w`` and the raw arrays; print a table of each figure
    beside its raw baseline and return the report."""
    work = Path(tempfile.mkdtemp(prefix="demb_io_bench_", dir=w.directory))
    times: dict[str, list[float]] = {k: [] for k in _KINDS}
    placed: dict[str, list[float]] = {f"{k}@{p}": [] for k in _KINDS[:2] for p in (1, 2)}
    data = list(chunks(w.rows, w.dim))  # made once, before any timing
    sides = _Sides(w, work, data)
    try:
        for r in range(w.repeats + 1):  # repeat 0 warms up; then a rotating order, medians
            _repeat(sides, r, times, placed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rates = {k: w.total_bytes / statistics.median(v) for k, v in {**times, **placed}.items()}
    comparisons = _comparisons(rates)
    print_comparisons(
        f"checkpoint of {w.total_bytes / 1e9:.3g} GB ({w.rows:,} rows x {w.dim} float32, keys, "
        f"2 score words) vs the same arrays as a raw file, median of {w.repeats} repeats",
        comparisons,
    )
    return {
        "benchmark": "io",
        "machine": machine_info(),
        "workload": w.as_dict(),
        "bytes_per_s": rates,
        "seconds": times,
        "write_seconds_by_place": placed,
        "comparisons": [c.as_dict() for c in comparisons],
    }
