"""Counting a batch's entries per table on its device without waiting on it (no ``bincount``,
which reads its input's maximum back to the host on CUDA) and without atomics on a few
addresses (``index_add_`` of a large batch into ``T`` counters serializes on CUDA)."""

from __future__ import annotations

import torch

__all__ = ["ONE_HOT_TABLES", "per_table_counts"]

ONE_HOT_TABLES = 64
"""Up to this many tables, entries are counted by a reduction over an ``(N, T)`` mask;
beyond, by ``index_add_``."""


def per_table_counts(
    table_ids: torch.Tensor, num_tables: int, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """``(T,)`` int64 on ``table_ids``' device: how many entries of each table (where ``mask``
    is set, when given). No sync.

    Args:
        table_ids: ``(N,)`` int64 table of each entry, in ``[0, T)`` (not checked: a check
            would wait on the device; up to ``ONE_HOT_TABLES`` tables an id outside is not
            counted, beyond it ``index_add_`` raises).
        num_tables: ``T``.
        mask: ``(N,)`` bool, or None for every entry.
    """
    if num_tables <= ONE_HOT_TABLES:
        tables = torch.arange(num_tables, device=table_ids.device)
        hot = table_ids[:, None] == tables
        if mask is not None:
            hot &= mask.to(hot.device)[:, None]
        return hot.sum(0)
    ones = torch.ones_like(table_ids) if mask is None else mask.to(table_ids.device, torch.int64)
    zeros = torch.zeros(num_tables, dtype=torch.int64, device=table_ids.device)
    return zeros.index_add_(0, table_ids, ones)
