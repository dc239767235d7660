"""A training forward's lookup with admission on CUDA with one sync (tables that cannot grow):
the dedup leaves its unique count and go flag on the device
(:func:`demb_kernels.launched.dedup_launch`); every later step runs on the batch's full size
``N``, the rows past the unique count (and every row when the go flag is clear) masked as the
empty key, which the find and the admitters' counters skip; the rejected keys go to the gated
insert (:func:`demb_storage.find_or_insert_launched`) as the empty key, and its one read-back
is the forward's one sync."""

from __future__ import annotations

import torch
from demb_kernels.init_rows import init_new_rows
from demb_kernels.launched import live_unique
from demb_kernels.table import EMPTY_KEY
from demb_storage import find_or_insert_launched

from demb_torchrec._dedup import DedupedBatch
from demb_torchrec._launched import launch_dedup, read_launch
from demb_torchrec._state import Bags, ForwardState

__all__ = ["launched_admitted"]

Admitted = tuple[DedupedBatch, torch.Tensor, torch.Tensor, None]
"""The deduplicated batch, its ``(U,)`` slots (-1: rejected, or no slot) and statuses."""


def launched_admitted(s: ForwardState, bags: Bags) -> Admitted | None:
    """The lookup of a training forward with admission, with one sync: the batch's unique keys
    found first (no score touched), the missing ones asked of the admitters with their batch
    counts, the others found or inserted with the batch scores and their new rows initialized
    (queued behind the read-back); the rejected keys' ``(U,)`` mask left in
    :attr:`ForwardState.rejected`.

    Args:
        s: the module's state (training, on CUDA, tables unable to grow, admitters that
            rewind: :attr:`demb_torchrec._admission.ModuleAdmission.rewindable`).
        bags: the checked batch.

    Returns:
        ``(batch, slots, status, None)``, or None when the dedup's sort looked at too few key
        bits (nothing changed: no key was asked or inserted, no step or toss advanced; the
        caller runs the two-sync path, with the bits now known).

    Raises:
        ValueError: a bad batch (as the dedup raises it); nothing changed.
    """
    admission = s.admission
    assert admission is not None
    tables = s.tables
    launched, scores = launch_dedup(s, bags, counted=True)
    live, keys, ids = live_unique(launched)
    counts = torch.where(live, launched.counts, 0)
    missing = live & (tables.find(keys, ids, check=False) < 0)
    mark = admission.mark()
    rejected = admission.rejected(keys, ids, counts, missing)
    # the rejected keys go to the gated insert as the empty key, which it leaves alone
    kept = launched._replace(keys=torch.where(rejected, EMPTY_KEY, launched.keys))
    outcome, host = find_or_insert_launched(tables, kept, scores, counts=True, skips=True)
    try:
        batch = read_launch(s, bags, launched, host, counted=True)
    except ValueError:  # a bad batch: nothing ran past the masks, only the tosses moved
        admission.rewind(mark)
        raise
    if outcome is None or batch is None:
        admission.rewind(mark)
        return None
    u = int(batch.keys.shape[0])
    s.rejected[0] = rejected[:u]
    s.found_whole[0] = False
    init_new_rows(
        tables.values, outcome.slots, batch.keys, batch.tables, outcome.status, s.new_rows
    )
    return batch, outcome.slots, outcome.status, None
