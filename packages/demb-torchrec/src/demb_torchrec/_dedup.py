"""A batch's keys deduplicated per table: what the table module looks up once per step."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["DedupedBatch", "dedup"]


class DedupedBatch(NamedTuple):
    """The unique (table, key) pairs of a batch, grouped by table."""

    keys: torch.Tensor
    """``(U,)`` int64 unique keys, sorted by table, then key."""
    tables: torch.Tensor
    """``(U,)`` int64 table of each unique key."""
    inverse: torch.Tensor
    """``(N,)`` int64 position in ``keys`` of each index."""
    counts: torch.Tensor
    """``(U,)`` int64 occurrences of each unique key (or its summed frequency counters)."""
    table_bounds: list[int]
    """``T + 1`` host offsets: table ``t``'s unique keys are ``keys[b[t]:b[t+1]]``."""
    feature_bounds: list[int]
    """``F + 1`` host offsets: feature ``f``'s indices are ``indices[b[f]:b[f+1]]``."""
    order: torch.Tensor
    """``(N,)`` int64 the indices' positions sorted by (table, key): unique key ``u``'s
    occurrences are ``order[starts[u]:starts[u+1]]``."""
    starts: torch.Tensor
    """``(U,)`` int64 where each unique key's occurrences start in ``order``."""


def dedup(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    num_tables: int,
    batch_size: int,
    frequency_counters: torch.Tensor | None = None,
) -> DedupedBatch:
    """Deduplicate a TBE-layout batch per table, with one host sync.

    Args:
        indices: ``(N,)`` int64 keys, feature-major (feature ``f``'s bags come before
            ``f + 1``'s).
        offsets: ``(F * B + 1,)`` int64 bag offsets into ``indices``.
        feature_tables: ``(F,)`` int64 table of each feature.
        num_tables: ``T``.
        batch_size: ``B`` (>= 1).
        frequency_counters: ``(N,)`` int64 per-index counts summed into ``counts`` (default 1).
    """
    n = indices.numel()
    device = indices.device
    positions = torch.arange(n, device=device)
    bags = offsets.numel() - 1
    bag_of = (torch.searchsorted(offsets, positions, right=True) - 1).clamp(0, bags - 1)
    tables = feature_tables[bag_of // batch_size]
    order = torch.argsort(indices, stable=True)
    order = order[torch.argsort(tables[order].to(torch.int32), stable=True)]
    sorted_keys, sorted_tables = indices[order], tables[order]
    first = torch.ones(n, dtype=torch.bool, device=device)
    first[1:] = (sorted_keys[1:] != sorted_keys[:-1]) | (sorted_tables[1:] != sorted_tables[:-1])
    rank = torch.cumsum(first, 0) - 1
    inverse = torch.empty_like(rank)
    inverse[order] = rank
    # Unique keys up to the end of each table (no atomics: the pairs are sorted by table).
    ends = torch.searchsorted(
        sorted_tables,
        torch.arange(num_tables, device=device, dtype=sorted_tables.dtype),
        right=True,
    )
    through = torch.where(ends > 0, rank[(ends - 1).clamp_min(0)] + 1, 0)
    weights = None if frequency_counters is None else frequency_counters.to(torch.int64)
    negative = (weights < 0).sum() if weights is not None else torch.zeros((), device=device)
    flags = torch.stack(
        [(offsets[1:] < offsets[:-1]).sum(), (indices == -1).sum(), negative.to(torch.int64)]
    )
    host = torch.cat([through, flags, offsets[::batch_size]]).tolist()  # the one sync
    bounds, feature_bounds = host[:num_tables], host[num_tables + 3 :]
    if host[num_tables + 1]:
        raise ValueError("indices: contains -1, the empty-key sentinel, which is never a key")
    if host[num_tables + 2]:
        raise ValueError("frequency_counters: contains a negative count")
    if host[num_tables] or feature_bounds[0] != 0 or feature_bounds[-1] != n:
        raise ValueError(
            f"offsets: must start at 0, never decrease and end at {n} (the number of indices); "
            f"got {feature_bounds[0]} ... {feature_bounds[-1]} with {host[num_tables]} decreases"
        )
    table_bounds = [0]
    for end in bounds:  # a table without keys ends where the previous one did
        table_bounds.append(max(end, table_bounds[-1]))
    unique = table_bounds[-1]
    at = torch.nonzero_static(first, size=unique).squeeze(1)
    # Occurrences (or summed counters) per unique key: segment sums over the sorted order.
    segment_end = torch.cat([at[1:], torch.full((1,), n, device=device, dtype=at.dtype)])
    if weights is None:
        counts = segment_end - at
    else:
        summed = torch.cumsum(weights[order], 0)
        counts = summed[segment_end - 1] - summed[at] + weights[order[at]]
    return DedupedBatch(
        sorted_keys[at],
        sorted_tables[at],
        inverse,
        counts,
        table_bounds,
        feature_bounds,
        order,
        at,
    )
