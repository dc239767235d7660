"""Does CUDA's ``embedding_bag`` read a strided view of a table's rows in place? The pooled
forwards read ``values[:, :dim]`` of ``(capacity, dim + state)`` buffers. Times SUM bags over
the view against a contiguous copy of the same rows (Adam's width 384, dim 128, the SUM
workload's size per table) and checks the outputs are equal.

Usage: ``python embedding_bag_strided.py`` (after ``source .device/setup.sh`` on the H200).
H200, 2026-11-29: strided view 0.304 ms, contiguous 0.304 ms, equal True.
"""

from __future__ import annotations

import torch
from torch.nn import functional


def timed(weight: torch.Tensor, idx: torch.Tensor, off: torch.Tensor) -> tuple[float, torch.Tensor]:
    for _ in range(3):
        functional.embedding_bag(idx, weight, off, mode="sum", include_last_offset=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        out = functional.embedding_bag(idx, weight, off, mode="sum", include_last_offset=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20, out


def main() -> None:
    torch.manual_seed(0)
    rows, width, dim, n, bags = 1_677_721, 384, 128, 576_755, 104_857
    buf = torch.randn(rows, width, device="cuda")
    view = buf[:, :dim]
    idx = torch.randint(0, rows, (n,), device="cuda")
    cuts = torch.sort(torch.randint(0, n, (bags - 1,), device="cuda")).values
    zero, total = torch.zeros(1, dtype=torch.long, device="cuda"), torch.tensor([n], device="cuda")
    off = torch.cat([zero, cuts, total])
    a, out_a = timed(view, idx, off)
    b, out_b = timed(view.contiguous(), idx, off)
    print(f"strided view {a:.3f} ms, contiguous {b:.3f} ms, equal {torch.equal(out_a, out_b)}")


if __name__ == "__main__":
    main()
