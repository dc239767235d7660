"""When each part of a table-module step starts and ends, on the host and on the GPU, without a
profiler: the module's internals are wrapped so that each call records ``perf_counter`` and a
CUDA event at its entry and its exit; offsets are from the phase's start (the GPU's from an
event recorded there, the GPU idle then). A GPU offset equal to the host one means the GPU had
caught up with the host there (it waited for it); a larger one, how far behind the host queued
work it was. Each mark costs an event (about 10 us of host time on the H200's hosts), so the
absolute offsets run late. Medians of 20 steps after 5, with autograd's default threading and
with the backward on the calling thread. The backward is one C++ node (``demb::summed_update``):
only its start and end are marked.

Usage: ``python host_stamps.py [tiny] [host]`` (after ``source .device/setup.sh`` on the H200);
``tiny``: a batch of one key per feature on the scaled-down workload (fixed costs only);
``host``: host clocks only (no event per mark, about 1 us each: the host offsets are close to
true; the GPU column is NaN), but for the marks named by an argument ``events=a,b``.
"""

from __future__ import annotations

import collections
import functools
import statistics
import sys
import time
from collections.abc import Callable

import demb_torchrec._autograd as ag
import demb_torchrec._launched as la
import demb_torchrec.batched_tables as bt
import torch
from demb_storage import _gated as gated
from demb_storage import scored_table as st
from demb_torchrec.bench.module_bench import build, ready
from demb_torchrec.bench.workload import Workload

marks: list[tuple[str, float, torch.cuda.Event | None]] = []
HOST_ONLY = "host" in sys.argv[1:]
EVENTS = {"start"}.union(
    *(a.removeprefix("events=").split(",") for a in sys.argv[1:] if a.startswith("events="))
)


def mark(label: str) -> None:
    event = None
    if not HOST_ONLY or label in EVENTS:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record()
    marks.append((label, time.perf_counter(), event))


def wrap(owner: object, name: str, label: str, static: bool = False) -> None:
    """Replace ``owner.name`` by a copy that marks its entry (``label>``) and exit."""
    f: Callable[..., object] = getattr(owner, name)

    @functools.wraps(f)
    def marked(*a: object, **k: object) -> object:
        mark(label + ">")
        r = f(*a, **k)
        mark(label + "<")
        return r

    setattr(owner, name, staticmethod(marked) if static else marked)


def main() -> None:
    wrap(bt, "check_batch_args", "check_args")
    wrap(bt, "dedup", "dedup")  # the two-sync path (CPU, growable tables, a short key_bits guess)
    wrap(bt, "launched_find_or_insert", "launched")  # the one-sync path (CUDA training forward)
    wrap(la, "dedup_launch", "dedup_launch")
    wrap(la, "find_or_insert_launched", "foi_launched")
    wrap(la, "launch_info", "launch_info")
    wrap(la, "packed_radix", "packed_radix")
    wrap(la, "DedupedBatch", "deduped_batch")
    wrap(gated, "find_or_insert_gated", "foi_gated")
    wrap(gated, "gate_words", "gate_words")
    wrap(bt.DynamicEmbeddingTables, "_initialize_new", "init_new")
    wrap(bt.DynamicEmbeddingTables, "_forward_none", "fwd_none")
    wrap(st.ScoredHashTable, "find_or_insert", "st.find_or_insert")
    wrap(st.ScoredHashTable, "next_score_args", "score_args")
    wrap(st.ops, "find_or_insert_rows", "op.find_or_insert_rows")
    wrap(bt, "summed_per_key", "summed_per_key")
    wrap(ag, "segment_plan", "segment_plan")
    wrap(bt, "eval_none", "eval_none")
    dev = torch.device("cuda")
    if "tiny" in sys.argv[1:]:
        m = build(Workload().scaled(0.01), dev)
        features = len(m.feature_table_map)
        tiny = (torch.arange(features, device=dev) + 1, torch.arange(features + 1, device=dev))
        batches, grad = [tiny] * 4, torch.ones(features, m.dims[0], device=dev)
    else:
        m, batches, grad = ready(Workload(), dev)
    phases = ("fwd", "bwd", "eval")
    for mode in ("default", "caller"):
        rows: dict[tuple[str, str], list[tuple[float, float]]] = collections.defaultdict(list)
        out = None
        for i in range(25):
            for phase in phases:
                torch.cuda.synchronize()
                marks.clear()
                m.train(phase != "eval")
                mark("start")
                if phase == "fwd":
                    out = m(*batches[i % 4])
                elif phase == "bwd":
                    assert out is not None
                    with torch.autograd.set_multithreading_enabled(mode == "default"):
                        torch.autograd.backward([out], [grad])
                else:
                    with torch.no_grad():
                        m(*batches[i % 4])
                mark("return")
                torch.cuda.synchronize()
                end = time.perf_counter()
                if i < 5:
                    continue
                h0, e0 = marks[0][1], marks[0][2]
                seen: collections.Counter[str] = collections.Counter()
                for label, t, e in marks:
                    seen[label] += 1
                    key = label if seen[label] == 1 else f"{label}#{seen[label]}"
                    g = float("nan") if e is None or e0 is None else e0.elapsed_time(e) * 1e3
                    rows[(phase, key)].append(((t - h0) * 1e6, g))
                rows[(phase, "synced")].append(((end - h0) * 1e6, float("nan")))
        print(f"== {mode}")
        for k in sorted(
            rows, key=lambda k: (phases.index(k[0]), statistics.median(x[0] for x in rows[k]))
        ):
            host = statistics.median(x[0] for x in rows[k])
            gpu = statistics.median(x[1] for x in rows[k])
            print(f"  {k[0]:4s} {k[1]:28s} host {host:8.1f} us   gpu {gpu:8.1f} us")


if __name__ == "__main__":
    main()
