"""Per-kernel CUDA time of lookup and find_or_insert on a 128M-slot table at load factor 0.5
(torch.profiler), to see where a batch's time goes. Usage: ``python profile_table.py``."""

from __future__ import annotations

import torch
from bench_table import Keys, fill
from demb_kernels import table as ops
from demb_kernels.table import ScorePolicy, TableIndex
from torch.profiler import ProfilerActivity, profile


def main() -> None:
    device = torch.device("cuda")
    batch, capacity = 1 << 20, 1 << 27
    keys = Keys(device)
    index = TableIndex.create([capacity], [128], [ScorePolicy.TIMESTAMP], device)
    hits = fill(index, keys, 0.5, batch)
    tids = torch.zeros(batch, dtype=torch.int64, device=device)
    now = torch.tensor([2], device=device)
    news = [torch.cat([hits[: batch // 2], keys.take(batch // 2)]) for _ in range(10)]
    for _ in range(3):
        ops.lookup(index, hits, tids, check=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for k in news:
            ops.lookup(index, hits, tids, check=False)
            ops.find_or_insert(index, k, tids, now, check=False)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
