"""The table module's general paths: the rows of a deduplicated batch's unique keys gathered
from the tables (missing keys read as zeros or, in eval, from ``eval_initializer_args``), then
pooled with ``embedding`` / ``embedding_bag``, and trained through autograd to those rows.
:class:`UniformRows` (training, one dim) and :class:`MixedRows` (training, several dims) run
what the direct paths of :mod:`demb_torchrec._direct` do not (gradient clipping, tables that
are not float32, several dims); :class:`EvalUniformRows` and :class:`EvalMixedRows` are the
eval paths of the same cases (and of eval fills for SUM / MEAN)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from demb_kernels.lookup import gather_table_rows
from demb_optim import reduce_gradients
from demb_storage import initialize_rows
from torch.nn import functional

from demb_torchrec._autograd import Reduced, TrainStep, summed_per_key, trained_rows
from demb_torchrec._dedup import DedupedBatch, dedup_bags
from demb_torchrec._find_or_insert import Found, TrainRows
from demb_torchrec._pooling import bag_rows, pool, pool_uniform
from demb_torchrec._state import Bags, ForwardState, is_zero
from demb_torchrec.options import DynamicEmbPoolingMode

__all__ = ["EvalMixedRows", "EvalUniformRows", "MixedRows", "UniformRows", "fill_rejected"]

_Trained = Callable[[ForwardState, DedupedBatch, torch.Tensor, torch.Tensor, Bags], torch.Tensor]
"""A wiring of a one-dim batch's ``(U, D)`` rows to the update, pooled: ``(state, batch,
slots, whole, bags) -> output``."""

EvalFound = tuple[DedupedBatch, torch.Tensor, list[int]]
"""An eval forward's lookup: the deduplicated batch, its unique keys' ``(U,)`` slots (-1:
missing) and per table its missing keys."""

Rows = list[torch.Tensor]
"""Per table (or per feature), a tensor of rows (or of row indices)."""

_TrainedMixed = Callable[[ForwardState, DedupedBatch, torch.Tensor, Rows, Rows], tuple[Rows, Rows]]
"""A wiring of each table's unique rows to the update: ``(state, batch, slots, rows, local)
-> (sources, index)`` of the per-feature pooling."""


class UniformRows(TrainRows):
    """Training over tables of one dim that the direct paths do not take: gradients clipped per
    occurrence, SUM / MEAN from tables that are not float32, or NONE from tables that do not
    gather in one launch. The unique keys' rows are gathered into one ``(U, D)`` tensor (failed
    inserts read zeros) and pooled by one ``embedding`` / ``embedding_bag``; with a gradient,
    they are wired to the update as chosen at construction: each occurrence's row clipped, then
    summed per key (clipping); bags pooled outside autograd and each key's gradient summed from
    its bags' output gradients (SUM / MEAN); the unique rows' gradients as they are (NONE)."""

    __slots__ = ("_trained",)
    _trained: _Trained

    def __init__(self, state: ForwardState) -> None:
        super().__init__(state)
        if state.optimizer.gradient_clipping:
            self._trained = _clipped_uniform
        elif state.pooling_mode is not DynamicEmbPoolingMode.NONE:
            self._trained = _pooled_uniform
        else:
            self._trained = _rows_uniform

    def output(self, found: Found, bags: Bags, grad: bool) -> torch.Tensor:
        """The output of ``bags``, whose keys are ``found``."""
        batch, slots, _, _ = found
        s = self._state
        whole = whole_rows(s, batch, slots, None, None)
        if s.admission is not None:  # one buffer, a row per unique key
            slots_in_whole = torch.arange(batch.keys.numel(), device=s.device)
            fill_rejected(s, batch, [whole] * s.num_tables, slots_in_whole)
        if grad:
            return self._trained(s, batch, slots, whole, bags)
        return pool_uniform(whole, batch.inverse, bags, s.num_features, s.pooling_mode)


class MixedRows(TrainRows):
    """Training over tables of several dims (SUM / MEAN; or NONE whose features' tables share
    a dim while other tables do not): per table, its unique keys' rows (failed inserts read
    zeros), pooled per feature; with a gradient, autograd brings each table's rows their
    gradients (each occurrence's clipped first when the optimizer clips: chosen at
    construction) and the update runs on them."""

    __slots__ = ("_trained",)
    _trained: _TrainedMixed

    def __init__(self, state: ForwardState) -> None:
        super().__init__(state)
        self._trained = _clipped_mixed if state.optimizer.gradient_clipping else _rows_mixed

    def output(self, found: Found, bags: Bags, grad: bool) -> torch.Tensor:
        """The output of ``bags``, whose keys are ``found``."""
        batch, slots, _, _ = found
        s = self._state
        rows = rows_per_table(s, batch, slots, None, None, None)
        if s.admission is not None:  # a buffer per table, its keys' rows
            starts = torch.tensor(batch.table_bounds[:-1], device=s.device)
            in_table = torch.arange(batch.keys.numel(), device=s.device) - starts[batch.tables]
            fill_rejected(s, batch, rows, in_table)
        local = feature_index(s, batch)
        if grad:
            sources, local = self._trained(s, batch, slots, rows, local)
        else:
            sources = [rows[t] for t in s.feature_table_map]
        return pool(sources, local, bags, batch.feature_bounds, s.pooling_mode)


class _EvalFoundRows:
    """The shape of the eval unique-rows paths: the batch deduplicated and its unique keys
    found (:func:`_found_in_eval`), then the subclass's :meth:`output` makes the rows and pools
    them; the result cast to ``output_dtype``."""

    __slots__ = ("_fill", "_state")

    def __init__(self, state: ForwardState) -> None:
        self._state = state
        self._fill = _eval_fills(state)

    def forward(self, bags: Bags) -> torch.Tensor:
        """The output in ``output_dtype`` for a checked batch."""
        s = self._state
        # Nothing inserted, no score touched; the missing keys counted (one sync).
        batch = dedup_bags(s, bags)
        slots = s.tables.find(batch.keys, batch.tables, check=False)
        out = self.output((batch, slots, batch.count_per_table(slots < 0)), bags)
        return out if out.dtype == s.output_dtype else out.to(s.output_dtype)

    def output(self, found: EvalFound, bags: Bags) -> torch.Tensor:
        """The pooled rows of ``bags``, whose unique keys are ``found``."""
        raise NotImplementedError


class EvalUniformRows(_EvalFoundRows):
    """Eval over tables of one dim that the direct eval paths do not take: NONE from tables
    that do not gather in one launch; SUM / MEAN from tables that are not float32, or whose
    missing keys read an eval initializer other than zeros. The unique keys' rows are gathered
    into one ``(U, D)`` tensor (missing keys: zeros, or ``eval_initializer_args``) and pooled by
    one ``embedding`` / ``embedding_bag``."""

    __slots__ = ()

    def output(self, found: EvalFound, bags: Bags) -> torch.Tensor:
        """The pooled rows of ``bags``, whose unique keys are ``found``."""
        s, (batch, slots, missing) = self._state, found
        whole = whole_rows(s, batch, slots, missing, self._fill)
        return pool_uniform(whole, batch.inverse, bags, s.num_features, s.pooling_mode)


class EvalMixedRows(_EvalFoundRows):
    """Eval over tables of several dims that the direct eval paths do not take: SUM / MEAN
    whose missing keys read an eval initializer other than zeros or from tables that are not
    float32, and NONE with tables of other dims besides the features'. Each table's rows are
    gathered (missing keys: zeros, or ``eval_initializer_args``) and pooled per feature."""

    __slots__ = ()

    def output(self, found: EvalFound, bags: Bags) -> torch.Tensor:
        """The pooled rows of ``bags``, whose unique keys are ``found``."""
        s, (batch, slots, missing) = self._state, found
        rows = rows_per_table(s, batch, slots, missing, self._fill, None)
        sources = [rows[t] for t in s.feature_table_map]
        return pool(sources, feature_index(s, batch), bags, batch.feature_bounds, s.pooling_mode)


def _eval_fills(s: ForwardState) -> list[bool] | None:
    """Per table, whether its missing keys read ``eval_initializer_args`` (None: every table's
    are zeros)."""
    fill = [not is_zero(a) for a in s.eval_args]
    return fill if any(fill) else None


# ------------------------------------------------------------------------------ unique rows
def whole_rows(
    s: ForwardState,
    batch: DedupedBatch,
    slots: torch.Tensor,
    missing_counts: list[int] | None,
    fill: list[bool] | None,
) -> torch.Tensor:
    """``(U, D)`` float32 rows of the unique keys of tables of one dim (missing keys: zeros,
    then ``eval_initializer_args`` where ``fill``): one launch with one-launch gathers, else one
    ``index_select`` per table into the tensor.

    Args:
        s: the module's state; batch: the deduplicated batch.
        slots: ``(U,)`` int64 slot of each unique key (-1: missing).
        missing_counts: per table, the keys without a slot, or None when not counted (any table
            may have some).
        fill: per table, whether its missing keys read ``eval_initializer_args`` (an eval
            forward's; None: none does).
    """
    b = batch.table_bounds
    if not s.fused_gather:
        whole = torch.empty(b[-1], s.dim, device=s.device, dtype=torch.float32)
        rows_per_table(s, batch, slots, missing_counts, fill, whole)
        return whole
    # Every unique key's row in one launch (a missing key's row: zeros).
    whole = gather_table_rows(s.tables.values, slots, batch.tables, None, s.dim, check=False)
    if fill is not None:
        for t, filled in enumerate(fill):
            if filled and (missing_counts is None or missing_counts[t] > 0):
                _fill_missing(s, batch, t, slots[b[t] : b[t + 1]], whole[b[t] : b[t + 1]])
    return whole


def rows_per_table(
    s: ForwardState,
    batch: DedupedBatch,
    slots: torch.Tensor,
    missing_counts: list[int] | None,
    fill: list[bool] | None,
    whole: torch.Tensor | None,
) -> list[torch.Tensor]:
    """Per table, ``(U_t, D_t)`` float32 rows of its unique keys (missing keys: zeros, then
    ``eval_initializer_args`` where ``fill``), one ``index_select`` each: views of ``whole``,
    when given (``(U, D)``, tables of one dim), written in place.

    Args:
        s, batch, slots, missing_counts, fill: as :func:`whole_rows`.
        whole: the ``(U, D)`` float32 tensor the rows go into, or None.
    """
    b = batch.table_bounds
    rows = []
    for t in range(s.num_tables):
        st = slots[b[t] : b[t + 1]]
        some_missing = missing_counts is None or missing_counts[t] > 0
        values = s.tables.values[t][:, : s.dims[t]]
        at = st.clamp_min(0) if some_missing else st
        if whole is not None and values.dtype == torch.float32:
            r = torch.index_select(values, 0, at, out=whole[b[t] : b[t + 1]])
        else:
            r = values.index_select(0, at).float()
            if whole is not None:
                whole[b[t] : b[t + 1]] = r
                r = whole[b[t] : b[t + 1]]
        if some_missing:
            r.masked_fill_((st < 0)[:, None], 0.0)
            if fill is not None and fill[t]:
                _fill_missing(s, batch, t, st, r)
        rows.append(r)
    return rows


def _fill_missing(
    s: ForwardState,
    batch: DedupedBatch,
    t: int,
    slots: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """Rows of table ``t``'s missing keys (slot -1) from ``eval_initializer_args``."""
    b = batch.table_bounds
    missing = slots < 0
    fill = torch.zeros(slots.numel(), s.dims[t], device=s.device)
    where = torch.where(missing, torch.arange(slots.numel(), device=s.device), -1)
    keys = batch.keys[b[t] : b[t + 1]]
    initialize_rows(fill, where, keys, s.dims[t], s.eval_args[t], s.seeds[t], check=False)
    rows.copy_(torch.where(missing[:, None], fill, rows))


def fill_rejected(s: ForwardState, batch: DedupedBatch, rows: Rows, slots: torch.Tensor) -> None:
    """The rows of the unique keys the admitters rejected in this batch
    (:attr:`ForwardState.rejected`) from their fill initializers, each at ``rows[t][slots[u]]``
    (``rows``: per table, float32 rows, in place; ``slots``: ``(U,)`` int64)."""
    rejected, admission = s.rejected[0], s.admission
    if rejected is not None and admission is not None:
        admission.fill_rejected(rows, slots, batch.keys, batch.tables, rejected)


def feature_index(s: ForwardState, batch: DedupedBatch) -> list[torch.Tensor]:
    """Per feature, the row of each of its indices in its table's unique rows."""
    bounds, tb = batch.feature_bounds, batch.table_bounds
    return [
        batch.inverse[bounds[f] : bounds[f + 1]] - tb[t] for f, t in enumerate(s.feature_table_map)
    ]


# ------------------------------------------------------------------------ training wirings
def _clipped_uniform(
    s: ForwardState, batch: DedupedBatch, slots: torch.Tensor, whole: torch.Tensor, bags: Bags
) -> torch.Tensor:
    """One row per occurrence, each occurrence's gradient clipped, then summed per key."""
    occurrences = functional.embedding(batch.inverse, whole)
    unique = whole.shape[0]

    def reduce_occurrences(g: Sequence[torch.Tensor]) -> Reduced:
        summed = reduce_gradients(s.optimizer, g[0], batch.inverse, unique)
        return batch.per_table(summed), [summed]

    step = TrainStep(s, [occurrences], batch.per_table(slots), reduce_occurrences)
    (rows,) = trained_rows(s.trigger, step)
    return pool_uniform(rows, None, bags, s.num_features, s.pooling_mode)


def _pooled_uniform(
    s: ForwardState, batch: DedupedBatch, slots: torch.Tensor, whole: torch.Tensor, bags: Bags
) -> torch.Tensor:
    """SUM / MEAN: the bags pooled outside autograd, and in backward each key's gradient
    summed straight from its bags' output gradients (scaled by weight, or by ``1 / bag size``
    for MEAN) in the dedup's order, as the NONE path sums its rows."""
    features, mode = s.num_features, s.pooling_mode
    with torch.no_grad():
        out = pool_uniform(whole, batch.inverse, bags, features, mode)
    rows, scale = bag_rows(bags, features, batch.order.numel(), mode)
    return summed_per_key(s, s.trigger, batch, slots, out, whole.shape[1], rows, scale)


def _rows_uniform(
    s: ForwardState, batch: DedupedBatch, slots: torch.Tensor, whole: torch.Tensor, bags: Bags
) -> torch.Tensor:
    """NONE: the unique rows' gradients (autograd sums the occurrences') are the update's."""
    step = TrainStep(s, [whole], batch.per_table(slots), lambda g: (batch.per_table(g[0]), [g[0]]))
    (rows,) = trained_rows(s.trigger, step)
    return pool_uniform(rows, batch.inverse, bags, s.num_features, s.pooling_mode)


def _clipped_mixed(
    s: ForwardState, batch: DedupedBatch, slots: torch.Tensor, rows: Rows, local: Rows
) -> tuple[Rows, Rows]:
    """Tables of several dims, gradients clipped: one row per occurrence per feature, wired to
    the update (each occurrence's gradient clipped, then summed per key of its table); the
    pooling's sources and their index (row ``i`` is occurrence ``i``'s)."""
    ftm = s.feature_table_map
    per_feature = [functional.embedding(i, rows[t]) for t, i in zip(ftm, local, strict=True)]
    at_occurrence = list(local)

    def reduce_occurrences(g: Sequence[torch.Tensor]) -> Reduced:
        summed = []
        for t, feats in enumerate(s.features_of_table):
            count = batch.table_bounds[t + 1] - batch.table_bounds[t]
            if not feats:
                summed.append(torch.zeros(count, s.dims[t], device=s.device))
                continue
            occ = torch.cat([g[f] for f in feats])
            at = torch.cat([at_occurrence[f] for f in feats])
            summed.append(reduce_gradients(s.optimizer, occ, at, count))
        return summed, summed

    step = TrainStep(s, per_feature, batch.per_table(slots), reduce_occurrences)
    sources = list(trained_rows(s.trigger, step))
    return sources, [torch.arange(r.shape[0], device=s.device) for r in sources]


def _rows_mixed(
    s: ForwardState, batch: DedupedBatch, slots: torch.Tensor, rows: Rows, local: Rows
) -> tuple[Rows, Rows]:
    """Tables of several dims: each table's unique rows wired to the update (autograd sums
    their features' gradients); the pooling's sources and their index (``local``)."""
    step = TrainStep(s, rows, batch.per_table(slots), lambda g: (list(g), list(g)))
    outs = trained_rows(s.trigger, step)
    return [outs[t] for t in s.feature_table_map], local
