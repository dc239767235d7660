"""Value rows addressed by slot: the copies between a table's value buffer and a batch.

``gather_rows`` / ``scatter_rows`` are ``demb`` ops (C++ on the CPU, CUDA kernels that copy in
the widest aligned unit, up to 16 bytes); any dtype. Slot ``-1`` means "no row": gathered as
zeros, skipped by a scatter (what a failed insert reads and writes).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)
from demb_kernels._checks import check_slot_range

__all__ = ["gather_rows", "gather_rows_many", "scatter_rows", "scatter_rows_many"]


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


def gather_rows_many(
    values: Sequence[torch.Tensor], slots: Sequence[torch.Tensor], *, check: bool = True
) -> list[torch.Tensor]:
    """:func:`gather_rows` of several buffers: ``values[i]`` at ``slots[i]``, per buffer. On
    the CPU one op copies them all (one parallel region); elsewhere one op per buffer."""
    if len(values) != len(slots):
        raise ValueError(f"gather_rows_many: {len(values)} buffers, {len(slots)} slot lists")
    if values and all(v.device.type == "cpu" for v in values):
        rows: list[torch.Tensor] = torch.ops.demb.gather_rows_many(list(values), list(slots))
        return rows
    return [gather_rows(v, s, check=check) for v, s in zip(values, slots, strict=True)]


def scatter_rows_many(
    values: Sequence[torch.Tensor],
    slots: Sequence[torch.Tensor],
    rows: Sequence[torch.Tensor],
    *,
    check: bool = True,
) -> None:
    """:func:`scatter_rows` into several buffers: ``rows[i]`` into ``values[i]`` at
    ``slots[i]``. On the CPU one op copies them all; elsewhere one op per buffer."""
    if not len(values) == len(slots) == len(rows):
        raise ValueError("scatter_rows_many: values, slots and rows differ in length")
    if values and all(v.device.type == "cpu" for v in values):
        torch.ops.demb.scatter_rows_many(list(values), list(slots), list(rows))
        return
    for v, s, r in zip(values, slots, rows, strict=True):
        scatter_rows(v, s, r, check=check)


@torch.library.register_fake("demb::gather_rows_many")  # type: ignore[untyped-decorator]
def _gather_rows_many_fake(
    values: list[torch.Tensor], slots: list[torch.Tensor]
) -> list[torch.Tensor]:
    return [v.new_empty((s.shape[0], v.shape[1])) for v, s in zip(values, slots, strict=True)]


@torch.library.register_fake("demb::scatter_rows_many")  # type: ignore[untyped-decorator]
def _scatter_rows_many_fake(
    values: list[torch.Tensor], slots: list[torch.Tensor], rows: list[torch.Tensor]
) -> None:
    return None
