"""A training forward's lookup: the batch deduplicated per table, its keys found or inserted,
the new rows initialized (queued, no sync). Every training path starts with it
(:class:`FindOrInsert`)."""

from __future__ import annotations

import torch
from demb_kernels.init_rows import init_new_rows
from demb_kernels.table import EMPTY_KEY
from demb_storage import InsertOutcome

from demb_torchrec._dedup import DedupedBatch, dedup_bags
from demb_torchrec._launched import launched_find_or_insert
from demb_torchrec._launched_admission import launched_admitted
from demb_torchrec._state import Bags, ForwardState

__all__ = ["FindOrInsert", "Found", "TrainOutput", "TrainRows"]

Found = tuple[DedupedBatch, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
"""The deduplicated batch, its ``(U,)`` slots (-1: the key got no slot), their
:class:`~demb_kernels.table.InsertStatus` (None: every key was found, all HIT) and, for NONE
pooling from one-launch gathers, the occurrences' rows read by find_or_insert when every key
was found and the previous batch was found whole too (else None)."""

TrainOutput = tuple[torch.Tensor, torch.Tensor | None, list[int]]
"""What a training path returns to the module: its output (not yet cast to ``output_dtype``),
the statuses of its batch's find_or_insert (None: every key was found) and the batch's ``T + 1``
table bounds (the module counts the failed inserts from them once the forward is queued)."""


class FindOrInsert:
    """The lookup of a training forward, shared by every training path.

    On CUDA, while no table can grow, the dedup and the lookup are launched with one read-back
    (:func:`demb_torchrec._launched.launched_find_or_insert`); when that sort looked at too few
    key bits (it returns None), and on the CPU or while a table may grow, the dedup syncs once
    (``demb::dedup_batch``) and find_or_insert runs after it. Either way the new rows (and their
    optimizer state) are initialized by one launch queued behind the insert; keys that got no
    slot (FAILED) have slot -1 and are counted by the module once the forward's work is queued.
    With admission the same holds: on CUDA, while no table can grow and every admitter can
    rewind, the dedup, the find, the admitters and the insert are launched with one read-back
    (:func:`demb_torchrec._launched_admission.launched_admitted`); otherwise the dedup syncs
    first.
    """

    __slots__ = ("_launches", "_state")

    def __init__(self, state: ForwardState) -> None:
        self._state = state
        self._launches = state.device.type == "cuda"

    def find_or_insert(self, bags: Bags) -> Found:
        """:data:`Found` for a checked batch."""
        s = self._state
        tables = s.tables
        if s.admission is not None:
            if self._launches and not tables.may_grow and s.admission.rewindable:
                admitted = launched_admitted(s, bags)
                if admitted is not None:  # None: the dedup must sort on more key bits
                    return admitted
            return self._admitted(bags)
        if self._launches and not tables.may_grow:
            launched = launched_find_or_insert(s, bags)
            if launched is not None:  # None: the dedup must sort on more key bits
                return self._initialize_new(*launched)
        # The batch scores are made before the dedup's sync, not in the idle gap after it.
        scores = tables.next_score_args()
        batch = dedup_bags(s, bags)
        gather = (batch.inverse, s.dim) if s.gathers_rows() else None
        outcome = tables.find_or_insert(
            batch.keys,
            batch.tables,
            counts=batch.occurrence_counts(),
            zero_new_rows=False,
            check=False,
            count_failures=False,
            score_args=scores,
            gather_rows=gather,
        )
        return self._initialize_new(batch, outcome)

    def _admitted(self, bags: Bags) -> Found:
        """:data:`Found` of a module with admission: the unique keys found first (no score
        touched), the missing ones the admitters reject left out of find_or_insert (slot -1,
        status HIT: nothing to initialize, no failure), their mask kept in
        :attr:`ForwardState.rejected` for the paths' rows."""
        s = self._state
        tables = s.tables
        assert s.admission is not None
        scores = tables.next_score_args()
        batch = dedup_bags(s, bags)
        counts = batch.occurrence_counts()
        missing = tables.find(batch.keys, batch.tables, check=False) < 0
        rejected = s.admission.rejected(batch.keys, batch.tables, counts, missing)
        s.rejected[0] = rejected
        # the rejected keys stay in the batch as the empty key, which the insert skips (slot
        # -1, status HIT): no compaction, no sync
        outcome = tables.find_or_insert(
            torch.where(rejected, EMPTY_KEY, batch.keys),
            batch.tables,
            counts=counts,
            zero_new_rows=False,
            check=False,
            count_failures=False,
            score_args=scores,
            skips=True,
        )
        slots, status = outcome.slots, outcome.status
        s.found_whole[0] = False
        init_new_rows(s.tables.values, slots, batch.keys, batch.tables, status, s.new_rows)
        return batch, slots, status, None

    def _initialize_new(self, batch: DedupedBatch, outcome: InsertOutcome) -> Found:
        """After a find_or_insert of ``batch``'s unique keys: :data:`Found`, the new rows (and
        their optimizer state) initialized by one launch queued behind the insert."""
        s = self._state
        s.found_whole[0] = outcome.all_hit
        if outcome.all_hit:  # no row is new and none failed: nothing to initialize or count
            return batch, outcome.slots, None, outcome.rows
        init_new_rows(
            s.tables.values, outcome.slots, batch.keys, batch.tables, outcome.status, s.new_rows
        )
        return batch, outcome.slots, outcome.status, None


class TrainRows:
    """The shape of every training path: :class:`FindOrInsert` finds or inserts the batch's
    keys, then the subclass's :meth:`output` makes the forward's output from their slots and
    wires it to the update."""

    __slots__ = ("_lookup", "_state")

    def __init__(self, state: ForwardState) -> None:
        self._state = state
        self._lookup = FindOrInsert(state)

    def forward(self, bags: Bags, grad: bool) -> TrainOutput:
        """:data:`TrainOutput` of a checked, non-empty batch (``grad``: the output takes part
        in backward)."""
        found = self._lookup.find_or_insert(bags)
        out = self.output(found, bags, grad)
        return out, found[2], found[0].table_bounds

    def output(self, found: Found, bags: Bags, grad: bool) -> torch.Tensor:
        """The output of ``bags``, whose keys are ``found``."""
        raise NotImplementedError
