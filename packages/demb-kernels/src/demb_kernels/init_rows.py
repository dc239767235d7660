"""Initial value rows from their keys: ``demb::init_rows``, a counter-based row initializer.

Element ``j`` of a new row is a pure function of ``(seed, key, j)`` (Philox4x32-10, then the
mode's rule in double precision; csrc/init_rule.h), so a key gets the same initial row on the
CPU or a GPU, on any number of ranks, in any batch order and at any slot. The CPU and CUDA
kernels agree bit for bit on virtually every element; :mod:`demb_kernels.init_reference` is
the pure-Python reference.

Modes (``u`` uniform in (0, 1) from the top 24 bits of a Philox word):

- ``"uniform"``: ``lower + (upper - lower) * u``
- ``"normal"``: Box-Muller, ``mean + std_dev * sqrt(-2 log u0) * cos(2 pi u1)``
- ``"truncated_normal"``: inverse-CDF sampling of the normal ``(mean, std_dev)`` restricted to
  ``[lower, upper]``
- ``"constant"``: ``value``
- ``"debug"``: ``key mod 65536 + j / 256`` (exact in float32 for ``dim <= 256``)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from demb_kernels import (
    _fakes,  # noqa: F401  (registers the fake kernels)
    _library,  # noqa: F401  (loads the native ops)
)
from demb_kernels._checks import check_slot_range

__all__ = [
    "INIT_MODES",
    "NewRowsArgs",
    "NewRowsSpec",
    "init_new_rows",
    "init_rows",
    "new_rows_args",
]

INIT_MODES = ("uniform", "normal", "truncated_normal", "constant", "debug")
"""The ``mode`` values ``init_rows`` accepts."""


def init_rows(
    values: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    dim: int,
    *,
    seed: int,
    mode: str,
    mean: float = 0.0,
    std_dev: float = 1.0,
    lower: float = 0.0,
    upper: float = 1.0,
    value: float = 0.0,
    state: torch.Tensor | None = None,
    check: bool = True,
) -> None:
    """Set the rows of ``values`` at ``slots`` to the initial rows of ``keys``, in place.

    Columns ``[0, dim)`` of row ``slots[i]`` get the embedding of ``keys[i]``, computed in
    double, rounded to float32, then to the row dtype (round to nearest even). Columns
    ``[dim, W)`` get ``state`` (rounded to the row dtype), or stay as they are when ``state``
    is None. Slot ``-1`` is skipped; a slot given twice must come with equal keys.

    Args:
        values: ``(R, W)`` contiguous float32, float16 or bfloat16 value buffer (mutated).
        slots: ``(n,)`` int64 target rows in ``[-1, R)``; ``-1`` skips the entry.
        keys: ``(n,)`` int64 keys (any value; taken as uint64 bit patterns).
        dim: embedding columns, ``1 <= dim <= W``.
        seed: the table's seed, an int64 (taken as a uint64 bit pattern).
        mode: one of :data:`INIT_MODES`.
        mean: ``normal`` / ``truncated_normal`` mean.
        std_dev: ``normal`` / ``truncated_normal`` standard deviation (``> 0`` for
            ``truncated_normal``).
        lower: ``uniform`` / ``truncated_normal`` lower bound.
        upper: ``uniform`` / ``truncated_normal`` upper bound (``>= lower`` for
            ``truncated_normal``).
        value: ``constant``'s value.
        state: ``None`` or a ``(W - dim,)`` float32 tensor on ``values``' device: the initial
            optimizer state written after each embedding.
        check: check the slot range on CUDA (one sync); unchecked, out-of-range slots are
            skipped.

    Raises:
        ValueError: a bad mode, shape, ``dim``, device or slot (TypeError: a bad dtype).
    """
    check_slot_range(values, slots, check)
    torch.ops.demb.init_rows(
        values, slots, keys, dim, seed, mode, mean, std_dev, lower, upper, value, state
    )


class NewRowsSpec(NamedTuple):
    """How one table's new rows are made: :func:`init_rows`' keyword arguments of these names
    (``init_rows(..., **spec._asdict())``)."""

    seed: int
    mode: str
    mean: float = 0.0
    std_dev: float = 1.0
    lower: float = 0.0
    upper: float = 1.0
    value: float = 0.0


class NewRowsArgs(NamedTuple):
    """:func:`init_new_rows`' per-table arguments, made once (:func:`new_rows_args`)."""

    dims: list[int]
    seeds: list[int]
    modes: list[int]
    """Index of each table's mode in :data:`INIT_MODES`."""
    params: list[float]
    """5 words per table: mean, std_dev, lower, upper, value."""
    states: list[torch.Tensor | None]


def new_rows_args(
    dims: Sequence[int], specs: Sequence[NewRowsSpec], states: Sequence[torch.Tensor | None]
) -> NewRowsArgs:
    """The per-table arguments of :func:`init_new_rows` for ``T`` tables.

    Args:
        dims: ``T`` embedding columns.
        specs: ``T`` :class:`NewRowsSpec`.
        states: ``T`` initial optimizer states (``(W_t - dim_t,)`` float32 on the values'
            device) or None.

    Raises:
        ValueError: an unknown mode, or lists of different lengths.
    """
    if not len(dims) == len(specs) == len(states):
        raise ValueError(
            f"dims, specs and states: {len(dims)}, {len(specs)} and {len(states)} entries; "
            "one per table"
        )
    modes = []
    for s in specs:
        if s.mode not in INIT_MODES:
            raise ValueError(f"mode={s.mode!r}: unknown; expected one of {INIT_MODES}")
        modes.append(INIT_MODES.index(s.mode))
    params = [float(x) for s in specs for x in (s.mean, s.std_dev, s.lower, s.upper, s.value)]
    return NewRowsArgs(list(dims), [s.seed for s in specs], modes, params, list(states))


def init_new_rows(
    values: Sequence[torch.Tensor],
    slots: torch.Tensor,
    keys: torch.Tensor,
    tables: torch.Tensor,
    status: torch.Tensor,
    args: NewRowsArgs,
) -> None:
    """Initialize the rows a ``find_or_insert`` gave new keys, for several tables in one call
    (no sync): entry ``i`` with status INSERTED or EVICTED gets, in table ``tables[i]``, what
    :func:`init_rows` with that table's dim, spec and state (``args``) would write at
    ``slots[i]`` for ``keys[i]``. Other entries, and slot ``-1``, are skipped.

    Args:
        values: ``T`` value buffers as :func:`init_rows` takes one (mutated).
        slots: ``(n,)`` int64 row of each entry in its table.
        keys: ``(n,)`` int64 keys.
        tables: ``(n,)`` int64 table of each entry.
        status: ``(n,)`` int64 :class:`demb_kernels.table.InsertStatus` of each entry.
        args: :func:`new_rows_args` of the ``T`` tables.

    Raises:
        ValueError: a bad shape, ``dim``, parameter or device; on the CPU also an entry with a
            new row whose table or slot is out of range (checked before any row changes; CUDA
            skips them). TypeError: a bad dtype.
    """
    torch.ops.demb.init_new_rows(
        values if isinstance(values, list) else list(values),
        slots,
        keys,
        tables,
        status,
        args.dims,
        args.seeds,
        args.modes,
        args.params,
        args.states,
    )
