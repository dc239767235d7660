"""Where a step of the reference workload spends its time: torch.profiler over training and eval
steps of ``demb bench module``'s workload; prints the top ops by device time and by host time.

Usage: ``python profile_module.py [--scale 1.0] [--optimizer adam] [--pooling none]
[--trace trace.json]`` (``--trace`` also writes a Chrome trace: the phases are the ranges
``train_forward``, ``train_backward`` and ``eval_forward``).
"""

from __future__ import annotations

import argparse

import torch
from demb_torchrec.bench.module_bench import build, prefill
from demb_torchrec.bench.workload import Workload, make_batches
from torch.profiler import ProfilerActivity, profile, record_function


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--optimizer", default="adam")
    parser.add_argument("--pooling", default="none")
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--trace", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    w = Workload(optimizer=args.optimizer, pooling=args.pooling).scaled(args.scale)
    module = build(w, device)
    prefill(module, w)
    batches = make_batches(w, 2, device)
    with torch.no_grad():
        grad = torch.randn_like(module(*batches[0])) * 1e-3

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
    with profile(activities=activities) as prof:
        for i in range(2):
            step(i)
        sync()
    if args.trace:
        prof.export_chrome_trace(args.trace)
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
