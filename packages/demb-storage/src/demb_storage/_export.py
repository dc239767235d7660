"""One table's occupied slots with their rows, from an index and the table's value rows: what
:meth:`demb_storage.ScoredHashTable.export` returns, and what a copy of a table (a snapshot)
exports the same way."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from demb_kernels import table as ops
from demb_kernels.delta_ops import export_scan
from demb_kernels.rows import gather_rows, gather_rows_many
from demb_kernels.table import TableIndex

from demb_storage._outcomes import TableExport
from demb_storage.options import ScoreLayout

__all__ = ["export_table", "export_tables"]

_ABOVE_ALL = 2**63 - 1
"""The minimum score of the slots of tables not exported that a scan spans (a slot that
reaches it anyway lies outside every exported table's range: it is not returned)."""
_BELOW_ALL = -(2**63)
"""A minimum score every slot reaches (a table exported whole)."""


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
    split: int | None = None,
) -> TableExport:
    """Keys, scores (the layout's user column order), slots and rows of table ``table_id`` of
    ``index`` in the slot range ``[begin, end)``; ``min_score`` filters on the first score
    column (for a compound strategy, its timestamp: what was touched since).

    Args:
        values: ``(capacity, width)`` the table's value rows (or a copy of them).
        check: check the slots against ``values`` on CUDA (one sync); a caller whose slots
            come from an index of ``values``'s capacity passes False.
        split: gather the rows' columns ``[0, split)`` as the export's ``values`` and the
            others as its ``state``, each contiguous (what a checkpoint writes: no copy of
            each half after the gather); ``values`` must then have a row for every slot of
            the table (checked on the host, no sync).
    """
    filter_word = layout.index_words[layout.threshold_column]
    ex = ops.export(index, table_id, begin, end, min_score, filter_word)
    scores = ex.scores[list(layout.index_words)].t().contiguous()
    slots = ex.slots.to(values.device)
    if split is None:
        return TableExport(ex.keys, scores, ex.slots, gather_rows(values, slots, check=check))
    _check_covers(index, table_id, values)
    if not 0 < split < values.shape[1]:
        raise ValueError(
            f"export of table {table_id}: values {tuple(values.shape)} must have more than "
            f"split={split} columns"
        )
    head = values[:, :split].index_select(0, slots)
    return TableExport(ex.keys, scores, ex.slots, head, values[:, split:].index_select(0, slots))


def export_tables(
    index: TableIndex,
    layouts: Sequence[ScoreLayout],
    values: Sequence[torch.Tensor],
    table_ids: Sequence[int],
    min_scores: Sequence[int | None],
) -> list[TableExport]:
    """:func:`export_table` of whole tables ``table_ids`` of ``index`` (table ``table_ids[i]``
    with ``layouts[i]``, ``values[i]`` and ``min_scores[i]``), equal to one call each. Tables
    whose layouts store their columns in the same words are scanned together: one mask, one
    ``nonzero`` and one index of keys and score words for all of them (each small tensor op
    costs more than scanning a small table does), then one gather of rows per table.

    Returns:
        Per table of ``table_ids``, in that order, its export (its scores and keys views of
        one tensor per group).
    """
    if not len(layouts) == len(values) == len(table_ids) == len(min_scores):
        raise ValueError(
            "export_tables: layouts, values, table_ids and min_scores differ in length"
        )
    groups: dict[tuple[tuple[int, ...], int, int], list[int]] = {}
    seen: dict[int, int] = {}  # a table asked for again goes to another scan
    for i, (layout, t) in enumerate(zip(layouts, table_ids, strict=True)):
        word = layout.index_words[layout.threshold_column]
        seen[t] = seen.get(t, -1) + 1
        groups.setdefault((layout.index_words, word, seen[t]), []).append(i)
    out: list[TableExport | None] = [None] * len(table_ids)
    for (words, word, _), members in groups.items():
        scanned = _scan(index, words, word, values, table_ids, min_scores, members)
        for i, ex in zip(members, scanned, strict=True):
            out[i] = ex
    return [ex for ex in out if ex is not None]


