"""Batches for the tests of the one-sync CUDA forward (test_module_launched.py,
test_admission_launched.py): feature-major bags of three features, one batch whose keys span
41 bits (the dedup's key-bits guess, learnt from the batches before, is then too small and the
one-sync path falls back), then narrow keys, and the last batch again (every key found)."""

from __future__ import annotations

import torch


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
