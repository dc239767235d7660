"""One table's occupied slots with their rows, from an index and the table's value rows: what
:meth:`demb_storage.ScoredHashTable.export` returns, and what a copy of a table (a snapshot)
exports the same way."""

from __future__ import annotations

import torch
from demb_kernels import table as ops
from demb_kernels.rows import gather_rows
from demb_kernels.table import TableIndex

from demb_storage._outcomes import TableExport
from demb_storage.options import ScoreLayout

__all__ = ["export_table"]


def export_table(
    index: TableIndex,
    layout: ScoreLayout,
    values: torch.Tensor,
    table_id: int,
    begin: int = 0,
    end: int | None = None,
    min_score: int | None = None,
    *,
    check: bool = True,
) -> TableExport:
    """Keys, scores (the layout's user column order), slots and rows of table ``table_id`` of
    ``index`` in the slot range ``[begin, end)``; ``min_score`` filters on the first score
    column (for a compound strategy, its timestamp: what was touched since).

    Args:
        values: ``(capacity, width)`` the table's value rows (or a copy of them).
        check: check the slots against ``values`` on CUDA (one sync); a caller whose slots
            come from an index of ``values``'s capacity passes False.
    """
    filter_word = layout.index_words[layout.threshold_column]
    ex = ops.export(index, table_id, begin, end, min_score, filter_word)
    scores = ex.scores[list(layout.index_words)].t().contiguous()
    rows = gather_rows(values, ex.slots.to(values.device), check=check)
    return TableExport(ex.keys, scores, ex.slots, rows)
