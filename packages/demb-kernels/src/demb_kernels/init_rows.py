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

import torch

from demb_kernels import (
    _fakes,  # noqa: F401  (registers the fake kernels)
    _library,  # noqa: F401  (loads the native ops)
)
from demb_kernels._checks import check_slot_range

__all__ = ["INIT_MODES", "init_rows"]

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
