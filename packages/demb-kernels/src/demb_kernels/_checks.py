"""Data checks the Python wrappers share (the CPU kernels check for free)."""

from __future__ import annotations

import torch

__all__ = ["check_slot_range"]


def check_slot_range(values: torch.Tensor, slots: torch.Tensor, check: bool) -> None:
    """Slots of a non-CPU batch in ``[-1, rows of values)``; one sync. Skipped when ``check``
    is False, on the CPU, or for an empty batch."""
    if not check or values.device.type == "cpu" or slots.numel() == 0:
        return
    bad = bool(((slots < -1) | (slots >= values.shape[0])).any())
    if bad:
        raise ValueError(f"slots: out of range for {values.shape[0]} rows (-1 means none)")