def _scan(
    index: TableIndex,
    words: tuple[int, ...],
    word: int,
    values: Sequence[torch.Tensor],
    table_ids: Sequence[int],
    min_scores: Sequence[int | None],
    members: list[int],
) -> list[TableExport]:
    """The exports of tables ``members`` (positions in ``table_ids``), whose layouts keep
    their columns in index words ``words`` and filter on word ``word``."""
    ids = [table_ids[i] for i in members]
    limits = [min_scores[i] for i in members]
    if index.keys.device.type == "cpu":  # one pass of a CPU kernel
        slots, found_keys, found_words, counts = export_scan(index, ids, limits, word, words)
        cuts = [0, *itertools.accumulate(counts)]
        parts = [(cuts[j], cuts[j + 1], slots[cuts[j] : cuts[j + 1]]) for j in range(len(ids))]
    else:
        found_keys, found_words, parts = _scan_ops(index, words, word, ids, limits)
    bufs = [values[i] for i in members]
    for i, buf in zip(members, bufs, strict=True):
        _check_covers(index, table_ids[i], buf)
    local = [p[2].to(buf.device) for p, buf in zip(parts, bufs, strict=True)]
    rows = gather_rows_many(bufs, local, check=False)  # in range: checked above
    return [
        TableExport(found_keys[a:b], found_words[a:b], slots, r)
        for (a, b, slots), r in zip(parts, rows, strict=True)
    ]


def _scan_ops(
    index: TableIndex,
    words: tuple[int, ...],
    word: int,
    ids: list[int],
    limits: list[int | None],
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, torch.Tensor]]]:
    """:func:`~demb_kernels.delta_ops.export_scan` in tensor ops (what CUDA runs): the found
    keys and score words, and per table of ``ids`` its entries ``[a, b)`` and local slots."""
    ranges = [index.slot_range(t) for t in ids]
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
    # the lowest score each slot of [lo, hi) needs: a member table's min_score, else above all
    per_table = [_ABOVE_ALL] * index.num_tables
    for t, limit in zip(ids, limits, strict=True):
        per_table[t] = _BELOW_ALL if limit is None else limit
    first, last = min(ids), max(ids)
    device = index.keys.device
    spanned = per_table[first : last + 1]
    per_slot: torch.Tensor | int = spanned[0]
    if len(set(spanned)) > 1:
        per_slot = torch.repeat_interleave(
            torch.tensor(spanned, dtype=torch.int64, device=device),
            torch.tensor(index.capacities[first : last + 1], device=device),
            output_size=hi - lo,
        )
    keys = index.keys[lo:hi]
    mask = index.scores[word, lo:hi] >= per_slot
    mask &= keys != ops.EMPTY_KEY
    found = mask.nonzero().squeeze(1)
    bounds = torch.tensor([r[0] - lo for r in ranges] + [r[1] - lo for r in ranges], device=device)
    cuts = torch.searchsorted(found, bounds).tolist()
    found_keys = keys[found]
    found_words = index.scores[:, lo + found][list(words)].t().contiguous()
    count = len(ids)
    parts = []
    for j, r in enumerate(ranges):
        a, b = cuts[j], cuts[count + j]
        parts.append((a, b, found[a:b] - (r[0] - lo)))
    return found_keys, found_words, parts


def _check_covers(index: TableIndex, table_id: int, values: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``values`` is 2-D with a row for every slot of table
    ``table_id`` (then every slot the index holds is in range: no check on the device)."""
    lo, hi = index.slot_range(table_id)
    if values.dim() != 2 or values.shape[0] < hi - lo:
        raise ValueError(
            f"export of table {table_id}: values {tuple(values.shape)} must have a row for "
            f"each of its {hi - lo} slots"
        )
