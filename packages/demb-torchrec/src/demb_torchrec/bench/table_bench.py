"""``demb bench table``: throughput of the scored hash table ops (:mod:`demb_kernels.table`), in
keys per second, beside the memory floor measured in the same run.

Shapes follow HierarchicalKV's benchmark: 1M-key batches into a 128M-slot table (buckets of
128), values of dim 32 and 128 (float32) copied out of the value buffer, at load factor 0.5 and
1.0 (the full size, the default on a GPU; the CPU default is 1M slots and 8K-key batches, the
same batch-to-table ratio). Measured per batch (CUDA events on a GPU, the wall clock on the
CPU), the median of ``iters`` batches after a warm-up one:

* ``lookup``: every key present; slots looked up, rows gathered (no score update).
* ``lookup+touch``: the same with TIMESTAMP score updates.
* ``find_or_insert``: half the keys present, half new; rows gathered (at load factor 0.5, and
  at 1.0 where every new key evicts).
* ``insert_evict``: every key new into a full table, so every insert evicts; rows gathered.

Each is timed eagerly (Python issues every op) and, on CUDA, also replayed as a CUDA graph (the
GPU's own time, as in HKV's C++ benchmark). The floor beside each: the same run's device copy
bandwidth over the bytes a key cannot avoid moving (its 8-byte key read, its value row read and
written out), in keys/s; the ratio is the fraction of that floor reached (the copy streams
through memory: on the CPU a small batch's rows written out can stay in cache, so a lookup
may pass 1). HKV's published A100
figures for the same shape are kept in the report as a reference (not measured in this run).
With ``profile``, the per-kernel time of lookup and find_or_insert at load factor 0.5
(torch.profiler) is printed too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from demb_kernels import table as ops
from demb_kernels.rows import gather_rows
from demb_kernels.table import InsertStatus, ScorePolicy, TableIndex

from demb_torchrec.bench.compare import (
    Comparison,
    copy_bandwidth,
    format_si,
    machine_info,
    print_comparisons,
    run_cases,
    seconds_of,
)

__all__ = [
    "BUCKET",
    "HKV_A100",
    "TARGETS_H200",
    "Keys",
    "TableWorkload",
    "Timer",
    "fill",
    "floor_bytes_per_key",
    "profile_ops",
    "run",
]

HKV_A100 = {"lookup": 2.27e9, "find_or_insert": 1.28e9}
"""HKV v0.1 on A100-80GB, dim 32, load factor 0.5 (find; find_or_insert), keys/s."""
TARGETS_H200 = {"lookup": 4.5e9, "find_or_insert": 2.5e9}
"""This project's H200 targets for the same shape, keys/s."""
BUCKET = 128
"""Slots per bucket."""


@dataclass(frozen=True)
class TableWorkload:
    """The table's slots (``2 ** capacity_log2``), the keys per batch, the value dims, and the
    timed batches per op. The defaults are the full size (HKV's shape)."""

    capacity_log2: int = 27
    batch: int = 1 << 20
    dims: tuple[int, ...] = (32, 128)
    iters: int = 20
    copy_mib: int = 1024
    """The size of the copy that measures the device's bandwidth."""

    def __post_init__(self) -> None:
        if 1 << self.capacity_log2 < BUCKET:
            raise ValueError(f"capacity_log2={self.capacity_log2!r}: less than one bucket")
        if not 0 < self.batch <= self.capacity // 2:
            raise ValueError(f"batch={self.batch!r}: must be in [1, capacity / 2]")
        if not self.dims or min(self.dims) < 1:
            raise ValueError(f"dims={self.dims!r}: must be positive")
        if self.iters < 1:
            raise ValueError(f"iters={self.iters!r}: must be >= 1")
        if self.copy_mib < 1:
            raise ValueError(f"copy_mib={self.copy_mib!r}: must be >= 1")

    @property
    def capacity(self) -> int:
        """Slots in the table."""
        return 1 << self.capacity_log2

    def as_dict(self) -> dict[str, Any]:
        """The workload as JSON fields."""
        return {**asdict(self), "dims": list(self.dims), "capacity": self.capacity}


CPU_WORKLOAD = TableWorkload(capacity_log2=20, batch=1 << 13, iters=10, copy_mib=512)
"""The CPU's default: 1M slots, 8K-key batches (the full size's batch-to-table ratio)."""


def floor_bytes_per_key(dim: int) -> int:
    """Bytes a key cannot avoid moving: the 8-byte key read, its float32 row read and written
    out."""
    return 8 + 2 * dim * 4


