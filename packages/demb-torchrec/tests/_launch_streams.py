"""Shared by the tests of the one-sync CUDA forward and the prefetch that waits on nothing
(test_module_launched.py, test_admission_launched*.py, test_cache_prefetch.py): their batches
(feature-major bags of three features, one batch whose keys span 41 bits, so that the dedup's
key-bits guess, learnt from the batches before, is too small and the one-sync path falls back,
then narrow keys, and the last batch again: every key found), their module, and a CPU
stand-in for the launched dedup."""

from __future__ import annotations

from typing import Any

import torch
from demb_kernels.launched import LaunchedDedup
from demb_kernels.lookup import dedup_batch


def launch_batches(
    gen: torch.Generator,
    *,
    steps: int = 7,
    wide: int = 3,
    narrow_from: int = 5,
    key_range: int = 900,
    batch_size: int = 24,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps + 1`` ``(indices, offsets)`` CPU batches: keys below ``key_range``, below
    ``2**41`` at step ``wide``, below 40 from step ``narrow_from``; the last batch twice."""
    out = []
    for step in range(steps):
        lengths = torch.randint(0, 4, (3 * batch_size,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        bound = 2**41 if step == wide else (40 if step >= narrow_from else key_range)
        indices = torch.randint(0, bound, (int(offsets[-1]),), generator=gen)
        out.append((indices, offsets))
    out.append(out[-1])
    return out


def launch_module(mode: object, seed: int = 3, **options: object) -> object:
    """Two CUDA tables of 256 slots that cannot grow (dim 8, buckets of 128, Adam) read by
    three features, the second table by two; ``options``: more table options."""
    from demb_torchrec import DynamicEmbeddingTables, DynamicEmbTableOptions

    torch.manual_seed(seed)
    opts = DynamicEmbTableOptions(dim=8, max_capacity=256, bucket_capacity=128, **options)
    return DynamicEmbeddingTables(
        [opts, opts],
        feature_table_map=[0, 1, 1],
        pooling_mode=mode,
        device="cuda",
        optimizer="adam",
        learning_rate=0.05,
        seed=seed,
    )


JUNK = 2**40 + 7  # what the stand-in dedup leaves past the unique keys
CHECK_WORDS = 6  # the dedup's batch-check words in its info (T + 6 + F + 1 + 6 words)


def fake_dedup_launch(
    indices, offsets, feature_tables, num_tables, batch_size, counters, key_bits, key_radix,
    counts, clock_words=0,
):  # fmt: skip
    """A CPU stand-in for ``demb_kernels.launched.dedup_launch`` (CUDA only): ``dedup_batch``'s
    outputs padded to the batch's size with junk past the unique keys, the info words a
    launched dedup leaves (no check failed), its go flag cleared when the keys span more bits
    than ``key_bits`` (the CUDA sort then looked at too few)."""
    out = dedup_batch(indices, offsets, feature_tables, num_tables, batch_size, counters, 64)
    n, u = int(indices.numel()), int(out.keys.numel())
    bounds = out.bounds.tolist()
    go = int(out.key_bits <= key_bits)

    def padded(x, fill):
        return torch.cat([x, torch.full((n - x.numel(),), fill, dtype=x.dtype)])

    words = (
        bounds[1 : num_tables + 1]
        + [0] * CHECK_WORDS
        + bounds[num_tables + 1 :]
        + [(1 << out.key_bits) - 1, 0, 0, u, go, 0]
    )
    return LaunchedDedup(
        padded(out.keys, JUNK),
        padded(out.tables, num_tables + 5),
        out.inverse,
        padded(out.counts, 99) if counts else torch.zeros(0, dtype=torch.int64),
        out.order,
        padded(out.starts, 0),
        torch.tensor(words, dtype=torch.int64),
        torch.zeros((), dtype=torch.bool),
        torch.zeros(clock_words, dtype=torch.int64),
    )


def admission_strategy(kind: str) -> object:
    """Frequency admission (threshold 2, a counter of 64 slots in buckets of 16: it evicts)
    or probabilistic (0.4)."""
    from demb_torchrec import (
        FrequencyAdmissionStrategy,
        KVCounter,
        ProbabilisticAdmissionStrategy,
    )

    if kind == "frequency":  # buckets of 16 in 64 slots: the counter evicts
        return FrequencyAdmissionStrategy(2, KVCounter(64, bucket_capacity=16))
    return ProbabilisticAdmissionStrategy(0.4)


def admission_state(m: Any) -> list[torch.Tensor]:
    """Every table's keys, scores and rows, every counter's keys and counts (sorted by key),
    the toss indices and the admission counts since the last read."""
    out = []
    for t in range(m.num_tables):
        ex = m.tables.export(t)
        order = torch.argsort(ex.keys)
        out += [ex.keys[order], ex.scores[order], ex.values[order]]
    for tables, counter in m.admission.counters:
        for local in range(len(tables)):
            keys, counts = counter.export(local)
            order = torch.argsort(keys)
            out += [keys[order].cpu(), counts[order].cpu()]
    calls = [getattr(g.admitter, "calls", -1) for g in m.admission.groups]
    out.append(torch.tensor(calls))
    counts = m.admission.read_counts(reset=False)
    out += [counts["admitted"], counts["rejected"], counts["counter_evictions"]]
    return out
