"""Host time of each part of a table-module step on the reference workload (Adam, NONE), without
a profiler: the module's internals are wrapped with timers, and each phase is timed to its
return (host) and to the end of its GPU work (total). A part that waits for the GPU (one marked
"sync") includes that wait. Medians of 20 steps after 5; CUDA only.

Usage: ``python host_sections.py`` (after ``source .device/setup.sh`` on the H200).
"""

from __future__ import annotations

import collections
import functools
import statistics
import time

import demb_torchrec._autograd as ag
import demb_torchrec.batched_tables as bt
import torch
from demb_storage import scored_table as st
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload

times: dict[str, list[float]] = collections.defaultdict(list)


def wrap(owner: object, name: str, label: str) -> None:
    """Replace ``owner.name`` by a copy that records its host time under ``label``."""
    f = getattr(owner, name)

    @functools.wraps(f)
    def timed(*a: object, **k: object) -> object:
        t = time.perf_counter()
        r = f(*a, **k)
        times[label].append(time.perf_counter() - t)
        return r

    setattr(owner, name, timed)


def main() -> None:
    wrap(bt, "dedup", "fwd.dedup(sync)")
    wrap(st.ScoredHashTable, "find_or_insert", "fwd.find_or_insert")
    wrap(bt, "init_new_rows", "fwd.init_new_rows")
    wrap(bt, "gather_table_rows", "gather")
    wrap(ag, "trained_rows", "fwd.trained_rows")
    wrap(bt, "status_count_tensor", "fwd.status_count_tensor")
    wrap(ag, "segment_sum_rows", "bwd.segment_sum")
    wrap(ag, "apply_update", "bwd.apply_update")
    wrap(st.ScoredHashTable, "find_batch_rows", "eval.find_batch_rows")
    wrap(bt, "eval_none", "eval.eval_none(waits for the checks)")
    dev = torch.device("cuda")
    w = Workload()
    m, batches, grad = ready(w, dev)
    wall: dict[str, list[float]] = collections.defaultdict(list)
    sync = torch.cuda.synchronize
    for i in range(25):
        b = batches[i % 4]
        if i == 5:
            times.clear()
        sync()
        m.train()
        t0 = time.perf_counter()
        out = m(*b)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        torch.autograd.backward([out], [grad])
        t3 = time.perf_counter()
        sync()
        t4 = time.perf_counter()
        m.eval()
        with torch.no_grad():
            t5 = time.perf_counter()
            m(*b)
            t6 = time.perf_counter()
            sync()
            t7 = time.perf_counter()
        if i >= 5:
            wall["fwd host"].append(t1 - t0)
            wall["fwd total"].append(t2 - t0)
            wall["bwd host"].append(t3 - t2)
            wall["bwd total"].append(t4 - t2)
            wall["eval host"].append(t6 - t5)
            wall["eval total"].append(t7 - t5)
    for k, v in list(wall.items()) + sorted(times.items()):
        print(f"{k:28s} {statistics.median(v) * 1e3:8.3f} ms  (n={len(v)})")


if __name__ == "__main__":
    main()