class Timer:
    """Per-call seconds of a step on static inputs: eagerly (Python issues every op, so launch
    and dispatch overhead counts where the GPU waits for it) and, on CUDA, replayed as a CUDA
    graph (the GPU's own time). ``load(k)`` fills the static inputs for call ``k`` and is not
    timed."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def run(
        self, step: Callable[[], object], load: Callable[[int], object], iters: int
    ) -> dict[str, float]:
        """Median seconds per call, ``{"eager": ..., "graph": ...}`` (no graph on the CPU)."""
        load(0)
        step()  # warm-up (and the graph's warm-up)
        eager = []
        for k in range(iters):
            load(k + 1)
            eager.append(seconds_of(step, self.device))
        out = {"eager": sorted(eager)[iters // 2]}
        if self.device.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            load(iters + 1)
            side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                step()
            replays = []
            for k in range(iters):
                load(iters + 2 + k)
                replays.append(seconds_of(graph.replay, self.device))
            out["graph"] = sorted(replays)[iters // 2]
        return out


class Keys:
    """Distinct keys: position ``i`` of a fixed random bijection of the int64 range."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.next = 1

    def take(self, n: int) -> torch.Tensor:
        """The next ``n`` keys, none taken before."""
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


class _DimRun:
    """The ops of one value dim on one fresh table, and the rows they gave."""

    def __init__(self, w: TableWorkload, dim: int, device: torch.device) -> None:
        self.w, self.dim, self.device = w, dim, device
        self.rows: list[dict[str, Any]] = []
        d, b = device, w.batch
        self.keys = Keys(d)
        self.index = TableIndex.create([w.capacity], [BUCKET], [ScorePolicy.TIMESTAMP], d)
        self.values = torch.zeros((w.capacity, dim), dtype=torch.float32, device=d)
        self.tids = torch.zeros(b, dtype=torch.int64, device=d)
        self.now = torch.tensor([2], device=d)
        self.inp = torch.empty(b, dtype=torch.int64, device=d)
        self.timer = Timer(d)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.values, slots, check=False)

    def lookup(self) -> torch.Tensor:
        return self.gather(ops.find(self.index, self.inp, self.tids, check=False))

    def lookup_touch(self) -> torch.Tensor:
        return self.gather(ops.find(self.index, self.inp, self.tids, self.now, check=False))

    def find_or_insert(self) -> torch.Tensor:
        res = ops.find_or_insert(self.index, self.inp, self.tids, self.now, check=False)
        self.gather(res.slots)
        return res.status

    def feed(self, batches: list[torch.Tensor]) -> Callable[[int], object]:
        return lambda k: self.inp.copy_(batches[k % len(batches)])

    def half_new(self, present: torch.Tensor) -> torch.Tensor:
        half = self.w.batch // 2
        return torch.cat([present[:half], self.keys.take(self.w.batch - half)])

    def record(self, op: str, load: float, seconds: dict[str, float], note: str = "") -> None:
        row: dict[str, Any] = {
            "op": op,
            "dim": self.dim,
            "load_factor": load,
            "load_factor_after": round(int(self.index.sizes[0]) / self.w.capacity, 4),
            "batch": self.w.batch,
            "capacity": self.w.capacity,
            "note": note,
        }
        for mode, sec in seconds.items():
            row[f"{mode}_seconds_per_batch"] = sec
            row[f"{mode}_keys_per_second"] = self.w.batch / sec
        self.rows.append(row)

    def run(self) -> list[dict[str, Any]]:
        w, timer = self.w, self.timer
        hits = fill(self.index, self.keys, 0.5, w.batch)
        if hits.numel() != w.batch:
            raise RuntimeError("the table filled up before load factor 0.5: batch too large")
        self.record("lookup", 0.5, timer.run(self.lookup, self.feed([hits]), w.iters))
        self.record("lookup+touch", 0.5, timer.run(self.lookup_touch, self.feed([hits]), w.iters))
        calls = 2 * w.iters + 2
        batches = [self.half_new(hits) for _ in range(calls)]
        seconds = timer.run(self.find_or_insert, self.feed(batches), w.iters)
        self.record("find_or_insert", 0.5, seconds, "50% new keys")
        last = fill(self.index, self.keys, 1.0, w.batch)
        batches = [self.half_new(last) for _ in range(calls)]
        seconds = timer.run(self.find_or_insert, self.feed(batches), w.iters)
        self.record("find_or_insert", 1.0, seconds, "50% new keys")
        fresh = [self.keys.take(w.batch) for _ in range(calls)]
        seconds = timer.run(self.find_or_insert, self.feed(fresh), w.iters)
        self.inp.copy_(self.keys.take(w.batch))
        evicting = float((self.find_or_insert() == InsertStatus.EVICTED).float().mean())
        self.record("insert_evict", 1.0, seconds, f"all keys new; {evicting:.1%} of them evicted")
        self.rows[-1]["evicted_fraction"] = evicting
        return self.rows


