"""Two host-side designs of the CUDA training forward, measured in one process against the
module as it is (ninth session; neither was kept): rounds of 20 steps after 5 per variant on the
reference workload (Adam, NONE), the variants alternating, then the median over rounds of each
round's median (and the range), so that the host's drift between processes does not decide.

- ``graph``: the launched dedup (``demb::dedup_launch``, 14 launches) replayed from a CUDA graph
  per batch shape (captured at the third call of a shape): the batch copied into the graph's
  inputs, ``order`` and ``starts`` cloned out (the backward keeps them past the next replay).
  Alone it took 83 us of host time a call against 150 us.
- ``noplan``: no segment plan made in the forward (the backward plans its sums itself); since
  the window sums (tenth session) rows of at most 128 floats need none: the same as ``eager``.

Usage: ``python host_toggles_ab.py eager,graph,noplan [rounds]`` (after ``source
.device/setup.sh`` on the H200). Results: ``results/host_toggles_ab_h200.txt``.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

import demb_torchrec._autograd as ag
import demb_torchrec._launched as la
import torch
from demb_kernels.launched import LaunchedDedup, dedup_launch
from demb_kernels.lookup import segment_plan
from demb_torchrec.bench.module_bench import _demb_step, ready
from demb_torchrec.bench.workload import Workload

# The module's own names, as the module looks them up (use() swaps them).
_eager_dedup = dedup_launch
_eager_plan = segment_plan
_graphs: dict[tuple[Any, ...], dict[str, Any]] = {}


def graphed_dedup(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    num_tables: int,
    batch_size: int,
    counters: torch.Tensor | None = None,
    key_bits: int = 64,
    key_radix: int = 0,
) -> LaunchedDedup:
    """``dedup_launch`` replayed from a CUDA graph of this batch shape (eager for its first two
    calls)."""

    def eager(i: torch.Tensor, o: torch.Tensor, c: torch.Tensor | None) -> LaunchedDedup:
        return _eager_dedup(i, o, feature_tables, num_tables, batch_size, c, key_bits, key_radix)

    shape = (indices.numel(), offsets.numel(), counters is None, num_tables, batch_size)
    key = (*shape, key_bits, key_radix)
    entry = _graphs.setdefault(key, {"seen": 0})
    entry["seen"] += 1
    if entry["seen"] < 3:
        return eager(indices, offsets, counters)
    if "graph" not in entry:
        inputs = (indices.clone(), offsets.clone(), None if counters is None else counters.clone())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            out = eager(*inputs)
        entry.update(graph=graph, inputs=inputs, out=out)
    static_indices, static_offsets, static_counters = entry["inputs"]
    static_indices.copy_(indices)
    static_offsets.copy_(offsets)
    if counters is not None:
        static_counters.copy_(counters)
    entry["graph"].replay()
    out = entry["out"]
    result: LaunchedDedup = out._replace(order=out.order.clone(), starts=out.starts.clone())
    return result


def no_plan(starts: torch.Tensor, n: int) -> None:
    """No segment plan made in the forward: the backward plans its sums itself."""


def use(variant: str) -> None:
    """Swap the names the module calls (its modules' globals) for ``variant``'s."""
    setattr(la, "dedup_launch", graphed_dedup if variant == "graph" else _eager_dedup)  # noqa: B010
    setattr(ag, "segment_plan", no_plan if variant == "noplan" else _eager_plan)  # noqa: B010


def main() -> None:
    variants = sys.argv[1].split(",")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    module, batches, grad = ready(Workload(), torch.device("cuda"))
    phases = ("forward", "backward", "train", "eval")
    res: dict[str, dict[str, list[float]]] = {v: {p: [] for p in phases} for v in variants}
    for r in range(rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            use(v)
            times: dict[str, list[float]] = {p: [] for p in phases}
            for i in range(25):
                f, b, e = _demb_step(module, batches[i % len(batches)], grad)
                if i >= 5:
                    for p, t in zip(phases, (f, b, f + b, e), strict=True):
                        times[p].append(t)
            for p in phases:
                res[v][p].append(statistics.median(times[p]) * 1e3)
    use("eager")
    for v in variants:
        cells = "  ".join(
            f"{p} {statistics.median(res[v][p]):.3f} [{min(res[v][p]):.3f}-{max(res[v][p]):.3f}]"
            for p in phases
        )
        print(f"{v:8s} {cells}")


if __name__ == "__main__":
    main()
