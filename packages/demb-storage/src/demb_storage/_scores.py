"""The batch score each table gives the keys of a find_or_insert: its step (STEP), the clock
(TIMESTAMP, NO_EVICTION, TIMESTAMP_LFU) or the score set for it (CUSTOMIZED; LFU tables add
counts and ignore theirs)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from demb_kernels.table import ScorePolicy

__all__ = ["TIME_POLICIES", "batch_scores", "checked_scores", "settled_clock"]

TIME_POLICIES = (ScorePolicy.TIMESTAMP, ScorePolicy.NO_EVICTION, ScorePolicy.TIMESTAMP_LFU)
"""The policies whose batch score is the clock's reading."""


def batch_scores(
    policies: Sequence[ScorePolicy],
    steps: Sequence[int],
    custom: Sequence[int],
    now: Callable[[int], torch.Tensor],
    device: torch.device,
) -> torch.Tensor:
    """``(T,)`` int64 on ``device``: per table its step (STEP), the clock's reading
    (``now(count)``: ``(count,)`` int64 copies of it) or its set score."""
    timed = [p in TIME_POLICIES for p in policies]
    if all(timed):  # every table scores with the clock: no host values to send
        return now(len(policies))
    host = [steps[t] if p is ScorePolicy.STEP else custom[t] for t, p in enumerate(policies)]
    args = torch.tensor(host, dtype=torch.int64, device=device)
    if any(timed):
        mask = torch.tensor(timed, device=device)
        args = torch.where(mask, now(1), args)
    return args


def checked_scores(args: torch.Tensor, num_tables: int, device: torch.device) -> torch.Tensor:
    """``args`` if it is ``(num_tables,)`` int64 on ``device`` (a caller's ``score_args``)."""
    if args.dtype != torch.int64 or args.shape != (num_tables,):
        raise ValueError(
            f"score_args must be ({num_tables},) int64 (next_score_args()), got "
            f"{tuple(args.shape)} {args.dtype}"
        )
    if args.device.type != device.type or (
        device.index is not None and args.device.index != device.index
    ):  # ("cuda" is the current device: cuda:0 matches it on one GPU)
        raise ValueError(f"score_args is on {args.device}, the index on {device}")
    return args


def settled_clock(now: Callable[[int], torch.Tensor], settle: bool) -> int:
    """A reading ``r`` of the clock ``now`` that splits time exactly (one or more syncs): every
    reading taken before is ``< r`` and every reading taken after is ``>= r``. The clock is read
    (``g``) and, with ``settle``, read again until it has moved past ``g``; ``r = g + 1``. A clock
    may repeat a reading (the GPU's global timer ticks coarser than its kernels run), so ``g``
    itself could equal both the last batch's score and the next one's. Without ``settle`` (a
    caller's own clock, which may never move) it is ``g``."""
    first = int(now(1)[0])
    if not settle:
        return first
    while int(now(1)[0]) <= first:
        pass
    return first + 1
