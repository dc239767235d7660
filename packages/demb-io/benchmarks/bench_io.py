"""Write and read throughput of a multi-GB checkpoint beside a raw copy of the same bytes.

One table of ``--rows`` float32 rows of ``--dim`` (plus keys and two score words) is written with
demb-io's streaming writer (CRC-32s, fsync, atomic commit) and read back (all chunks, with and
without CRC checks); in the same run the same arrays are written with plain file writes into one
file and fsync, and read back into one reused buffer the size of a chunk's values (demb-io's
read with ``reuse=True``, its chunks in reused buffers too). The chunks are made before the
timing starts, so neither side is charged for making them. Each repeat starts from an empty
folder after ``os.sync()``; the two writes, and the three reads, run in an order that rotates
from repeat to repeat, so no side always comes first; a first, untimed repeat warms up. This VM's
disk takes a burst of writes fast and the next one slowly, so each side's writes are also
summed up by their place in the repeat (first or second write), each place compared with the
other side's at the same place. Each read runs twice: first from the disk (the files' clean
pages dropped from the page cache with ``posix_fadvise(DONTNEED)``), then again from the page
cache. Prints the medians' GB/s and ratios to raw; writes JSON.

Usage: ``python bench_io.py [--rows 4000000] [--dim 128] [--dir /tmp] [--repeats 16]
[--out result.json]`` (an even number of repeats: each side writes first equally often).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from demb_io import Checkpoint, CheckpointWriter, ShardData, ShardMeta

CHUNK = 1 << 18  # rows per chunk written


def chunks(rows: int, dim: int) -> Iterator[ShardData]:
    rng = np.random.default_rng(0)
    block = rng.standard_normal((CHUNK, dim)).astype(np.float32)
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


def drop_cached(paths: list[Path]) -> None:
    """Drop the files' (clean, synced) pages from the page cache: the next read is from disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(path: Path, block: int) -> int:
    got = 0
    buf = np.empty(block, dtype=np.uint8).data  # allocated as demb-io's reader allocates
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            got += n
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--out", default=None)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="demb_io_bench_", dir=args.dir))
    meta = ShardMeta(
        collection="ebc",
        table="t",
        rank=0,
        world_size=1,
        dist_type="roundrobin",
        embedding_dtype="float32",
        embedding_dim=args.dim,
        rows=0,
        score_strategy=("TIMESTAMP", "LFU"),
    )
    reads = ("read", "verified", "raw_read")
    kinds = ("write", "raw_write", *reads, *(f"{k}_cold" for k in reads))
    times: dict[str, list[float]] = {k: [] for k in kinds}
    placed: dict[str, list[float]] = {f"{k}@{p}": [] for k in kinds[:2] for p in (1, 2)}
    data = list(chunks(args.rows, args.dim))  # made once, before any timing
    total = args.rows * (8 + 4 * args.dim + 2 * 8)  # keys, float32 values, two score words
    try:
        for r in range(args.repeats + 1):  # repeat 0 warms up; then rotating order, medians
            # Both writes start from the same state: no previous output, nothing pending.
            shutil.rmtree(work / "ckpt", ignore_errors=True)
            (work / "raw.bin").unlink(missing_ok=True)
            os.sync()

            def demb_write() -> None:
                with CheckpointWriter(work / "ckpt") as writer:
                    written = writer.write_shard(meta, data)
                assert sum(e.bytes or 0 for e in written.files.values()) == total

            def demb_read(verify: bool) -> None:
                table = Checkpoint(work / "ckpt").iter_table(
                    "ebc", "t", CHUNK, verify=verify, reuse=True
                )
                assert sum(c.rows for _, c in table) == args.rows

            def raw_write_all() -> None:
                assert raw_write(work / "raw.bin", data) == total

            def raw_read_all() -> None:
                assert raw_read(work / "raw.bin", CHUNK * args.dim * 4) == total

            writes = [("write", demb_write), ("raw_write", raw_write_all)]
            for place, (name, run) in enumerate(writes[r % 2 :] + writes[: r % 2], 1):
                t0 = time.perf_counter()
                run()
                if r:
                    times[name].append(time.perf_counter() - t0)
                    placed[f"{name}@{place}"].append(times[name][-1])
                os.sync()
            demb_files = [p for p in (work / "ckpt").rglob("*") if p.is_file()]
            runs = [
                ("read", lambda: demb_read(False), demb_files),
                ("verified", lambda: demb_read(True), demb_files),
                ("raw_read", raw_read_all, [work / "raw.bin"]),
            ]
            for name, run, files in runs[r % 3 :] + runs[: r % 3]:
                drop_cached(files)
                for key in (f"{name}_cold", name):  # from the disk, then from the page cache
                    t0 = time.perf_counter()
                    run()
                    if r:
                        times[key].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    gb = total / 1e9
    result: dict[str, object] = {"bytes": total}
    for kind in kinds:
        result[f"{kind}_gbps"] = gb / med[kind]
    result["write_ratio"] = med["raw_write"] / med["write"]
    at = {k: statistics.median(v) for k, v in placed.items()}
    for place in (1, 2):
        result[f"write_ratio_when_{place}"] = at[f"raw_write@{place}"] / at[f"write@{place}"]
    for suffix in ("_cold", ""):
        for name in ("read", "verified"):
            result[f"{name}{suffix}_ratio"] = med[f"raw_read{suffix}"] / med[f"{name}{suffix}"]
    result.update(
        repeats=args.repeats,
        seconds=times,
        write_seconds_by_place=placed,
        machine={"cpus": os.cpu_count(), "python": platform.python_version()},
        command=" ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    )
    print(f"checkpoint of {gb:.2f} GB ({args.rows:,} rows x {args.dim} float32)")
    print(
        f"write {gb / med['write']:.2f} GB/s vs raw {gb / med['raw_write']:.2f} GB/s: "
        f"{result['write_ratio']:.0%} of raw; written first in a repeat "
        f"{gb / at['write@1']:.2f} vs {gb / at['raw_write@1']:.2f} GB/s "
        f"({result['write_ratio_when_1']:.0%}), second {gb / at['write@2']:.2f} vs "
        f"{gb / at['raw_write@2']:.2f} GB/s ({result['write_ratio_when_2']:.0%})"
    )
    for suffix, where in (("_cold", "from disk"), ("", "from the page cache")):
        print(
            f"read {where} {gb / med['read' + suffix]:.2f} GB/s "
            f"({gb / med['verified' + suffix]:.2f} with CRC checks) vs raw "
            f"{gb / med['raw_read' + suffix]:.2f} GB/s: {result['read' + suffix + '_ratio']:.0%} "
            f"({result['verified' + suffix + '_ratio']:.0%}) of raw"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
