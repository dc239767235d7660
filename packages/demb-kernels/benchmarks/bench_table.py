"""Throughput of the scored hash table ops, in keys per second; prints a table and writes JSON.

Shapes follow HierarchicalKV's benchmark: 1M-key batches into a 128M-slot table (buckets of
128), values of dim 32 and 128 (float32) copied out of the value buffer, at load factor 0.5 and
1.0. Measured per batch (CUDA events on a GPU, wall clock on the CPU), after warm-up:

* ``lookup``: every key present; slots looked up, rows gathered (no score update).
* ``lookup+touch``: the same with TIMESTAMP score updates.
* ``find_or_insert``: half the keys present, half new; rows gathered.
* ``insert_evict``: every key new into a full table, so every insert evicts; rows gathered.

Also printed: HKV's published A100 figures for the same shape, and this run's device-to-device
copy bandwidth (a roofline for the value copies).

Usage: ``python bench_table.py [--capacity-log2 27] [--batch 1048576] [--dims 32 128]
[--device cuda] [--out results.json]``. On the CPU, pass a scaled size, e.g.
``--device cpu --capacity-log2 22 --batch 131072``.
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
from demb_kernels import table as ops
from demb_kernels.rows import gather_rows
from demb_kernels.table import InsertStatus, ScorePolicy, TableIndex

HKV_A100 = {"lookup": 2.27e9, "find_or_insert": 1.28e9}
"""HKV v0.1 on A100-80GB, dim 32, load factor 0.5 (find; find_or_insert), keys/s."""
TARGETS_H200 = {"lookup": 4.5e9, "find_or_insert": 2.5e9}


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            cuda=torch.version.cuda,
        )
    return info


class Timer:
    """Per-call seconds of a step on static inputs: eagerly (Python issues every op, so launch
    and dispatch overhead counts where the GPU waits for it) and, on CUDA, replayed as a CUDA
    graph (the GPU's own time, as in HKV's C++ benchmark). ``load(k)`` fills the static inputs
    for call ``k`` and is not timed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _time(self, call: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            t0 = time.perf_counter()
            call()
            return time.perf_counter() - t0
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        call()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    def run(
        self, step: Callable[[], object], load: Callable[[int], None], iters: int
    ) -> dict[str, float]:
        """Median seconds per call, ``{"eager": ..., "graph": ...}`` (no graph on the CPU)."""
        load(0)
        step()  # warm-up (and the graph's warm-up)
        eager = []
        for k in range(iters):
            load(k + 1)
            eager.append(self._time(step))
        out = {"eager": sorted(eager)[iters // 2]}
        if self.device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            load(iters + 1)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                step()
            replays = []
            for k in range(iters):
                load(iters + 2 + k)
                replays.append(self._time(graph.replay))
            out["graph"] = sorted(replays)[iters // 2]
        return out


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write counted)."""
    src = torch.empty(2**28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = Timer(device).run(lambda: dst.copy_(src), lambda k: None, 10)["eager"]
    return 2 * src.numel() * 4 / seconds


class Keys:
    """Distinct keys: position ``i`` of a fixed random bijection of the int64 range."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.next = 1

    def take(self, n: int) -> torch.Tensor:
        ids = torch.arange(self.next, self.next + n, dtype=torch.int64, device=self.device)
        self.next += n
        # an odd multiplier (0x9E3779B97F4A7C15 as int64) is a bijection of the int64 range
        return ids * -0x61C8864680B583EB


def fill(index: TableIndex, keys: Keys, target: float, batch: int) -> torch.Tensor:
    """Insert fresh keys until the load factor reaches ``target`` (or stops growing, for a
    full table); returns the last batch, all present."""
    args = torch.tensor([1], device=index.device)
    cap = index.capacities[0]
    size = int(index.sizes[0])
    last = keys.take(0)
    while size < target * cap - batch // 2 or (target == 1.0 and size < 0.999 * cap):
        last = keys.take(batch)
        ops.find_or_insert(index, last, torch.zeros_like(last), args, check=False)
        before, size = size, int(index.sizes[0])
        if size - before < 0.01 * last.numel():
            break
    return last


def bench_dim(
    dim: int, capacity: int, batch: int, device: torch.device, iters: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    keys = Keys(device)
    index = TableIndex.create([capacity], [128], [ScorePolicy.TIMESTAMP], device)
    values = torch.zeros((capacity, dim), dtype=torch.float32, device=device)
    tids = torch.zeros(batch, dtype=torch.int64, device=device)
    now = torch.tensor([2], device=device)

    def gather(slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(values, slots, check=False)

    timer = Timer(device)
    inp = torch.empty(batch, dtype=torch.int64, device=device)

    def record(op: str, load: float, seconds: dict[str, float], note: str = "") -> None:
        lf_now = int(index.sizes[0]) / capacity
        row = {
            "op": op,
            "dim": dim,
            "load_factor": load,
            "load_factor_after": round(lf_now, 4),
            "batch": batch,
            "capacity": capacity,
            "note": note,
        }
        for mode, sec in seconds.items():
            row[f"{mode}_seconds_per_batch"] = sec
            row[f"{mode}_keys_per_second"] = batch / sec
        rows.append(row)
        rates = "  ".join(
            f"{mode} {batch / sec / 1e9:6.3f} B keys/s ({sec * 1e6:7.1f} us)"
            for mode, sec in seconds.items()
        )
        print(f"  dim {dim:4d}  {op:15s} lf {load:.2f} (after {lf_now:.3f})  {rates}  {note}")

    def feed(batches: list[torch.Tensor]) -> Callable[[int], None]:
        return lambda k: inp.copy_(batches[k % len(batches)])

    hits = fill(index, keys, 0.5, batch)
    assert hits.numel() == batch, "the table is too small for this batch size"
    record(
        "lookup",
        0.5,
        timer.run(lambda: gather(ops.lookup(index, inp, tids, check=False)), feed([hits]), iters),
    )
    record(
        "lookup+touch",
        0.5,
        timer.run(
            lambda: gather(ops.lookup(index, inp, tids, now, check=False)), feed([hits]), iters
        ),
    )

    def half_new(present: torch.Tensor) -> torch.Tensor:
        return torch.cat([present[: batch // 2], keys.take(batch - batch // 2)])

    def find_or_insert() -> torch.Tensor:
        res = ops.find_or_insert(index, inp, tids, now, check=False)
        gather(res.slots)
        return res.status

    calls = 2 * iters + 2
    batches = [half_new(hits) for _ in range(calls)]
    record("find_or_insert", 0.5, timer.run(find_or_insert, feed(batches), iters), "50% new keys")

    last = fill(index, keys, 1.0, batch)
    batches = [half_new(last) for _ in range(calls)]
    record("find_or_insert", 1.0, timer.run(find_or_insert, feed(batches), iters), "50% new keys")

    fresh = [keys.take(batch) for _ in range(calls)]
    seconds = timer.run(find_or_insert, feed(fresh), iters)
    inp.copy_(keys.take(batch))
    evicting = float((find_or_insert() == InsertStatus.EVICTED).float().mean())
    record("insert_evict", 1.0, seconds, f"all keys new; {evicting:.1%} of them evicted")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity-log2", type=int, default=27)
    parser.add_argument("--batch", type=int, default=1 << 20)
    parser.add_argument("--dims", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="bench_table.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    capacity = 1 << args.capacity_log2
    info = machine_info(device)
    print(json.dumps(info))
    bandwidth = copy_bandwidth(device)
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.0f} GB/s")
    results: list[dict[str, Any]] = []
    for dim in args.dims:
        results += bench_dim(dim, capacity, args.batch, device, args.iters)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("reference: HKV on A100 (dim 32, lf 0.5): find 2.27 B KV/s, find_or_insert 1.28 B KV/s")
    for row in results:
        if row["dim"] == 32 and row["load_factor"] == 0.5 and row["op"] in HKV_A100:
            op = row["op"]
            for mode in ("graph", "eager"):
                rate = row.get(f"{mode}_keys_per_second")
                if rate is None:
                    continue
                print(
                    f"  {op} ({mode}): {rate / 1e9:.3f} B keys/s = {rate / HKV_A100[op]:.2f} x "
                    f"HKV A100, {rate / TARGETS_H200[op]:.2f} x the H200 target"
                )
    with open(args.out, "w") as f:
        json.dump(
            {
                "command": " ".join(["python", "bench_table.py", *sys.argv[1:]]),
                "machine": info,
                "copy_bandwidth_bytes_per_s": bandwidth,
                "hkv_a100_keys_per_s": HKV_A100,
                "targets_h200_keys_per_s": TARGETS_H200,
                "results": results,
            },
            f,
            indent=2,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
