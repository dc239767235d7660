"""Inserts into NO_EVICTION tables, which never evict: keys that found their bucket full grow
the table and are inserted again."""

from __future__ import annotations

from typing import Protocol

import torch
from demb_kernels import table as ops
from demb_kernels.table import InsertStatus, ScorePolicy, TableIndex

__all__ = ["Growing", "retry_no_eviction"]


class Growing(Protocol):
    """What the retry needs of a :class:`~demb_storage.ScoredHashTable`."""

    @property
    def index(self) -> TableIndex: ...

    @property
    def device(self) -> torch.device: ...

    def _growable(self, t: int) -> bool: ...

    def expand(self, table_id: int, new_capacity: int | None = None) -> bool: ...


def retry_no_eviction(
    table: Growing,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    counts: torch.Tensor | None,
    args: torch.Tensor,
    slots: torch.Tensor,
    status: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NO_EVICTION tables never evict: keys that found their bucket full double the table
    and are inserted again, until they fit or the table cannot grow."""
    policies = table.index.policy_list
    if ScorePolicy.NO_EVICTION not in policies:
        return slots, status
    no_evict = torch.tensor([p is ScorePolicy.NO_EVICTION for p in policies], device=table.device)
    while True:
        failed = ((status == InsertStatus.FAILED) & no_evict[table_ids]).nonzero().squeeze(1)
        if failed.numel() == 0:
            return slots, status
        tables = sorted(set(table_ids[failed].tolist()))
        grown = [t for t in tables if table._growable(t) and table.expand(t)]
        if not grown:
            return slots, status
        # The slots of this batch's other keys moved with the rehash: look them up again.
        slots = ops.find(table.index, keys, table_ids)
        retry = ops.find_or_insert(
            table.index,
            keys[failed],
            table_ids[failed],
            args,
            None if counts is None else counts[failed],
        )
        slots[failed] = retry.slots
        status = status.clone()
        status[failed] = retry.status
