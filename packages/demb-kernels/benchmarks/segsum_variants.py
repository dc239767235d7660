"""Variants of segment_sum_rows' CUDA chunk-sum kernel on the reference workload's batch (the
experiment behind ``kSumChunks`` and the kernel's launch bounds in
``csrc/cuda/lookup_kernels.cuh``; that packed kernel was replaced by the window sums of
``csrc/cuda/window_sums.cuh`` in the tenth session: these copies are the record).

Each variant (``segsum_variants.cu``) is a copy of ``segment_chunk_sums_packed_kernel`` with
``G`` chunks per warp and at least ``MINB`` blocks per SM (``staged``: a step's ``G`` row loads
issued before its adds), compiled with ``torch.utils.cpp_extension.load_inline``, fed the plan of
a real dedup of the batch, timed with CUDA events (median of 30) and checked equal to variant
0's sums. Prints one line per variant beside a device copy of the gradients. CUDA only (the
H200, after ``source .device/setup.sh``); its output is in ``results/segsum_variants_h200.log``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from demb_kernels.lookup import dedup_batch, segment_plan, segment_sum_rows
from demb_torchrec.bench.workload import Workload, make_batches
from torch.utils.cpp_extension import load_inline

VARIANTS = 8


def timeit(fn: Callable[[], object], reps: int = 30) -> float:
    """Median microseconds of ``fn`` between two CUDA events."""
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def main() -> None:
    decl = (
        "void variant(int64_t v, at::Tensor grads, at::Tensor order, at::Tensor plan, "
        "int64_t unique, at::Tensor partial, at::Tensor out, at::Tensor bad);"
    )
    source = (Path(__file__).parent / "segsum_variants.cu").read_text()
    mod = load_inline(
        "segsum_variants",
        cpp_sources=decl,
        cuda_sources=source,
        functions=["variant"],
        extra_cuda_cflags=["-O3", "-arch=sm_90"],
    )
    dev = torch.device("cuda")
    w = Workload()
    indices, offsets = make_batches(w, 1, dev)[0]
    ft = torch.arange(w.tables, device=dev)
    batch = dedup_batch(indices, offsets, ft, w.tables, w.samples, None, 64)
    order, starts = batch.order, batch.starts
    n, u = indices.numel(), starts.numel()
    grads = torch.randn(n, 128, device=dev)
    plan = segment_plan(starts, n)
    m = u + n // 32 + 1
    print(f"N={n} U={u} chunks={int(plan[u])} max_chunks={m}")
    whole = timeit(lambda: segment_sum_rows(grads, order, starts, plan=plan))
    print(f"demb segment_sum_rows (sums+finish): {whole:.1f} us")
    sums: dict[int, torch.Tensor] = {}
    for v in [*range(VARIANTS), 0, 2, 1]:
        partial = torch.empty(m, 128, device=dev)
        rows = torch.full((u, 128), float("nan"), device=dev)
        bad = torch.zeros((), dtype=torch.bool, device=dev)

        def launch(
            v: int = v, p: torch.Tensor = partial, r: torch.Tensor = rows, f: torch.Tensor = bad
        ) -> None:
            mod.variant(v, grads, order, plan, u, p, r, f)

        t = timeit(launch)
        sums[v] = torch.nan_to_num(rows)
        print(f"variant {v}: {t:.1f} us  same as v0: {torch.equal(sums[v], sums[0])}")
    copy = torch.empty_like(grads)
    mb = 2 * grads.numel() * 4 / 1e6
    print(f"copy of grads (read+write {mb:.0f} MB): {timeit(lambda: copy.copy_(grads)):.1f} us")
    again = timeit(lambda: segment_sum_rows(grads, order, starts, plan=plan))
    print(f"demb segment_sum_rows again: {again:.1f} us")
    unplanned = timeit(lambda: segment_sum_rows(grads, order, starts))
    print(f"demb segment_sum_rows without plan: {unplanned:.1f} us")


if __name__ == "__main__":
    main()
