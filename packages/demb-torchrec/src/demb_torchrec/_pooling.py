"""Pooling of looked-up rows into the table module's output (differentiable torch ops).

Gathers use ``embedding`` / ``embedding_bag``: their backward sums each row's gradients by
sorting the indices, so a hot key's many occurrences do not serialize on atomics."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional

from demb_torchrec._state import Bags
from demb_torchrec.options import DynamicEmbPoolingMode

__all__ = ["bag_rows", "pool", "pool_slots", "pool_uniform"]

_BAG_MODE = {DynamicEmbPoolingMode.SUM: "sum", DynamicEmbPoolingMode.MEAN: "mean"}


def _feature_bags(
    bags: Bags, f: int, feature_bounds: Sequence[int]
) -> tuple[slice, torch.Tensor, torch.Tensor | None]:
    """Feature ``f``'s indices (a slice of the batch's), its ``(B + 1,)`` bag offsets into
    them and their weights (None: unweighted)."""
    begin, end = feature_bounds[f], feature_bounds[f + 1]
    b = bags.batch_size
    offsets = bags.offsets[f * b : (f + 1) * b + 1] - begin
    weights = None if bags.weights is None else bags.weights[begin:end]
    return slice(begin, end), offsets, weights


def pool(
    rows: Sequence[torch.Tensor],
    feature_index: Sequence[torch.Tensor],
    bags: Bags,
    feature_bounds: Sequence[int],
    mode: DynamicEmbPoolingMode,
) -> torch.Tensor:
    """The module output from each feature's rows.

    Args:
        rows: per feature ``f``, ``(R_f, D_f)`` float rows its indices point into.
        feature_index: per feature, ``(n_f,)`` int64 row of each of its indices.
        bags: the batch (its offsets, batch size and SUM weights are read).
        feature_bounds: ``F + 1`` host offsets of each feature's indices.
        mode: SUM / MEAN: ``(B, sum of D_f)``; NONE: ``(N, D)``, features stacked in order.
    """
    outputs = []
    for f, (source, index) in enumerate(zip(rows, feature_index, strict=True)):
        if mode is DynamicEmbPoolingMode.NONE:
            outputs.append(functional.embedding(index, source))
            continue
        _, offsets, w = _feature_bags(bags, f, feature_bounds)
        outputs.append(
            functional.embedding_bag(
                index,
                source,
                offsets,
                mode=_BAG_MODE[mode],
                per_sample_weights=w,
                include_last_offset=True,
            )
        )
    return torch.cat(outputs, dim=0 if mode is DynamicEmbPoolingMode.NONE else 1)


def pool_uniform(
    rows: torch.Tensor,
    index: torch.Tensor | None,
    bags: Bags,
    features: int,
    mode: DynamicEmbPoolingMode,
) -> torch.Tensor:
    """The module output when every feature has one dim: one gather or one bag op for all.

    Args:
        rows: ``(R, D)`` float rows.
        index: ``(N,)`` int64 row of each index, or None when row ``i`` is index ``i``'s.
        bags: the batch (its offsets, batch size and SUM weights are read).
        features: ``F``.
        mode: SUM / MEAN: ``(B, F * D)``; NONE: ``(N, D)``.
    """
    if mode is DynamicEmbPoolingMode.NONE:
        return rows if index is None else functional.embedding(index, rows)
    if index is None:
        index = torch.arange(rows.shape[0], device=rows.device)
    pooled = functional.embedding_bag(
        index,
        rows,
        bags.offsets,
        mode=_BAG_MODE[mode],
        per_sample_weights=bags.weights,
        include_last_offset=True,
    )
    b, dim = bags.batch_size, rows.shape[1]
    return pooled.view(features, b, dim).transpose(0, 1).reshape(b, -1)


def bag_rows(
    bags: Bags, features: int, n: int, mode: DynamicEmbPoolingMode
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where each index's gradient comes from in :func:`pool_uniform`'s output: the row of its
    bag in the output seen as ``(B * F, D)`` (bag ``j = f * B + b`` is row ``b * F + f``), and
    the factor of that bag's gradient (its weight; ``1 / size`` for MEAN; None: 1).

    Args:
        bags: the batch, checked (``offsets[0] = 0``, non-decreasing, ``offsets[-1] = N``).
        features: ``F``; n: ``N`` indices.
        mode: SUM or MEAN.

    Returns:
        ``(N,)`` int64 rows and ``(N,)`` float32 factors (or None).
    """
    offsets, batch_size = bags.offsets, bags.batch_size
    # offsets are checked (the dedup's checks ran): each bag's indices are its diff. (A
    # searchsorted of every index took 1.3 ms on the scaled SUM batch on the CPU; this 0.2 ms.)
    bag = torch.arange(features * batch_size, device=offsets.device).repeat_interleave(
        offsets.diff(), output_size=n
    )
    rows = (bag % batch_size) * features + bag // batch_size
    if mode is DynamicEmbPoolingMode.MEAN:
        sizes = offsets.diff().clamp_min(1).to(torch.float32)
        return rows, (1.0 / sizes)[bag]
    return rows, bags.weights


def pool_slots(
    tables: Sequence[torch.Tensor],
    feature_table_map: Sequence[int],
    slots: torch.Tensor,
    bags: Bags,
    feature_bounds: Sequence[int],
    mode: DynamicEmbPoolingMode,
) -> torch.Tensor:
    """SUM / MEAN bags read straight from the tables' value rows (no gather of unique rows):
    an eval forward's pooling once each index has its slot.

    Args:
        tables: per table, ``(capacity, D_t)`` float32 value rows (a view of the embedding
            columns is fine).
        feature_table_map: the table of each feature.
        slots: ``(N,)`` int64 slot of each index, ``-1`` for a missing key (its row counts as
            zeros: it adds nothing to a SUM and counts in a MEAN's size).
        bags / feature_bounds: as :func:`pool`.

    Returns:
        ``(B, sum of D_f)``.
    """
    missing = slots < 0
    if bool(missing.any()):
        keep = (~missing).to(torch.float32)
        weights = keep if bags.weights is None else bags.weights * keep
        bags = bags._replace(weights=weights)
        slots = slots.clamp_min(0)
    outputs = []
    for f, t in enumerate(feature_table_map):
        at, offsets, w = _feature_bags(bags, f, feature_bounds)
        as_sum = mode is DynamicEmbPoolingMode.SUM or w is not None  # MEAN with missing keys
        out = functional.embedding_bag(
            slots[at],
            tables[t],
            offsets,
            mode="sum" if as_sum else _BAG_MODE[mode],
            per_sample_weights=w,
            include_last_offset=True,
        )
        if mode is DynamicEmbPoolingMode.MEAN and as_sum:
            out = out / offsets.diff().clamp_min(1).to(out.dtype)[:, None]
        outputs.append(out)
    return torch.cat(outputs, dim=1)
