"""Value rows of a batch that spans several tables of one row layout, read and written without
a sync: a batch's ``(n,)`` table ids and slots address ``values[table_ids[i]][slots[i]]``.

The per-table way (each table's entries picked out by a boolean mask, then one copy a table)
waits on the device once a table for the mask's count; a caching table's step moved its rows
that way a dozen times. Here a read is one ``gather_table_rows`` launch (every buffer of one
dtype, at most 64 tables, none narrower than the rows) or, otherwise, one masked gather a
table; a write is one masked scatter a table (slot -1, the other tables' entries, is skipped).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from demb_kernels.lookup import gather_table_rows
from demb_kernels.rows import gather_rows, scatter_rows

from demb_storage._errors import TableConfigError

__all__ = ["read_mixed", "write_mixed"]

_MAX_GATHER_TABLES = 64
"""The most buffers one ``gather_table_rows`` call takes."""
_GATHER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def read_mixed(
    values: Sequence[torch.Tensor],
    table_ids: torch.Tensor,
    slots: torch.Tensor,
    tables: Sequence[int],
) -> torch.Tensor:
    """``(n, width)`` rows ``values[table_ids[i]][slots[i]]`` (slot -1: zeros) in the buffers'
    dtype, on their device.

    Args:
        values: each table's ``(R_t, width_t)`` contiguous value buffer, all on one device.
        table_ids: ``(n,)`` int64 table of each entry, each one of ``tables``.
        slots: ``(n,)`` int64 row of each entry, in range or -1 (not checked).
        tables: the tables the entries belong to (one row layout: width and dtype).

    Raises:
        TableConfigError: no table given.
    """
    first = _first(values, tables)
    where = first.device
    slots, table_ids = slots.to(where), table_ids.to(where)
    if len(tables) == 1:
        return gather_rows(first, slots, check=False)
    width, dtype = first.shape[1], first.dtype
    fused = (
        dtype in _GATHER_DTYPES
        and len(values) <= _MAX_GATHER_TABLES
        and all(v.dtype == dtype and v.shape[1] >= width and v.device == where for v in values)
    )
    if fused:  # exact: float16 / bfloat16 widen to float32 and back
        out = gather_table_rows(list(values), slots, table_ids, None, width, check=False)
        return out.to(dtype)
    rows = torch.zeros((slots.shape[0], width), dtype=dtype, device=where)
    for t in tables:
        mine = table_ids == t
        part = gather_rows(values[t], torch.where(mine, slots, -1), check=False)
        rows = torch.where(mine.unsqueeze(1), part, rows)
    return rows


def write_mixed(
    values: Sequence[torch.Tensor],
    table_ids: torch.Tensor,
    slots: torch.Tensor,
    rows: torch.Tensor,
    tables: Sequence[int],
) -> None:
    """Write ``rows[i]`` at ``values[table_ids[i]][slots[i]]`` (slot -1 skipped), converted to
    the buffers' dtype; arguments and errors as :func:`read_mixed`, ``rows`` ``(n, width)``."""
    first = _first(values, tables)
    where = first.device
    slots, table_ids = slots.to(where), table_ids.to(where)
    rows = rows.to(where, first.dtype).contiguous()
    if len(tables) == 1:
        scatter_rows(first, slots, rows, check=False)
        return
    # Every buffer's slots (-1 where an entry is another table's), made in one pass (an
    # arange, not a copy of ``tables`` to the device: that would wait on it).
    every = torch.arange(len(values), device=where)
    per_table = torch.where(table_ids == every[:, None], slots, -1).unbind(0)
    for t in tables:
        scatter_rows(values[t], per_table[t], rows, check=False)


def _first(values: Sequence[torch.Tensor], tables: Sequence[int]) -> torch.Tensor:
    if not tables:
        raise TableConfigError("tables", tables, "a batch's rows need at least one table")
    return values[tables[0]]
