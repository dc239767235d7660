"""Whether the training forward could find and gather every occurrence's row in one fused pass
(the eval's ``find_batch_rows``, no checks) beside its dedup and score-touching lookup of the
unique keys on a second stream, instead of dedup, lookup and gather one after another: the
forward's GPU chain would become the longer of the two if they overlapped. On the reference
batch (Adam, NONE), each case queued behind a GPU sleep (every launch is in before the GPU
starts) and timed between events, in microseconds; medians of 20 after 5. The streams run at
the same priority, or one of them at a higher one (lower number), whose pending blocks the GPU
schedules first as the other's retire.

Usage: ``python forward_find_overlap.py`` (after ``source .device/setup.sh`` on the H200; it
takes its timing from ``forward_overlap.py`` beside it). A tidied copy of the scratch script
whose output is ``results/forward_find_overlap_h200.txt``.
"""

from __future__ import annotations

import torch
from demb_kernels.launched import dedup_launch
from demb_kernels.lookup import gather_table_rows
from demb_kernels.table import lookup_batch_rows
from demb_torchrec._launched import launched_find_or_insert
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload
from forward_overlap import Part, print_cases


def main() -> None:
    dev = torch.device("cuda")
    m, batches, _ = ready(Workload(optimizer="adam", pooling="none"), dev, 2)
    m.train()
    idx, off = batches[0]
    num_tables, dim, ftab = m.num_tables, m.dims[0], m._feature_tables
    batch_size = (off.numel() - 1) // len(m.feature_table_map)
    got = None
    while got is None:  # None: the dedup's sort needed more key bits; they are known now
        got = launched_find_or_insert(m, idx, off, batch_size, None)
    batch, slots, _, _ = got
    torch.cuda.synchronize()
    key_bits, radix = m._key_bits
    main_stream = torch.cuda.current_stream()
    low1 = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    low2 = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    high = torch.cuda.Stream(priority=-1)  # type: ignore[no-untyped-call]
    low = torch.cuda.Stream(priority=0)  # type: ignore[no-untyped-call]
    print("N", idx.numel(), "U", batch.keys.numel(), "priorities: high", high.priority,
          "low", low.priority)  # fmt: skip

    def dedup_touch() -> None:
        dedup_launch(idx, off, ftab, num_tables, batch_size, None, key_bits, radix, False)
        m.tables.find(batch.keys, batch.tables, update_scores=True, check=False)

    def gather() -> None:
        gather_table_rows(m.tables.values, slots, batch.tables, batch.inverse, dim, check=False)

    def find_rows() -> None:
        lookup_batch_rows(m.tables.index, m.tables.values, idx, off, ftab, batch_size, dim,
                          check=False)  # fmt: skip

    def in_order() -> None:
        dedup_touch()
        gather()

    cases: dict[str, list[Part]] = {
        "dedup, touching lookup, gather (one stream)": [(in_order, low1)],
        "dedup + touching lookup alone": [(dedup_touch, low1)],
        "gather alone": [(gather, low1)],
        "fused find + gather alone": [(find_rows, low1)],
        "dedup+lookup || find+gather, same priority": [(dedup_touch, low1), (find_rows, low2)],
        "find+gather || dedup+lookup, same priority": [(find_rows, low2), (dedup_touch, low1)],
        "dedup+lookup high || find+gather low": [(dedup_touch, high), (find_rows, low)],
        "find+gather low || dedup+lookup high": [(find_rows, low), (dedup_touch, high)],
        "find+gather high || dedup+lookup low": [(find_rows, high), (dedup_touch, low)],
    }
    print_cases(cases, main_stream, 46)
    gathered = gather_table_rows(m.tables.values, slots, batch.tables, batch.inverse, dim)
    found, found_slots = lookup_batch_rows(
        m.tables.index, m.tables.values, idx, off, ftab, batch_size, dim
    )
    print("fused rows equal the gather's:", torch.equal(gathered, found),
          "missing:", int((found_slots < 0).sum()))  # fmt: skip


if __name__ == "__main__":
    main()
