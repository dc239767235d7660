"""A training forward's dedup and find_or_insert with one sync (CUDA, tables that cannot grow):
the dedup leaves its sizes on the device (:func:`demb_kernels.launched.dedup_launch`), the
lookup reads them there, and one read-back after the lookup brings the sizes, the batch's
checks and whether every key was found (:func:`demb_storage.find_or_insert_launched`). When
every table scores with the GPU's clock, the dedup's first kernel reads it for the batch's
scores (:attr:`demb_kernels.launched.LaunchedDedup.clock`)."""

from __future__ import annotations

import torch
from demb_kernels.launched import LaunchedDedup, dedup_launch, launch_info, packed_radix
from demb_storage import InsertOutcome, find_or_insert_launched

from demb_torchrec._dedup import DedupedBatch, next_key_bits
from demb_torchrec._state import Bags, ForwardState

__all__ = ["Launched", "launch_dedup", "launched_find_or_insert", "read_launch"]

Launched = tuple[DedupedBatch, InsertOutcome]
"""The deduplicated batch and the outcome of its find_or_insert (new rows not initialized yet:
:meth:`demb_torchrec._find_or_insert.FindOrInsert.find_or_insert` does it)."""


def launch_dedup(s: ForwardState, bags: Bags, counted: bool) -> tuple[LaunchedDedup, torch.Tensor]:
    """The batch's dedup launched with no sync (the module's ``key_bits`` guess) and the
    batch scores: from the GPU's clock read by the dedup's first kernel when every table scores
    with it, else made after the dedup's launches (the GPU starts earlier).

    Args:
        s: the module's state (on CUDA).
        bags: the checked batch.
        counted: make the unique keys' occurrence counts.
    """
    counters = None if bags.counters is None else bags.counters.to(torch.int64)
    num_tables = s.num_tables
    key_bits, key_radix = s.key_bits
    clocked = s.tables.scores_from_gpu_clock
    launched = dedup_launch(
        bags.indices,
        bags.offsets,
        s.feature_tables,
        num_tables,
        bags.batch_size,
        counters,
        key_bits,
        key_radix,
        counted,
        num_tables if clocked else 0,
    )
    scores = launched.clock if clocked else s.tables.next_score_args()
    return launched, scores


def read_launch(
    s: ForwardState, bags: Bags, launched: LaunchedDedup, words: list[int], counted: bool
) -> DedupedBatch | None:
    """The deduplicated batch from a launched dedup's info ``words`` read back, the module's
    ``key_bits`` guess updated for the next batch; None when the go flag was clear (the sort
    looked at too few key bits: sort again).

    Raises:
        ValueError: a bad batch (as the dedup raises it).
    """
    num_tables = s.num_tables
    key_bits = s.key_bits[0]
    info = launch_info(words, bags.indices.numel(), num_tables, s.num_features)
    s.key_bits[0] = next_key_bits(info.key_bits)
    same_bits = s.key_bits[0] == key_bits  # low_max is of this sort's low bits
    s.key_bits[1] = packed_radix(key_bits, info.low_max, num_tables) if same_bits else 0
    if not info.ready:
        return None
    u, bounds = info.unique, info.bounds
    return DedupedBatch(
        launched.keys[:u],
        launched.tables[:u],
        launched.inverse,
        launched.counts[:u] if counted else None,
        bounds[: num_tables + 1],
        bounds[num_tables + 1 :],
        launched.order,
        launched.starts[:u],
        s.key_bits[0],
        launched.nonfinite,
    )


def launched_find_or_insert(s: ForwardState, bags: Bags) -> Launched | None:
    """Deduplicate the batch and find or insert its keys with one sync (the caller then
    initializes the new rows: :class:`demb_torchrec._find_or_insert.FindOrInsert`).

    Args:
        s: the module's state (training, on CUDA, its tables unable to grow).
        bags: the checked batch.

    Returns:
        :data:`Launched`, or None when the dedup's sort looked at too few key bits (nothing
        changed; the caller runs the two-sync path, with the bits now known).

    Raises:
        ValueError: a bad batch (as the dedup raises it); nothing changed.
    """
    counted = s.tables.counts_keys  # else no table reads the counts: none are made
    launched, scores = launch_dedup(s, bags, counted)
    gather = (launched.inverse, s.dim) if s.gathers_rows() else None
    outcome, words = find_or_insert_launched(
        s.tables, launched, scores, counts=counted, gather_rows=gather
    )
    batch = read_launch(s, bags, launched, words, counted)
    if outcome is None or batch is None:
        return None
    return batch, outcome
