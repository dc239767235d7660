"""Rows wired to the fused update through one autograd node (``demb::summed_update``).

:func:`summed_update` returns its input unchanged; in backward the node sums each unique key's
gradient rows in a deduplicated batch's sorted order, checks the sums, and updates the tables'
rows in place with the optimizer (``demb::optimizer_update``'s arithmetic). What it needs
besides the forward's output is one documented struct, :class:`SummedUpdateOptions`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import demb_kernels  # noqa: F401  (loads the native ops)
import torch

from demb_optim.specs import OptimizerSpec
from demb_optim.update import UpdateParameters, update_parameters

__all__ = ["SummedUpdateOptions", "UpdateSettings", "summed_update", "update_settings"]


@dataclasses.dataclass(frozen=True, slots=True)
class UpdateSettings:
    """The optimizer as the fused update takes it: made once per spec
    (:func:`update_settings`)."""

    optimizer: str
    """The optimizer's kind (``str(spec.kind)``)."""
    parameters: UpdateParameters
    """Its hyper-parameters."""
    max_gradient: float | None
    """Each occurrence's gradient clipped to this L2 norm before the sums (None: no clipping)."""


@functools.lru_cache(maxsize=16)
def update_settings(spec: OptimizerSpec) -> UpdateSettings:
    """:class:`UpdateSettings` of ``spec``, cached (a forward's host time runs past its GPU
    work)."""
    clip = spec.max_gradient if spec.gradient_clipping else None
    return UpdateSettings(str(spec.kind), update_parameters(spec), clip)


class SummedUpdateOptions(NamedTuple):
    """What :func:`summed_update`'s backward reads besides the output's gradient (a tuple: one
    is made per training forward).

    The batch has ``N`` occurrences of ``U`` unique keys over ``T`` tables, the keys grouped by
    table (table ``t``'s are ``table_sizes[t]`` consecutive ones).
    """

    order: torch.Tensor
    """``(N,)`` int64 occurrence positions sorted by (table, key): unique key ``u``'s
    occurrences are ``order[starts[u]:starts[u + 1]]``."""
    starts: torch.Tensor
    """``(U,)`` int64 where each unique key's occurrences start in ``order``."""
    slots: torch.Tensor
    """``(U,)`` int64 each unique key's slot in its table (-1: no row, skipped)."""
    table_sizes: list[int]
    """``T`` unique keys per table (summing to ``U``)."""
    values: list[torch.Tensor]
    """Per table, its ``(capacity, dims[t] + state)`` value rows, updated in place."""
    dims: list[int]
    """Per table, its embedding dim."""
    steps: torch.Tensor
    """``(T,)`` int64 CPU tensor: each table's updates so far, advanced after each update
    (Adam's bias correction)."""
    settings: UpdateSettings
    """The optimizer (:func:`update_settings`)."""
    dim: int
    """The width of a gradient row (the output's rows are ``k * dim`` wide)."""
    check: bool = True
    """Reject NaN/inf sums before any row changes (one sync in backward)."""
    plan: torch.Tensor | None = None
    """On CUDA, for rows wider than 128 floats, the sums' chunks
    (:func:`demb_kernels.lookup.segment_plan`)."""
    rows: torch.Tensor | None = None
    """``(N,)`` int64: with a pooled output seen as ``(B * F, dim)``, the row of each
    occurrence's bag (None: row ``i`` of the output is occurrence ``i``'s)."""
    scale: torch.Tensor | None = None
    """``(N,)`` float32 factor of each occurrence's bag gradient (weight, or ``1 / size`` for
    MEAN; None: 1). Only with ``rows``."""
    workspace: torch.Tensor | None = None
    """On the CPU, a float32 tensor the sums go into (resized in place, kept across steps)."""
    nonfinite: torch.Tensor | None = None
    """On CUDA, a zeroed one-element bool tensor for the sums' NaN/inf flag
    (:attr:`demb_kernels.launched.LaunchedDedup.nonfinite`; None: the node makes one)."""


def summed_update(
    trigger: torch.Tensor, out: torch.Tensor, options: SummedUpdateOptions
) -> torch.Tensor:
    """``out`` wired to the update: the identity in forward; in backward, each unique key's
    gradient rows of ``out`` summed (each occurrence's clipped first when
    ``options.settings.max_gradient`` is set and ``options.rows`` is None), checked, and the
    tables updated in place.

    Args:
        trigger: a zero-size tensor that requires grad (what puts the node in the graph).
        out: the forward's ``(N, k * dim)`` (or, with ``rows``, ``(B, F * dim)``) output.
        options: the rest (:class:`SummedUpdateOptions`).

    Returns:
        A view of ``out`` whose backward runs the update.
    """
    o, settings = options, options.settings
    clip = settings.max_gradient if o.rows is None else None
    wired: torch.Tensor = torch.ops.demb.summed_update.default(
        trigger,
        out,
        o.order,
        o.starts,
        o.plan,
        o.rows,
        o.scale,
        o.slots,
        o.table_sizes,
        o.values,
        o.dims,
        o.steps,
        settings.optimizer,
        settings.parameters,
        clip,
        o.check,
        o.dim,
        o.workspace,
        o.nonfinite,
    )
    return wired
