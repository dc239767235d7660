"""Fixed host costs on the H200's host: the table module's paths on a batch of one key per
feature (the scaled-down reference workload's module: 10 tables, D=128, Adam, NONE), the ops
they call, and a few torch calls for scale; microseconds per call (median of 5 rounds).

Usage: ``python fixed_costs.py`` (after ``source .device/setup.sh`` on the H200).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from demb_kernels import table as ops
from demb_torchrec._args import check_batch_args, check_weight_args
from demb_torchrec._direct import eval_none
from demb_torchrec.bench.module_bench import build
from demb_torchrec.bench.workload import Workload


def per_call(f: Callable[[], object], n: int = 400, sync_every: int = 50) -> float:
    """Microseconds per call of ``f``, synchronizing the device every ``sync_every`` calls."""
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for i in range(n):
            f()
            if (i + 1) % sync_every == 0:
                torch.cuda.synchronize()
        rounds.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(rounds)


def main() -> None:
    dev = torch.device("cuda")
    m = build(Workload().scaled(0.01), dev)
    features = len(m.feature_table_map)
    ind = torch.arange(features, device=dev) + 1
    off = torch.arange(features + 1, device=dev)
    grad = torch.ones(features, m.dims[0], device=dev)

    def step() -> None:
        out = m(ind, off)
        out.backward(grad)

    def step_on_caller() -> None:
        out = m(ind, off)
        with torch.autograd.set_multithreading_enabled(False):
            out.backward(grad)

    m.train()
    for _ in range(3):
        step()
    res: dict[str, float] = {}
    res["train forward"] = per_call(lambda: m(ind, off), n=200, sync_every=1)
    res["train forward + backward"] = per_call(step, n=200, sync_every=1)
    res["train forward + backward, calling thread"] = per_call(step_on_caller, 200, 1)
    m.eval()
    with torch.no_grad():
        res["eval forward"] = per_call(lambda: m(ind, off))
        res["check_batch_args"] = per_call(
            lambda: check_batch_args(ind, off, m.device, None, features), 4000, 4000
        )
        res["check_weight_args"] = per_call(
            lambda: check_weight_args(ind, None, None, m.pooling_mode), 4000, 4000
        )
        res["eval_none"] = per_call(lambda: eval_none(m, ind, off, 1))
        ftab, values = m._feature_tables, m.tables.values
        res["lookup_batch_rows, check=False"] = per_call(
            lambda: ops.lookup_batch_rows(
                m.tables.index, values, ind, off, ftab, 1, m.dims[0], check=False
            )
        )
        like = torch.zeros(1, dtype=torch.int64, device=dev)
        res["torch.ops.demb.table_timestamp"] = per_call(
            lambda: torch.ops.demb.table_timestamp(like, 1)
        )
        res["torch.empty(1)"] = per_call(lambda: torch.empty(1, device=dev))
        res["torch.zeros(1)"] = per_call(lambda: torch.zeros(1, device=dev))
        res["torch.cuda.Event() + record"] = per_call(
            lambda: torch.cuda.Event().record()  # type: ignore[no-untyped-call]
        )
    for k, v in res.items():
        print(f"{k:45s} {v:8.1f} us")


if __name__ == "__main__":
    main()
