"""How much of the training forward's latency-bound work hides under its bandwidth-bound gather
when the two run on two streams at once, on the reference batch (Adam, NONE): the dedup
(``dedup_launch``), the lookup of its unique keys with and without touching their scores
(``ScoredHashTable.find``), and the gather of the occurrences' rows (``gather_table_rows``),
alone, one after the other, and side by side. Also the forward's chain on one stream (dedup,
touching lookup, gather) against the dedup and touching lookup on one stream beside eval's
one-pass find and read of every occurrence (``table_find_batch_rows``, which needs no dedup) on
another, the dedup's stream at the same or a higher priority. Each case is queued behind a GPU
sleep (so the host's launches are all in before the GPU starts) and timed between events, in
microseconds; medians of 20 after 5. Then the forward's gated lookup op (lean phase A, scores
touched, its one read-back) timed between events around it.

Usage: ``python forward_overlap.py`` (after ``source .device/setup.sh`` on the H200). A tidied
copy of the scratch script whose output is ``results/forward_overlap_h200.txt``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from demb_kernels.launched import dedup_launch, find_or_insert_gated
from demb_kernels.lookup import gather_table_rows
from demb_torchrec._launched import launched_find_or_insert
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload

Part = tuple[Callable[[], object], torch.cuda.Stream]


def timed(parts: list[Part], main_stream: torch.cuda.Stream) -> float:
    """Microseconds from a start event to the end of every part's work, each part queued on its
    stream behind a GPU sleep."""
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000)  # type: ignore[no-untyped-call]  # about 0.5 ms: launches first
    start.record(main_stream)
    ends = []
    for fn, stream in parts:
        stream.wait_stream(main_stream)
        with torch.cuda.stream(stream):
            fn()
        end = torch.cuda.Event()  # type: ignore[no-untyped-call]
        end.record(stream)
        ends.append(end)
    for end in ends:
        main_stream.wait_event(end)
    stop.record(main_stream)
    torch.cuda.synchronize()
    return float(start.elapsed_time(stop)) * 1e3


def print_cases(cases: dict[str, list[Part]], main_stream: torch.cuda.Stream, width: int) -> None:
    """Each case timed 25 times in turn with the others (:func:`timed`); prints the median, min
    and max of the last 20, names padded to ``width``."""
    results: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(25):
        for name, parts in cases.items():
            t = timed(parts, main_stream)
            if rep >= 5:
                results[name].append(t)
    for name, ts in results.items():
        spread = f"(min {min(ts):.1f}, max {max(ts):.1f})"
        print(f"{name:{width}s} {statistics.median(ts):8.1f} us  {spread}")


def main() -> None:
    dev = torch.device("cuda")
    m, batches, _ = ready(Workload(optimizer="adam", pooling="none"), dev, 2)
    m.train()
    idx, off = batches[0]
    num_tables = m.num_tables
    batch_size = (off.numel() - 1) // len(m.feature_table_map)
    got = None
    while got is None:  # None: the dedup's sort needed more key bits; they are known now
        got = launched_find_or_insert(m, idx, off, batch_size, None)
    batch, slots, _, _ = got
    torch.cuda.synchronize()
    key_bits, radix = m._key_bits
    print("N", idx.numel(), "U", batch.keys.numel(), "key_bits", key_bits, "radix", radix)
    print("score policies", m.tables.index.policy_list)
    main_stream = torch.cuda.current_stream()
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    high = torch.cuda.Stream(priority=-1)  # above the default priority (0)
    ftab, index = m._feature_tables, m.tables.index

    def dedup() -> None:
        dedup_launch(idx, off, m._feature_tables, num_tables, batch_size, None, key_bits, radix,
                     False)  # fmt: skip

    def lookup() -> None:
        m.tables.find(batch.keys, batch.tables, check=False)

    def touch() -> None:
        m.tables.find(batch.keys, batch.tables, update_scores=True, check=False)

    def gather() -> None:
        gather_table_rows(m.tables.values, slots, batch.tables, batch.inverse, m.dims[0],
                          check=False)  # fmt: skip

    def find_rows() -> None:  # eval's pass: each occurrence found and its row read
        torch.ops.demb.table_find_batch_rows(*index._tensors(), list(m.tables.values), idx, off,
                                             ftab, batch_size, m.dims[0], False)  # fmt: skip

    def dedup_lookup() -> None:
        dedup()
        lookup()

    def dedup_touch() -> None:
        dedup()
        touch()

    def chain() -> None:  # the training forward's GPU work, in its order
        dedup()
        touch()
        gather()

    def dedup_gather() -> None:
        dedup()
        gather()

    cases: dict[str, list[Part]] = {
        "gather alone": [(gather, s2)],
        "dedup alone": [(dedup, s1)],
        "lookup alone": [(lookup, s1)],
        "dedup+lookup alone": [(dedup_lookup, s1)],
        "dedup || gather": [(dedup, s1), (gather, s2)],
        "lookup || gather": [(lookup, s1), (gather, s2)],
        "dedup+lookup || gather": [(dedup_lookup, s1), (gather, s2)],
        "dedup then gather, one stream": [(dedup_gather, s1)],
        "lookup touching scores alone": [(touch, s1)],
        "lookup touching || gather": [(touch, s1), (gather, s2)],
        "dedup, touch, gather, one stream": [(chain, s1)],
        "dedup+touch alone": [(dedup_touch, s1)],
        "find_rows alone": [(find_rows, s2)],
        "find_rows || dedup+touch": [(find_rows, s2), (dedup_touch, s1)],
        "find_rows || dedup+touch (high)": [(find_rows, s2), (dedup_touch, high)],
    }
    print_cases(cases, main_stream, 32)

    gated = []
    for rep in range(25):
        with torch.cuda.stream(s1):
            launched = dedup_launch(idx, off, m._feature_tables, num_tables, batch_size, None,
                                    key_bits, radix, False)  # fmt: skip
            args = m.tables.next_score_args()
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        with torch.cuda.stream(s1):
            start.record(s1)
            find_or_insert_gated(m.tables.index, launched.keys, launched.tables, args, None,
                                 launched.info)  # fmt: skip
            stop.record(s1)
        torch.cuda.synchronize()
        if rep >= 5:
            gated.append(float(start.elapsed_time(stop)) * 1e3)
    print(f"{'gated op (with its read-back)':32s} {statistics.median(gated):8.1f} us  "
          f"(min {min(gated):.1f}, max {max(gated):.1f})")  # fmt: skip


if __name__ == "__main__":
    main()
