"""Failed inserts (keys that got no slot): counted per table, and reported per the tables'
safe-check modes (ERROR raises, WARNING warns, IGNORE only counts)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from demb_kernels.table import InsertStatus

from demb_storage._errors import InsertFailedError
from demb_storage.options import SafeCheckMode, TableConfig

__all__ = ["count_failed", "raise_or_warn"]

_ONE_HOT_TABLES = 64
"""Up to this many tables, failed inserts are counted per table by a reduction over a
``(N, T)`` mask; beyond, by ``index_add_`` (whose atomics on few addresses serialize)."""


def count_failed(table_ids: torch.Tensor, status: torch.Tensor, num_tables: int) -> torch.Tensor:
    """``(T,)`` int64 on ``status``' device: the FAILED entries of each table (no sync).

    Args:
        table_ids: ``(N,)`` int64 table of each entry.
        status: ``(N,)`` int64 :class:`InsertStatus` of each entry.
        num_tables: ``T``.
    """
    failed = status == InsertStatus.FAILED
    if num_tables <= _ONE_HOT_TABLES:  # a reduction: no atomics on T addresses
        tables = torch.arange(num_tables, device=table_ids.device)
        return ((table_ids[:, None] == tables) & failed[:, None]).sum(0)
    zeros = torch.zeros(num_tables, dtype=torch.int64, device=status.device)
    return zeros.index_add_(0, table_ids, failed.to(torch.int64))


def raise_or_warn(configs: Sequence[TableConfig], counts: list[int], batch_size: int) -> None:
    """Raise :class:`InsertFailedError` for the ERROR tables with failed keys, else warn for the
    WARNING ones (``counts``: per table, the batch's failed keys)."""
    modes = [c.safe_check_mode for c in configs]
    errors = {t: n for t, n in enumerate(counts) if n and modes[t] is SafeCheckMode.ERROR}
    if errors:
        raise InsertFailedError(errors, batch_size)
    warned = {t: n for t, n in enumerate(counts) if n and modes[t] is SafeCheckMode.WARNING}
    if warned:
        per = ", ".join(f"table {t}: {n}" for t, n in sorted(warned.items()))
        warnings.warn(
            f"{sum(warned.values())} of {batch_size} keys could not be inserted ({per}); "
            "their rows read as zeros",
            stacklevel=4,
        )
