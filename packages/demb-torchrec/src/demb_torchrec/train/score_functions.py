"""Score functions for ``tables.score_function`` (``demb train``): eviction scores of a
compound (TIMESTAMP, LFU) table, compiled by numba. Name one as
``demb_torchrec.train.score_functions:lru_lfu_decay_score``, or write your own in any
importable module."""

from __future__ import annotations

import math

__all__ = ["lru_lfu_decay_score"]


def lru_lfu_decay_score(scores: list[int], cur_timestamp: int) -> float:
    """A time-decayed LFU (the specification's example): ``log(max(frequency, 1))`` less about
    0.1 for each second since the key's last access (``scores[0]``: the last-access timestamp in
    ns, ``scores[1]``: the access count). The lowest score is evicted first."""
    age_seconds = (cur_timestamp - scores[0]) * 1e-9
    return math.log(max(scores[1], 1)) + age_seconds * math.log(0.9)
