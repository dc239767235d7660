"""Where a step of the reference workload spends its time: torch.profiler over training and eval
steps of ``demb bench module``'s workload; prints the top ops by device time and by host time.

Usage: ``python profile_module.py [--scale 1.0] [--optimizer adam] [--pooling none]
[--trace trace.json]`` (``--trace`` also writes a Chrome trace: the phases are the ranges
``train_forward``, ``train_backward`` and ``eval_forward``).
"""

from __future__ import annotations

import argparse
import json

import torch
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload
from torch.profiler import ProfilerActivity, profile, record_function

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_READS = ("aten::item", "aten::tolist", "aten::is_nonzero", "aten::_to_copy")
_PHASES = ("train_forward", "train_backward", "eval_forward")


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def print_phases(trace_path: str, top: int = 12) -> None:
    """Per phase (mean over its steps): wall time, GPU busy time (union of kernels, copies,
    memsets), launches, synchronizations, and the host ops with the most self time."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in _GPU_CATS]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    for phase in _PHASES:
        ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == phase]
        if not ranges:
            continue
        n = len(ranges)
        wall = busy = launches = syncs = 0.0
        self_time: dict[str, float] = {}
        for r in ranges:
            lo, hi = r["ts"], r["ts"] + r["dur"]
            wall += hi - lo
            busy += _busy([(max(a, lo), min(b, hi)) for a, b in gpu if b > lo and a < hi])
            inside = [e for e in runtime if lo <= e["ts"] < hi]
            launches += sum("Launch" in e["name"] for e in inside)
            syncs += sum("Synchronize" in e["name"] or "DtoH" in e["name"] for e in inside)
            for e in ops:
                if lo <= e["ts"] < hi:
                    self_time[e["name"]] = self_time.get(e["name"], 0.0) + e["dur"]
        print(
            f"{phase}: wall {wall / n / 1e3:.3f} ms, GPU busy {busy / n / 1e3:.3f} ms, "
            f"{launches / n:.0f} launches, {syncs / n:.0f} syncs (per step, {n} steps)"
        )
        ranked = sorted(self_time.items(), key=lambda kv: -kv[1])[:top]
        print("   " + ", ".join(f"{k} {v / n:.0f}us" for k, v in ranked))


def print_timeline(trace_path: str) -> None:
    """The last step of each phase in time order (us from the phase's start): the outermost
    host ops, the runtime calls that wait (synchronize, device-to-host copies), and the GPU
    work; where the GPU idles between two pieces of work, the gap is printed."""
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    for phase in _PHASES:
        ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == phase]
        if not ranges:
            continue
        r = ranges[-1]
        lo, hi = r["ts"], r["ts"] + r["dur"]
        ops = sorted(
            (e for e in events if e.get("cat") == "cpu_op" and lo <= e["ts"] < hi),
            key=lambda e: (e["ts"], -e["dur"]),
        )
        rows: list[tuple[float, str]] = []
        end = float("-inf")
        for e in ops:  # outermost ops, and the demb ops and read-backs inside them
            inner = e["ts"] < end
            if not inner or e["name"].startswith("demb::") or e["name"] in _READS:
                pad = "    " if inner else ""
                text = f"host {e['ts'] - lo:8.1f} +{e['dur']:7.1f}  {pad}{e['name']}"
                rows.append((e["ts"], text))
            end = max(end, e["ts"] + e["dur"])
        waits = ("Synchronize", "Memcpy")
        for e in events:
            inside = e.get("cat") == "cuda_runtime" and lo <= e["ts"] < hi
            if inside and any(w in e["name"] for w in waits):
                text = f"wait {e['ts'] - lo:8.1f} +{e['dur']:7.1f}  {e['name']}"
                rows.append((e["ts"], text))
        gpu = sorted(
            (e for e in events if e.get("cat") in _GPU_CATS and lo <= e["ts"] < hi),
            key=lambda e: e["ts"],
        )
        last = lo
        for e in gpu:
            if e["ts"] - last > 2.0:
                rows.append((e["ts"] - 0.01, f"IDLE {last - lo:8.1f} +{e['ts'] - last:7.1f}"))
            rows.append((e["ts"], f" gpu {e['ts'] - lo:8.1f} +{e['dur']:7.1f}  {e['name'][:70]}"))
            last = max(last, e["ts"] + e["dur"])
        print(f"== timeline of {phase} ({r['dur']:.1f} us)")
        for _, text in sorted(rows):
            print("  " + text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--pooling", default="none")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--trace", default=None)
    parser.add_argument("--timeline", action="store_true", help="print the last step in order")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = Workload(optimizer=args.optimizer, pooling=args.pooling).scaled(args.scale)
    module, batches, grad = ready(w, device, 2)

    def step(i: int) -> None:
        module.train()
        with record_function("train_forward"):
            out = module(*batches[i % 2])
            sync()
        with record_function("train_backward"):
            torch.autograd.backward([out], [grad])
            sync()
        module.eval()
        with record_function("eval_forward"), torch.no_grad():
            module(*batches[i % 2])
            sync()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    for i in range(3):
        step(i)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    before = torch.cuda.memory_stats() if device.type == "cuda" else {}
    with profile(activities=activities) as prof:
        for i in range(2):
            step(i)
        sync()
    if device.type == "cuda":
        after = torch.cuda.memory_stats()
        moves = {
            k: after.get(k, 0) - before.get(k, 0)
            for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")
        }
        print(f"caching allocator during the profiled steps: {moves}")
    trace = args.trace or "/tmp/demb_profile_trace.json"
    prof.export_chrome_trace(trace)
    print_phases(trace)
    if args.timeline:
        print_timeline(trace)
    averages = prof.key_averages()
    if device.type == "cuda":
        print(
            averages.table(
                sort_by="device_time_total", row_limit=args.rows, max_name_column_width=60
            )
        )
    print(averages.table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60))


if __name__ == "__main__":
    main()
