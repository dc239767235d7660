"""Table-module forwards that read straight from the tables' rows, without gathering the
unique keys' rows first: the eval forwards, which also skip the dedup (each index is found on its
own; nothing inserted, no score touched), and the pooled training forward, which pools from the
tables once the batch's keys are found or inserted."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from demb_kernels.lookup import check_batch, index_tables
from demb_kernels.pooling import pool_table_rows
from demb_storage import initialize_rows

from demb_torchrec._autograd import summed_per_key
from demb_torchrec._dedup import DedupedBatch
from demb_torchrec._pooling import bag_rows, pool_slots
from demb_torchrec.options import DynamicEmbPoolingMode

if TYPE_CHECKING:
    from demb_torchrec.batched_tables import DynamicEmbeddingTables

__all__ = ["eval_none", "eval_pooled", "pooled_from_tables"]


def eval_none(
    m: DynamicEmbeddingTables, indices: torch.Tensor, offsets: torch.Tensor, batch_size: int
) -> torch.Tensor:
    """``(N, D)``: an eval forward without pooling (every table of one dim). Each index's row
    is read from its table, its table taken from its feature, in one pass
    (:meth:`ScoredHashTable.find_batch_rows`); missing keys read ``eval_initializer_args``.
    The batch's checks run in the same op, before the lookup: on a GPU the host waits for them
    only, so the forward returns while the lookup runs."""
    n, ftab = indices.numel(), m._feature_tables
    out, slots = m.tables.find_batch_rows(indices, offsets, ftab, batch_size, m.dims[0])
    if m._eval_fills:
        tables, _ = index_tables(indices, offsets, ftab, m.num_tables, batch_size)
    for t in m._eval_fills:
        missing = (slots < 0) & (tables == t)
        where = torch.where(missing, torch.arange(n, device=m.device), -1)
        initialize_rows(out, where, indices, m.dims[t], m.eval_args[t], m.seeds[t], check=False)
    return out


def eval_pooled(
    m: DynamicEmbeddingTables,
    indices: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """``(B, sum of dims)`` in ``output_dtype``: an eval SUM / MEAN, every bag pooled straight
    from its table's rows (:func:`_pooled`). Only for float32 tables whose eval initializer is
    zeros: a missing key is then a zero row."""
    if indices.is_cuda:  # each index's table by one kernel, with the batch's checks
        features = len(m.feature_table_map)
        tables, checks = index_tables(indices, offsets, m._feature_tables, m.num_tables, batch_size)
        bounds = check_batch(checks, indices.numel(), features)  # one sync; raises if bad
        slots = m.tables.find(indices, tables, check=False)  # its data checks are the batch's
    else:  # cheaper on the CPU than index_tables' searchsorted (the CPU lookup checks its data)
        bounds = offsets[::batch_size].tolist()
        sizes = torch.tensor(bounds, device=m.device).diff()
        slots = m.tables.find(indices, m._feature_tables.repeat_interleave(sizes))
    return _pooled(m, slots, offsets, batch_size, bounds, weights).to(m.output_dtype)


def _pooled(
    m: DynamicEmbeddingTables,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    bounds: list[int],
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """``(B, sum of dims)`` float32: each bag pooled straight from its table's rows by its
    indices' slots (-1: a zero row, counted by a MEAN), in one pass over every feature
    (:func:`demb_kernels.pooling.pool_table_rows`) when the module's ``_pools_in_one_pass``,
    else one ``embedding_bag`` per feature (:func:`demb_torchrec._pooling.pool_slots`)."""
    if m._pools_in_one_pass:
        mean = m.pooling_mode is DynamicEmbPoolingMode.MEAN
        return pool_table_rows(
            m.tables.values, slots, offsets, m._feature_tables, batch_size, m.dims[0],
            mean=mean, weights=weights,
        )  # fmt: skip
    values = [v[:, :d] for v, d in zip(m.tables.values, m.dims, strict=True)]
    return pool_slots(
        values, m.feature_table_map, slots, offsets, batch_size, bounds, m.pooling_mode, weights
    )


def pooled_from_tables(
    m: DynamicEmbeddingTables,
    batch: DedupedBatch,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    weights: torch.Tensor | None,
    grad: bool,
) -> torch.Tensor:
    """``(B, F * D)``: a training SUM / MEAN over tables of one dim, after find_or_insert
    (new rows already written): the bags pooled straight from the tables by each index's slot
    (a failed insert, slot -1, is a zero row), outside autograd; with ``grad``, wired to the
    update as :meth:`DynamicEmbeddingTables._pooled_trained` wires it (each key's gradient
    summed from its bags' output gradients). Only for float32 tables and no gradient
    clipping."""
    with torch.no_grad():
        out = _pooled(
            m,
            slots.index_select(0, batch.inverse),
            offsets,
            batch_size,
            batch.feature_bounds,
            weights,
        )
    if not grad:
        return out
    features = len(m.feature_table_map)
    n = batch.order.numel()
    rows, scale = bag_rows(offsets, batch_size, features, n, m.pooling_mode, weights)
    return summed_per_key(m, m._trigger, batch, slots, out, m.dims[0], rows, scale)
