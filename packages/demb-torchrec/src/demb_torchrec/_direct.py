"""The table module's paths that read straight from the tables' rows, without gathering the
unique keys' rows first: the training paths of one dim (:class:`DirectRows` without pooling,
:class:`PooledFromTables` for SUM / MEAN), which read once the batch's keys are found or
inserted, and the eval paths (:class:`EvalDirectRows`, :class:`EvalPooledFromTables`), which
also skip the dedup (each index is found on its own; nothing inserted, no score touched)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from demb_kernels.lookup import check_batch, gather_table_rows, index_tables
from demb_kernels.pooling import pool_table_rows
from demb_storage import initialize_rows

from demb_torchrec._args import check_offsets
from demb_torchrec._autograd import summed_per_key
from demb_torchrec._find_or_insert import Found, TrainRows
from demb_torchrec._pooling import bag_rows, pool_slots
from demb_torchrec._state import Bags, ForwardState, is_zero
from demb_torchrec.options import DynamicEmbPoolingMode

__all__ = ["DirectRows", "EvalDirectRows", "EvalPooledFromTables", "PooledFromTables"]

_SlotPool = Callable[[ForwardState, torch.Tensor, Bags, list[int]], torch.Tensor]


class DirectRows(TrainRows):
    """Training, NONE pooling over tables of one dim and dtype (<= 64 tables: one-launch
    gathers). Each occurrence's row is read straight from its table (one launch, or the rows
    find_or_insert read when every key was found), and in backward each key's occurrence
    gradients are summed in the dedup's sorted order (``demb::summed_update``). With admission,
    a rejected key's occurrences read its fill initializer's row (and train nothing: slot
    -1)."""

    __slots__ = ()

    def output(self, found: Found, bags: Bags, grad: bool) -> torch.Tensor:
        """The output of ``bags``, whose keys are ``found``."""
        batch, slots, _, out = found
        s = self._state
        if out is None:
            out = gather_table_rows(
                s.tables.values, slots, batch.tables, batch.inverse, s.dim, check=False
            )
        if s.admission is not None and s.rejected[0] is not None:
            occurrences = batch.inverse  # the rejected keys' rows (slot -1: zeros so far)
            s.admission.fill_rejected(
                [out] * s.num_tables,
                torch.arange(occurrences.numel(), device=s.device),
                batch.keys[occurrences],
                batch.tables[occurrences],
                s.rejected[0][occurrences],
            )
        if grad:
            out = summed_per_key(s, s.trigger, batch, slots, out, s.dim)
        return out


class PooledFromTables(TrainRows):
    """Training, SUM / MEAN over float32 tables of one dim, no per-occurrence gradient clipping.
    Once find_or_insert has written the new rows, the bags are pooled straight from the tables
    by each index's slot (a failed insert, slot -1, is a zero row), outside autograd; in
    backward each key's gradient is summed from its bags' output gradients (scaled by weight, or
    by ``1 / bag size`` for MEAN) in the dedup's order: no ``(U, D)`` gradient of the pooling and
    no sort in backward."""

    __slots__ = ("_pool",)
    _pool: _SlotPool

    def __init__(self, state: ForwardState) -> None:
        super().__init__(state)
        self._pool = pool_in_one_pass if state.pools_in_one_pass else pool_per_feature

    def output(self, found: Found, bags: Bags, grad: bool) -> torch.Tensor:
        """The output of ``bags``, whose keys are ``found``."""
        batch, slots, _, _ = found
        s = self._state
        with torch.no_grad():
            out = self._pool(s, slots.index_select(0, batch.inverse), bags, batch.feature_bounds)
        if grad:
            n = batch.order.numel()
            rows, scale = bag_rows(bags, s.num_features, n, s.pooling_mode)
            out = summed_per_key(s, s.trigger, batch, slots, out, s.dim, rows, scale)
        return out


class EvalDirectRows:
    """Eval, NONE pooling over tables of one dim and dtype (<= 64 tables). Each index's row is
    read from its table, its table taken from its feature, in one pass
    (:meth:`ScoredHashTable.find_batch_rows`); missing keys read ``eval_initializer_args``. The
    batch's checks run in the same op, before the lookup: on a GPU the host waits for them only,
    so the forward returns while the lookup runs."""

    __slots__ = ("_fills", "_state")

    def __init__(self, state: ForwardState) -> None:
        self._state = state
        # Tables whose missing keys this path fills (eval_initializer_args not zeros).
        self._fills = [
            t
            for t, a in enumerate(state.eval_args)
            if state.features_of_table[t] and not is_zero(a)
        ]

    def forward(self, bags: Bags) -> torch.Tensor:
        """``(N, D)`` in ``output_dtype`` for a checked batch (weights and counters unused)."""
        s = self._state
        indices, offsets, batch_size = bags.indices, bags.offsets, bags.batch_size
        n, ftab = indices.numel(), s.feature_tables
        out, slots = s.tables.find_batch_rows(indices, offsets, ftab, batch_size, s.dim)
        if self._fills:
            tables, _ = index_tables(indices, offsets, ftab, s.num_tables, batch_size)
            for t in self._fills:
                missing = (slots < 0) & (tables == t)
                where = torch.where(missing, torch.arange(n, device=s.device), -1)
                initialize_rows(
                    out, where, indices, s.dims[t], s.eval_args[t], s.seeds[t], check=False
                )
        return out.to(s.output_dtype)


class EvalPooledFromTables:
    """Eval, SUM / MEAN over float32 tables whose eval initializer is zeros (a missing key is
    then a zero row). Each index's slot is found on its own (on CUDA after the batch's checks,
    one sync; on the CPU the lookup checks its data), then every bag is pooled straight from its
    table's rows."""

    __slots__ = ("_cuda", "_pool", "_state")
    _pool: _SlotPool

    def __init__(self, state: ForwardState) -> None:
        self._state = state
        self._cuda = state.device.type == "cuda"  # the batch is checked to be on the device
        self._pool = pool_in_one_pass if state.pools_in_one_pass else pool_per_feature

    def forward(self, bags: Bags) -> torch.Tensor:
        """``(B, sum of dims)`` in ``output_dtype`` for a checked batch (counters unused)."""
        s = self._state
        indices, offsets, batch_size = bags.indices, bags.offsets, bags.batch_size
        if self._cuda:  # each index's table by one kernel, with the batch's checks
            tables, checks = index_tables(
                indices, offsets, s.feature_tables, s.num_tables, batch_size
            )
            bounds = check_batch(checks, indices.numel(), s.num_features)  # one sync; raises
            slots = s.tables.find(indices, tables, check=False)  # its data checks: the batch's
        else:  # cheaper on the CPU than index_tables' searchsorted (the CPU lookup checks keys)
            check_offsets(offsets, indices.numel())
            bounds = offsets[::batch_size].tolist()
            sizes = torch.tensor(bounds, device=s.device).diff()
            slots = s.tables.find(indices, s.feature_tables.repeat_interleave(sizes))
        return self._pool(s, slots, bags, bounds).to(s.output_dtype)


