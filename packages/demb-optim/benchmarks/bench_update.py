"""Throughput of the fused optimizer update: achieved GB/s and its fraction of the same run's
copy bandwidth; prints a table and writes JSON.

Shape from issue 4: Adam and FTRL at D=128 over 350,000 unique rows of a larger table, float32
rows. Bytes counted per updated row: the row read and written (embedding + state), its
gradient row read and its slot read. Median of ``--iters`` calls after a warm-up (CUDA events
on a GPU, wall clock on the CPU). The headline figure is the update itself
(``apply_update(check=False)``, what a trainer that produced the slots and gradients calls);
the time with ``check=True`` (finite gradients, slots in range: one sync) is printed beside it.

Usage: ``python bench_update.py [--device cuda|cpu] [--rows 350000] [--table-rows 2000000]
[--dim 128] [--dtype float32|float16|bfloat16] [--out results.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from demb_optim import FTRL, SGD, Adagrad, Adam, OptimizerSpec, RowWiseAdagrad, apply_update


def timed(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device copy of 512 MiB (read + write counted)."""
    src = torch.empty(2**27, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), device, 5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=350_000)
    parser.add_argument("--table-rows", type=int, default=2_000_000)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="bench_update.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    print(json.dumps(info))
    copy_bw = copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {copy_bw / 1e9:.1f} GB/s")
    results = []
    specs: list[OptimizerSpec] = [Adam(), FTRL(), SGD(), Adagrad(), RowWiseAdagrad()]
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(args.table_rows, generator=gen)[: args.rows].to(device)
    grads = torch.randn(args.rows, args.dim, generator=gen).to(device)
    for spec in specs:
        dtype = getattr(torch, args.dtype)
        width = args.dim + spec.state_dim(args.dim, dtype)
        values = torch.rand(args.table_rows, width, device=device).to(dtype)

        count = [1]

        def step(
            values: torch.Tensor = values,
            spec: OptimizerSpec = spec,
            count: list[int] = count,
            check: bool = False,
        ) -> None:
            count[0] += 1
            apply_update(spec, [values], [slots], [grads], [args.dim], count, check=check)

        step()
        seconds = timed(step, device, args.iters)
        checked_seconds = timed(lambda step=step: step(check=True), device, args.iters)
        moved = args.rows * (2 * width * values.element_size() + args.dim * 4 + 8)
        row = {
            "optimizer": str(spec.kind),
            "dim": args.dim,
            "dtype": args.dtype,
            "rows": args.rows,
            "row_width": width,
            "seconds": seconds,
            "seconds_with_check": checked_seconds,
            "bytes": moved,
            "gb_per_s": moved / seconds / 1e9,
            "fraction_of_copy_bandwidth": moved / seconds / copy_bw,
        }
        results.append(row)
        print(
            f"  {row['optimizer']:16s} {args.dtype} D={args.dim} rows={args.rows}: "
            f"{seconds * 1e3:8.2f} ms  "
            f"{row['gb_per_s']:7.1f} GB/s = {row['fraction_of_copy_bandwidth']:.0%} of copy  "
            f"(with check=True: {checked_seconds * 1e3:.2f} ms)"
        )
        del values
    with open(args.out, "w") as f:
        json.dump(
            {
                "command": " ".join(["python", "bench_update.py", *sys.argv[1:]]),
                "machine": info,
                "copy_bandwidth_bytes_per_s": copy_bw,
                "target_fraction": 0.7,
                "results": results,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