def profile_ops(w: TableWorkload, device: torch.device, batches: int = 10) -> str:
    """torch.profiler's per-kernel table of ``batches`` lookups (all keys present) and
    find_or_inserts (half of them new) on a table at load factor 0.5: where a batch's time
    goes."""
    from torch.profiler import ProfilerActivity, profile

    keys = Keys(device)
    index = TableIndex.create([w.capacity], [BUCKET], [ScorePolicy.TIMESTAMP], device)
    hits = fill(index, keys, 0.5, w.batch)
    tids = torch.zeros(w.batch, dtype=torch.int64, device=device)
    now = torch.tensor([2], device=device)
    half = w.batch // 2
    news = [torch.cat([hits[:half], keys.take(w.batch - half)]) for _ in range(batches)]
    for _ in range(3):
        ops.find(index, hits, tids, check=False)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities, acc_events=True) as prof:
        for k in news:
            ops.find(index, hits, tids, check=False)
            ops.find_or_insert(index, k, tids, now, check=False)
        if cuda:
            torch.cuda.synchronize(device)
    sort = "cuda_time_total" if cuda else "cpu_time_total"
    table: str = prof.key_averages().table(sort_by=sort, row_limit=15)
    return table


def _comparisons(rows: list[dict[str, Any]], bandwidth: float) -> list[Comparison]:
    out = []
    for row in rows:
        floor = bandwidth / floor_bytes_per_key(row["dim"])
        row["floor_keys_per_second"] = floor
        for mode in ("eager", "graph"):
            rate = row.get(f"{mode}_keys_per_second")
            if rate is None:
                continue
            row[f"{mode}_fraction_of_floor"] = rate / floor
            case = f"{row['op']} D={row['dim']} lf {row['load_factor']:.1f} {mode}"
            out.append(Comparison(case, rate, floor, "keys/s", "copy floor (key + row r/w)"))
    return out


def _print_reference(rows: list[dict[str, Any]]) -> None:
    print("reference (published, not this run): HKV v0.1 on A100, dim 32, lf 0.5:")
    for row in rows:
        if row["dim"] != 32 or row["load_factor"] != 0.5 or row["op"] not in HKV_A100:
            continue
        op = row["op"]
        for mode in ("graph", "eager"):
            rate = row.get(f"{mode}_keys_per_second")
            if rate is not None:
                print(
                    f"  {op} ({mode}): {format_si(rate, 'keys/s')} = {rate / HKV_A100[op]:.2f}x "
                    f"HKV A100 ({format_si(HKV_A100[op], 'keys/s')}), "
                    f"{rate / TARGETS_H200[op]:.2f}x the H200 target"
                )


def run(w: TableWorkload, device: torch.device, profile: bool = False) -> dict[str, Any]:
    """Time the table ops of ``w`` on ``device``; print a table of each op's keys/s beside the
    same run's copy floor and return the report."""
    bandwidth = copy_bandwidth(device, w.copy_mib)
    rows = run_cases(device, w.dims, lambda dim: _DimRun(w, dim, device).run())
    comparisons = _comparisons(rows, bandwidth)
    print_comparisons(
        f"table ops on {device} ({w.capacity:,} slots, batches of {w.batch:,} keys); copy "
        f"bandwidth {format_si(bandwidth, 'B/s')} (read + write); floor = that bandwidth over "
        "the bytes a key moves (8-byte key, float32 row read and written)",
        comparisons,
    )
    after = ", ".join(
        f"D={r['dim']} lf {r['load_factor']:.1f} -> {r['load_factor_after']:.3f}"
        for r in rows
        if r["op"] == "find_or_insert"
    )
    evicted = ", ".join(
        f"D={r['dim']} {r['evicted_fraction']:.1%}" for r in rows if r["op"] == "insert_evict"
    )
    print(f"  find_or_insert (half of each batch's keys new), load factor after: {after}")
    print(f"  insert_evict (every key new into a full table), keys evicting: {evicted}")
    if device.type == "cuda":
        _print_reference(rows)
    report: dict[str, Any] = {
        "benchmark": "table",
        "machine": machine_info(device),
        "workload": w.as_dict(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "floor_bytes_per_key": {str(d): floor_bytes_per_key(d) for d in w.dims},
        "hkv_a100_keys_per_s": HKV_A100,
        "targets_h200_keys_per_s": TARGETS_H200,
        "results": rows,
        "comparisons": [c.as_dict() for c in comparisons],
    }
    if profile:
        table = profile_ops(w, device)
        print("per-kernel time of lookup and find_or_insert at load factor 0.5:")
        print(table)
        report["profile"] = table
    return report
