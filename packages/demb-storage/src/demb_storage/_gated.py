"""find_or_insert of a batch deduplicated with no sync (:mod:`demb_kernels.launched`), for a
training forward that waits once: after the lookup, not after the dedup too."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from demb_kernels.launched import LaunchedDedup, dedup_find_or_insert, gate_words

from demb_storage._errors import TableConfigError
from demb_storage._outcomes import InsertOutcome
from demb_storage._scores import checked_scores

if TYPE_CHECKING:
    from demb_storage.scored_table import ScoredHashTable

__all__ = ["find_or_insert_launched"]


def find_or_insert_launched(
    table: ScoredHashTable,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    batch_size: int,
    score_args: torch.Tensor,
    *,
    counters: torch.Tensor | None = None,
    key_bits: int = 64,
    gather_dim: int | None = None,
) -> tuple[LaunchedDedup, InsertOutcome | None, torch.Tensor]:
    """Deduplicate a TBE-layout batch per table and :meth:`ScoredHashTable.find_or_insert` its
    unique keys (a forward: STEP tables advance one step), with one sync
    (:func:`demb_kernels.launched.dedup_find_or_insert`), for tables that cannot grow (no table
    may grow mid-batch here: the unique keys are not known on the host before the lookup). New
    rows are not zeroed and FAILED keys are not counted: the caller writes every column of new
    rows and counts failures (:meth:`ScoredHashTable.record_failures`), as the table module does.

    Args:
        table: the tables (CUDA).
        indices, offsets, feature_tables, batch_size, counters, key_bits: the batch, as
            :func:`demb_kernels.launched.dedup_launch` takes it (``counters`` are summed into
            the LFU counts; default 1 per index).
        score_args: ``(T,)`` int64 the batch scores (:meth:`ScoredHashTable.next_score_args`).
        gather_dim: when every key is found, also read the first ``gather_dim`` columns of each
            index's row (:attr:`InsertOutcome.rows`), queued before the host learns that.

    Returns:
        ``(launched, outcome, host)``: the dedup (full-size outputs); ``host``, its info words
        read back (for :func:`demb_kernels.launched.launch_info`); ``outcome``, the ``U`` unique
        keys' slots and statuses, or None when the dedup's go flag was clear (a failed batch
        check, or a sort on too few key bits): then nothing changed and no step advanced.

    Raises:
        TableConfigError: some table can still grow.
    """
    if table.may_grow:
        raise TableConfigError(
            "find_or_insert_launched", "growable tables", "needs tables that cannot grow"
        )
    args = checked_scores(score_args, table.num_tables, table.device)
    launched, result, host, rows = dedup_find_or_insert(
        table.index, indices, offsets, feature_tables, batch_size, args, counters, key_bits,
        values=table.values, gather=gather_dim is not None, dim=gather_dim or 0,
    )  # fmt: skip
    unique, go, missed = gate_words(host)
    if not go:
        return launched, None, host
    table.steps = [s + 1 for s in table.steps]
    slots, status = result.slots[:unique], result.status[:unique]
    if not missed:
        return launched, InsertOutcome(slots, status, None, all_hit=True, rows=rows), host
    keys, tables = launched.keys[:unique], launched.tables[:unique]
    counts = launched.counts[:unique]
    slots, status = table._retry_no_eviction(keys, tables, counts, args, slots, status)
    return launched, InsertOutcome(slots, status, None), host
