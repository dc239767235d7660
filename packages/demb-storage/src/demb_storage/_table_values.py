"""The value buffers of a :class:`~demb_storage.ScoredHashTable`: allocating one (device,
pinned host, huge-page host, or hybrid), moving rows into a grown buffer, reading what an
insert evicted and zeroing the rows of new keys. Functions of the buffers alone, so the table
class keeps to its index logic."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from demb_kernels import memory
from demb_kernels import table as ops
from demb_kernels.hybrid import hybrid_zeros
from demb_kernels.rows import gather_rows, scatter_rows
from demb_kernels.table import InsertStatus

from demb_storage._outcomes import EvictedRows
from demb_storage.mixed_rows import read_mixed
from demb_storage.options import TableConfig
from demb_storage.table_counts import per_table_counts

__all__ = ["allocate_values", "evicted_rows", "move_rows", "zero_inserted_rows"]

_MOVE_ROWS = 1 << 20
"""Rows a growing table moves at a time (their copy is scratch on the values' device)."""


def allocate_values(
    rows: int, config: TableConfig, value_device: torch.device, index_device: torch.device
) -> torch.Tensor:
    """``(rows, config.width)`` zeros of the table's dtype on ``value_device``: a hybrid
    buffer (its first ``device_rows`` on the CUDA device, the rest in host memory) for a
    hybrid table, pinned host memory under a CUDA index, else (on the CPU) memory backed by
    huge pages where Linux grants them: rows are read at random (demb_kernels.memory)."""
    hybrid = config.device_rows is not None and config.device_rows < rows
    if hybrid and value_device.type == "cuda":
        assert config.device_rows is not None
        return hybrid_zeros(rows, config.width, config.dtype, value_device, config.device_rows)
    pin = value_device.type == "cpu" and index_device.type == "cuda"
    return memory.full(
        (rows, config.width), 0, dtype=config.dtype, device=value_device, pin_memory=pin
    )


def move_rows(
    old: torch.Tensor, new: torch.Tensor, old_slots: torch.Tensor, new_slots: torch.Tensor
) -> None:
    """Copy rows ``old[old_slots]`` to ``new[new_slots]``, a million at a time: the scratch
    copy lives on the values' device, where a hybrid table's rows may not fit at once."""
    src, dst = old_slots.to(old.device), new_slots.to(new.device)
    for start in range(0, src.shape[0], _MOVE_ROWS):
        part = slice(start, start + _MOVE_ROWS)
        scatter_rows(new, dst[part], gather_rows(old, src[part], check=False), check=False)


def evicted_rows(
    values: Sequence[torch.Tensor], result: ops.InsertResult, table_ids: torch.Tensor
) -> EvictedRows:
    """What an insert batch evicted, with each table's victim rows read from ``values`` before
    new rows overwrite them. Two syncs: the evicted entries, then their count per table (each
    table's rows are a slice of the entries sorted by table, stably)."""
    pos = (result.status == InsertStatus.EVICTED).nonzero().squeeze(1)
    ids = table_ids[pos]
    slots = result.slots[pos]
    order = torch.argsort(ids, stable=True)
    by_table = slots[order]
    counts = per_table_counts(ids, len(values)).tolist()
    first = values[0]
    if all(v.shape[1] == first.shape[1] and v.dtype == first.dtype for v in values):
        # one layout: one gather for every table (a launch, not one a table), split by table
        every = list(range(len(values)))
        rows = list(torch.split(read_mixed(values, ids[order], by_table, every), counts))
    else:
        ends = itertools.accumulate(counts)
        rows = [
            gather_rows(values[t], by_table[end - n : end].to(values[t].device))
            for t, (n, end) in enumerate(zip(counts, ends, strict=True))
        ]
    return EvictedRows(result.victim_keys[pos], ids, result.victim_scores[:, pos].t(), slots, rows)


def zero_inserted_rows(
    values: Sequence[torch.Tensor],
    table_ids: torch.Tensor,
    slots: torch.Tensor,
    status: torch.Tensor,
) -> None:
    """Zero the rows of INSERTED / EVICTED slots (no sync: other keys target slot -1)."""
    new = (status == InsertStatus.INSERTED) | (status == InsertStatus.EVICTED)
    for t, buf in enumerate(values):
        target = torch.where(new & (table_ids == t), slots, -1).to(buf.device)
        zeros = torch.zeros((target.shape[0], buf.shape[1]), dtype=buf.dtype, device=buf.device)
        scatter_rows(buf, target, zeros, check=False)
