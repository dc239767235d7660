"""What :class:`demb_storage.ScoredHashTable`'s batch operations return."""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["EvictedRows", "InsertOutcome", "TableExport"]


class EvictedRows(NamedTuple):
    """Keys a batch evicted, each reported once, with what they held."""

    keys: torch.Tensor
    """``(m,)`` int64."""
    table_ids: torch.Tensor
    """``(m,)`` int64."""
    scores: torch.Tensor
    """``(m, W)`` int64 index score words ``[word 0, word 1]``."""
    slots: torch.Tensor
    """``(m,)`` int64 the freed slots (now holding the keys that evicted them)."""
    values: list[torch.Tensor]
    """Per table, ``(m_t, width_t)`` the evicted rows, in the order of this table's entries."""


class InsertOutcome(NamedTuple):
    """Result of :meth:`ScoredHashTable.find_or_insert`."""

    slots: torch.Tensor
    """``(N,)`` int64 table-local slot of each key, -1 if it could not be inserted."""
    status: torch.Tensor
    """``(N,)`` int64 :class:`demb_kernels.table.InsertStatus`."""
    evicted: EvictedRows | None
    """The evictions, when asked for (``return_evicted=True``)."""
    all_hit: bool = False
    """True when every key was found (every status HIT): no row is new and none failed. False
    when some key was not, or when that is not known (a CUDA graph capture; insert_or_assign)."""
    rows: torch.Tensor | None = None
    """``(N_occ, dim)`` float32 rows of the batch's occurrences, when asked for (``gather_rows``)
    and every key was found; else None."""


class TableExport(NamedTuple):
    """Occupied slots of one table (see :meth:`ScoredHashTable.export`)."""

    keys: torch.Tensor
    """``(n,)`` int64."""
    scores: torch.Tensor
    """``(n, C)`` int64 score columns in the table's ``score_strategy`` order."""
    slots: torch.Tensor
    """``(n,)`` int64."""
    values: torch.Tensor
    """``(n, width)`` the rows; exported with ``split``, their first ``split`` columns."""
    state: torch.Tensor | None = None
    """Exported with ``split``: ``(n, width - split)`` the rows' other columns; else None."""