def pool_in_one_pass(
    s: ForwardState, slots: torch.Tensor, bags: Bags, bounds: list[int]
) -> torch.Tensor:
    """``(B, F * D)`` float32: each bag pooled straight from its table's rows by its indices'
    ``(N,)`` slots (-1: a zero row, counted by a MEAN), every feature in one pass
    (:func:`demb_kernels.pooling.pool_table_rows`: one-launch gathers from float32 rows)."""
    mean = s.pooling_mode is DynamicEmbPoolingMode.MEAN
    return pool_table_rows(
        s.tables.values, slots, bags.offsets, s.feature_tables, bags.batch_size, s.dim,
        mean=mean, weights=bags.weights,
    )  # fmt: skip


def pool_per_feature(
    s: ForwardState, slots: torch.Tensor, bags: Bags, bounds: list[int]
) -> torch.Tensor:
    """As :func:`pool_in_one_pass`, by one ``embedding_bag`` per feature
    (:func:`demb_torchrec._pooling.pool_slots`; ``bounds``: each feature's ``F + 1`` host
    offsets), for float32 tables that do not gather in one launch."""
    values = [v[:, :d] for v, d in zip(s.tables.values, s.dims, strict=True)]
    return pool_slots(values, s.feature_table_map, slots, bags, bounds, s.pooling_mode)
