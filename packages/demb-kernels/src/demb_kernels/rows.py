"""Value rows addressed by slot: the copies between a table's value buffer and a batch.

``gather_rows`` / ``scatter_rows`` are ``demb`` ops (C++ on the CPU, CUDA kernels that copy in
the widest aligned unit, up to 16 bytes); any dtype. Slot ``-1`` means "no row": gathered as
zeros, skipped by a scatter (what a failed insert reads and writes).
"""

from __future__ import annotations

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)
from demb_kernels._checks import check_slot_range

__all__ = ["gather_rows", "scatter_rows"]


def gather_rows(values: torch.Tensor, slots: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Rows of ``values`` at ``slots``.

    Args:
        values: ``(R, D)`` contiguous value buffer, any dtype.
        slots: ``(n,)`` int64 rows to read, ``-1`` for a zero row.
        check: check the slot range on CUDA (one sync); unchecked, out-of-range slots read
            zeros.

    Returns:
        ``(n, D)`` values dtype.
    """
    check_slot_range(values, slots, check)
    rows: torch.Tensor = torch.ops.demb.gather_rows(values, slots)
    return rows


def scatter_rows(
    values: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, *, check: bool = True
) -> None:
    """Write ``rows`` into ``values`` at ``slots`` in place; slot ``-1`` is skipped.

    Args:
        values: ``(R, D)`` contiguous value buffer (mutated).
        slots: ``(n,)`` int64 target rows; a slot given twice must come with equal rows.
        rows: ``(n, D)`` values dtype.
        check: check the slot range on CUDA (one sync); unchecked, out-of-range slots are
            skipped.
    """
    check_slot_range(values, slots, check)
    torch.ops.demb.scatter_rows(values, slots, rows)


@torch.library.register_fake("demb::gather_rows")  # type: ignore[untyped-decorator]
def _gather_rows_fake(values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return values.new_empty((slots.shape[0], values.shape[1]))


@torch.library.register_fake("demb::scatter_rows")  # type: ignore[untyped-decorator]
def _scatter_rows_fake(values: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    return None
