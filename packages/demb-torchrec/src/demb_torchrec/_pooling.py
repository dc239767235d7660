"""Pooling of looked-up rows into the table module's output (differentiable torch ops).

Gathers use ``embedding`` / ``embedding_bag``: their backward sums each row's gradients by
sorting the indices, so a hot key's many occurrences do not serialize on atomics."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional

from demb_torchrec.options import DynamicEmbPoolingMode

__all__ = ["bag_rows", "pool", "pool_slots", "pool_uniform"]

_BAG_MODE = {DynamicEmbPoolingMode.SUM: "sum", DynamicEmbPoolingMode.MEAN: "mean"}


def pool(
    rows: Sequence[torch.Tensor],
    feature_index: Sequence[torch.Tensor],
    offsets: torch.Tensor,
    batch_size: int,
    feature_bounds: Sequence[int],
    mode: DynamicEmbPoolingMode,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """The module output from each feature's rows.

    Args:
        rows: per feature ``f``, ``(R_f, D_f)`` float rows its indices point into.
        feature_index: per feature, ``(n_f,)`` int64 row of each of its indices.
        offsets: ``(F * B + 1,)`` int64 bag offsets into the batch's indices.
        batch_size: ``B``.
        feature_bounds: ``F + 1`` host offsets of each feature's indices.
        mode: SUM / MEAN: ``(B, sum of D_f)``; NONE: ``(N, D)``, features stacked in order.
        weights: ``(N,)`` float32 per-index weights (SUM only) or None.
    """
    outputs = []
    for f, (source, index) in enumerate(zip(rows, feature_index, strict=True)):
        if mode is DynamicEmbPoolingMode.NONE:
            outputs.append(functional.embedding(index, source))
            continue
        begin = feature_bounds[f]
        bags = offsets[f * batch_size : (f + 1) * batch_size + 1] - begin
        w = None if weights is None else weights[begin : feature_bounds[f + 1]]
        outputs.append(
            functional.embedding_bag(
                index,
                source,
                bags,
                mode=_BAG_MODE[mode],
                per_sample_weights=w,
                include_last_offset=True,
            )
        )
    return torch.cat(outputs, dim=0 if mode is DynamicEmbPoolingMode.NONE else 1)


def pool_uniform(
    rows: torch.Tensor,
    index: torch.Tensor | None,
    offsets: torch.Tensor,
    batch_size: int,
    features: int,
    mode: DynamicEmbPoolingMode,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """The module output when every feature has one dim: one gather or one bag op for all.

    Args:
        rows: ``(R, D)`` float rows.
        index: ``(N,)`` int64 row of each index, or None when row ``i`` is index ``i``'s.
        offsets: ``(F * B + 1,)`` int64 bag offsets.
        batch_size: ``B``; features: ``F``.
        mode: SUM / MEAN: ``(B, F * D)``; NONE: ``(N, D)``.
        weights: ``(N,)`` float32 SUM weights or None.
    """
    if mode is DynamicEmbPoolingMode.NONE:
        return rows if index is None else functional.embedding(index, rows)
    if index is None:
        index = torch.arange(rows.shape[0], device=rows.device)
    bags = functional.embedding_bag(
        index,
        rows,
        offsets,
        mode=_BAG_MODE[mode],
        per_sample_weights=weights,
        include_last_offset=True,
    )
    dim = rows.shape[1]
    return bags.view(features, batch_size, dim).transpose(0, 1).reshape(batch_size, -1)


def bag_rows(
    offsets: torch.Tensor,
    batch_size: int,
    features: int,
    n: int,
    mode: DynamicEmbPoolingMode,
    weights: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where each index's gradient comes from in :func:`pool_uniform`'s output: the row of its
    bag in the output seen as ``(B * F, D)`` (bag ``j = f * B + b`` is row ``b * F + f``), and
    the factor of that bag's gradient (its weight; ``1 / size`` for MEAN; None: 1).

    Args:
        offsets: ``(F * B + 1,)`` int64 bag offsets, checked (``offsets[0] = 0``,
            non-decreasing, ``offsets[-1] = N``).
        batch_size: ``B``; features: ``F``; n: ``N`` indices.
        mode: SUM or MEAN.
        weights: ``(N,)`` float32 SUM weights or None.

    Returns:
        ``(N,)`` int64 rows and ``(N,)`` float32 factors (or None).
    """
    bags = features * batch_size
    # offsets are checked (the dedup's checks ran): each bag's indices are its diff. (A
    # searchsorted of every index took 1.3 ms on the scaled SUM batch on the CPU; this 0.2 ms.)
    bag = torch.arange(bags, device=offsets.device).repeat_interleave(offsets.diff(), output_size=n)
    rows = (bag % batch_size) * features + bag // batch_size
    if mode is DynamicEmbPoolingMode.MEAN:
        sizes = offsets.diff().clamp_min(1).to(torch.float32)
        return rows, (1.0 / sizes)[bag]
    return rows, weights


def pool_slots(
    tables: Sequence[torch.Tensor],
    feature_table_map: Sequence[int],
    slots: torch.Tensor,
    offsets: torch.Tensor,
    batch_size: int,
    feature_bounds: Sequence[int],
    mode: DynamicEmbPoolingMode,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """SUM / MEAN bags read straight from the tables' value rows (no gather of unique rows):
    an eval forward's pooling once each index has its slot.

    Args:
        tables: per table, ``(capacity, D_t)`` float32 value rows (a view of the embedding
            columns is fine).
        feature_table_map: the table of each feature.
        slots: ``(N,)`` int64 slot of each index, ``-1`` for a missing key (its row counts as
            zeros: it adds nothing to a SUM and counts in a MEAN's size).
        offsets / batch_size / feature_bounds / weights: as :func:`pool`.

    Returns:
        ``(B, sum of D_f)``.
    """
    missing = slots < 0
    if bool(missing.any()):
        keep = (~missing).to(torch.float32)
        weights = keep if weights is None else weights * keep
        slots = slots.clamp_min(0)
    outputs = []
    for f, t in enumerate(feature_table_map):
        begin, end = feature_bounds[f], feature_bounds[f + 1]
        bags = offsets[f * batch_size : (f + 1) * batch_size + 1] - begin
        w = None if weights is None else weights[begin:end]
        as_sum = mode is DynamicEmbPoolingMode.SUM or w is not None  # MEAN with missing keys
        out = functional.embedding_bag(
            slots[begin:end],
            tables[t],
            bags,
            mode="sum" if as_sum else _BAG_MODE[mode],
            per_sample_weights=w,
            include_last_offset=True,
        )
        if mode is DynamicEmbPoolingMode.MEAN and as_sum:
            out = out / bags.diff().clamp_min(1).to(out.dtype)[:, None]
        outputs.append(out)
    return torch.cat(outputs, dim=1)
