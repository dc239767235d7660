"""find_or_insert of a batch deduplicated with no sync (:mod:`demb_kernels.launched`), for a
training forward that waits once: after the lookup, not after the dedup too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from demb_kernels.launched import LaunchedDedup, find_or_insert_gated, gate_words
from demb_kernels.table import EMPTY_KEY, InsertStatus, RowGather

from demb_storage._errors import TableConfigError
from demb_storage._no_eviction import retry_no_eviction
from demb_storage._outcomes import InsertOutcome
from demb_storage._scores import checked_scores

if TYPE_CHECKING:
    from demb_storage.scored_table import ScoredHashTable

__all__ = ["find_or_insert_launched"]


def find_or_insert_launched(
    table: ScoredHashTable,
    launched: LaunchedDedup,
    score_args: torch.Tensor,
    *,
    counts: bool = True,
    gather_rows: tuple[torch.Tensor, int] | None = None,
    skips: bool = False,
) -> tuple[InsertOutcome | None, list[int]]:
    """:meth:`ScoredHashTable.find_or_insert` of ``launched``'s unique keys (a forward: STEP
    tables advance one step), with one sync, for tables that cannot grow (no table may grow
    mid-batch here: the unique keys are not known on the host before the lookup). New rows are
    not zeroed and FAILED keys are not counted: the caller writes every column of new rows and
    counts failures (:meth:`ScoredHashTable.record_failures`), as the table module does.

    Args:
        table: the tables (CUDA).
        launched: :func:`demb_kernels.launched.dedup_launch`'s outputs.
        score_args: ``(T,)`` int64 the batch scores (:meth:`ScoredHashTable.next_score_args`).
        counts: use ``launched.counts`` for LFU words (else 1 per key; a dedup launched with
            ``counts=False`` has none to use).
        gather_rows: ``(inverse, dim)``: when every key is found, also read the first ``dim``
            columns of each occurrence's row (:attr:`InsertOutcome.rows`), queued before the
            host learns that.
        skips: ``launched.keys`` has entries of the empty key, -1, that stand for no key (a
            caller that keeps some unique keys out, such as admission): each is left alone
            (slot -1, status HIT: nothing to initialize, no failure).

    Returns:
        ``(outcome, words)``: ``words`` is ``launched.info`` read back, as a list (for
        :func:`demb_kernels.launched.launch_info`); ``outcome`` has the ``U`` unique keys'
        slots and statuses, or is None when the dedup's go flag was clear (a failed batch check,
        or a sort on too few key bits): then nothing changed and no step advanced.

    Raises:
        TableConfigError: some table can still grow, or ``counts`` is set and the dedup made
            no counts.
    """
    if table.may_grow:
        raise TableConfigError(
            "find_or_insert_launched", "growable tables", "needs tables that cannot grow"
        )
    if counts and launched.counts.shape != launched.keys.shape:
        raise TableConfigError(
            "counts", counts, "the dedup was launched with counts=False: it made no counts"
        )
    args = checked_scores(score_args, table.num_tables, table.device)
    gather = None if gather_rows is None else RowGather(table.values, *gather_rows)
    table.rank_victims(args)  # tables with a score_function: on the device, no sync
    result, host, rows = find_or_insert_gated(
        table.index, launched.keys, launched.tables, args,
        launched.counts if counts else None, launched.info, gather=gather,
    )  # fmt: skip
    words: list[int] = host.tolist()  # once: launch_info reads the same words
    unique, go, missed = gate_words(words)
    if not go:
        return None, words
    table.steps = [s + 1 for s in table.steps]
    slots, status = result.slots[:unique], result.status[:unique]
    if not missed:
        return InsertOutcome(slots, status, None, all_hit=True, rows=rows), words
    keys, tables = launched.keys[:unique], launched.tables[:unique]
    if skips:  # the kernels leave an empty-key entry FAILED: here it is no key at all
        status = torch.where(keys == EMPTY_KEY, int(InsertStatus.HIT), status)
    table.record_evictions(tables, status, result.victim_keys[:unique])
    key_counts = launched.counts[:unique] if counts else None
    slots, status = retry_no_eviction(table, keys, tables, key_counts, args, slots, status)
    table.outcomes.add(tables, status)
    return InsertOutcome(slots, status, None), words
