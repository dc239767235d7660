"""Write and read throughput of a multi-GB checkpoint beside a raw copy of the same bytes.

One table of ``--rows`` float32 rows of ``--dim`` (plus keys and two score words) is written with
demb-io's streaming writer (CRC-32s, fsync, atomic commit) and read back (all chunks, with and
without CRC checks); in the same run the same number of bytes is written with plain file writes
and fsync, and read back into one reused buffer the size of a chunk's values (demb-io's read
with ``reuse=True``, its chunks in reused buffers too). Each repeat starts from an empty folder
after ``os.sync()``, and the two writes and the three reads run in an order that rotates from
repeat to repeat, so no side always comes first. The reads go through the page cache on both
sides (nothing here can drop it). Prints the medians' GB/s and ratios to raw; writes JSON.

Usage: ``python bench_io.py [--rows 4000000] [--dim 128] [--dir /tmp] [--out result.json]``.
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


def raw_write(path: Path, total: int, block: bytes) -> None:
    with open(path, "wb") as f:
        left = total
        while left > 0:
            f.write(block[: min(left, len(block))])
            left -= len(block)
        f.flush()
        os.fsync(f.fileno())


def raw_read(path: Path, block: int) -> int:
    got = 0
    buf = bytearray(block)
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
    parser.add_argument("--repeats", type=int, default=5)
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
    times: dict[str, list[float]] = {
        k: [] for k in ("write", "raw_write", "read", "verified", "raw_read")
    }
    noise = os.urandom(1 << 24)
    total = args.rows * (8 + 4 * args.dim + 2 * 8)  # keys, float32 values, two score words
    try:
        for r in range(args.repeats):  # demb-io and raw in rotating order; medians
            # Both writes start from the same state: no previous output, nothing pending.
            shutil.rmtree(work / "ckpt", ignore_errors=True)
            (work / "raw.bin").unlink(missing_ok=True)
            os.sync()

            def demb_write() -> None:
                with CheckpointWriter(work / "ckpt") as writer:
                    written = writer.write_shard(meta, chunks(args.rows, args.dim))
                assert sum(e.bytes or 0 for e in written.files.values()) == total

            def demb_read(verify: bool) -> None:
                table = Checkpoint(work / "ckpt").iter_table(
                    "ebc", "t", CHUNK, verify=verify, reuse=True
                )
                assert sum(c.rows for _, c in table) == args.rows

            def raw_write_all() -> None:
                raw_write(work / "raw.bin", total, noise)

            def raw_read_all() -> None:
                assert raw_read(work / "raw.bin", CHUNK * args.dim * 4) == total

            writes = [("write", demb_write), ("raw_write", raw_write_all)]
            for name, run in writes[r % 2 :] + writes[: r % 2]:
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
                os.sync()
            reads = [
                ("read", lambda: demb_read(False)),
                ("verified", lambda: demb_read(True)),
                ("raw_read", raw_read_all),
            ]
            for name, run in reads[r % 3 :] + reads[: r % 3]:
                t0 = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    t_write, t_raw_write, t_raw_read = med["write"], med["raw_write"], med["raw_read"]
    timings = {False: med["read"], True: med["verified"]}
    gb = total / 1e9
    result = {
        "bytes": total,
        "write_gbps": gb / t_write,
        "raw_write_gbps": gb / t_raw_write,
        "read_gbps": gb / timings[False],
        "read_verified_gbps": gb / timings[True],
        "raw_read_gbps": gb / t_raw_read,
        "write_ratio": t_raw_write / t_write,
        "read_ratio": t_raw_read / timings[False],
        "read_verified_ratio": t_raw_read / timings[True],
        "repeats": args.repeats,
        "seconds": times,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    print(f"checkpoint of {gb:.2f} GB ({args.rows:,} rows x {args.dim} float32)")
    print(
        f"write {result['write_gbps']:.2f} GB/s vs raw {result['raw_write_gbps']:.2f} GB/s: "
        f"{result['write_ratio']:.0%} of raw"
    )
    print(
        f"read {result['read_gbps']:.2f} GB/s ({result['read_verified_gbps']:.2f} with CRC "
        f"checks) vs raw {result['raw_read_gbps']:.2f} GB/s: {result['read_ratio']:.0%} "
        f"({result['read_verified_ratio']:.0%}) of raw"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
