"""The rows of a deduplicated batch's unique keys, per table, for the forwards that pool or
train from them (tables of several dims, gradient clipping, eval fills): gathered from the
tables, missing keys read as zeros or, in eval, from ``eval_initializer_args``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from demb_kernels.lookup import gather_table_rows
from demb_storage import InitializerArgs, InitializerMode, initialize_rows

from demb_torchrec._dedup import DedupedBatch

if TYPE_CHECKING:
    from demb_torchrec.batched_tables import DynamicEmbeddingTables

__all__ = ["is_zero", "unique_rows"]


def is_zero(args: InitializerArgs) -> bool:
    """Whether ``args`` initializes rows to zeros (CONSTANT 0)."""
    return args.mode is InitializerMode.CONSTANT and args.value == 0.0


def unique_rows(
    m: DynamicEmbeddingTables,
    batch: DedupedBatch,
    slots: torch.Tensor,
    missing_counts: list[int] | None,
    missing_from_eval: bool,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Per table, ``(U_t, D_t)`` float32 rows of its unique keys (missing keys: zeros, or
    ``eval_initializer_args`` with ``missing_from_eval``); when all tables have one dim they
    are views of one ``(U, D)`` tensor, returned too.

    Args:
        m: the module; batch: its deduplicated batch.
        slots: ``(U,)`` int64 slot of each unique key (-1: missing).
        missing_counts: per table, the keys without a slot, or None when not counted (any table
            may have some).
        missing_from_eval: fill missing keys from ``eval_initializer_args``.
    """
    b = batch.table_bounds
    whole: torch.Tensor | None = None
    if m._fused_gather:  # one dim: every unique key's row in one launch
        whole = gather_table_rows(
            m.tables.values, slots, batch.tables, None, m.dims[0], check=False
        )
    elif len(set(m.dims)) == 1:
        whole = torch.empty(b[-1], m.dims[0], device=m.device, dtype=torch.float32)
    rows = []
    for t in range(m.num_tables):
        s = slots[b[t] : b[t + 1]]
        some_missing = missing_counts is None or missing_counts[t] > 0
        if whole is not None and m._fused_gather:
            r = whole[b[t] : b[t + 1]]
            if some_missing and missing_from_eval and not is_zero(m.eval_args[t]):
                _fill_missing(m, batch, t, s, r)
            rows.append(r)
            continue
        values = m.tables.values[t][:, : m.dims[t]]
        missing = s < 0
        at = s.clamp_min(0) if some_missing else s
        if whole is not None and values.dtype == torch.float32:
            r = torch.index_select(values, 0, at, out=whole[b[t] : b[t + 1]])
        else:
            r = values.index_select(0, at).float()
            if whole is not None:
                whole[b[t] : b[t + 1]] = r
                r = whole[b[t] : b[t + 1]]
        if not some_missing:
            rows.append(r)
            continue
        r.masked_fill_(missing[:, None], 0.0)
        if missing_from_eval and not is_zero(m.eval_args[t]):
            _fill_missing(m, batch, t, s, r)
        rows.append(r)
    return rows, whole


def _fill_missing(
    m: DynamicEmbeddingTables,
    batch: DedupedBatch,
    t: int,
    slots: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """Rows of table ``t``'s missing keys (slot -1) from ``eval_initializer_args``."""
    b = batch.table_bounds
    missing = slots < 0
    fill = torch.zeros(slots.numel(), m.dims[t], device=m.device)
    where = torch.where(missing, torch.arange(slots.numel(), device=m.device), -1)
    keys = batch.keys[b[t] : b[t + 1]]
    initialize_rows(fill, where, keys, m.dims[t], m.eval_args[t], m.seeds[t], check=False)
    rows.copy_(torch.where(missing[:, None], fill, rows))
