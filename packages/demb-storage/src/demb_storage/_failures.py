"""Failed inserts (keys that got no slot): counted per table, and reported per the tables'
safe-check modes (ERROR raises, WARNING warns, IGNORE only counts)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from demb_kernels.table import InsertStatus

from demb_storage._errors import InsertFailedError
from demb_storage.options import SafeCheckMode, TableConfig
from demb_storage.table_counts import per_table_counts

__all__ = ["count_failed", "raise_or_warn"]


def count_failed(table_ids: torch.Tensor, status: torch.Tensor, num_tables: int) -> torch.Tensor:
    """``(T,)`` int64 on ``status``' device: the FAILED entries of each table (no sync).

    Args:
        table_ids: ``(N,)`` int64 table of each entry.
        status: ``(N,)`` int64 :class:`InsertStatus` of each entry.
        num_tables: ``T``.
    """
    return per_table_counts(table_ids, num_tables, status == InsertStatus.FAILED)


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
