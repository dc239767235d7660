"""Which path the table module's forward takes, picked once when the module is built: one
object for its training forwards (:class:`TrainPath`) and one for its eval forwards
(:class:`EvalPath`), from the tables' dims and dtypes, the pooling mode, the optimizer's
clipping and the eval initializers (``docs/architecture.md``, "The table module's paths")."""

from __future__ import annotations

from typing import Protocol

import torch

from demb_torchrec._direct import DirectRows, EvalDirectRows, EvalPooledFromTables, PooledFromTables
from demb_torchrec._find_or_insert import Found, TrainOutput
from demb_torchrec._state import Bags, ForwardState, is_zero
from demb_torchrec._unique_rows import EvalMixedRows, EvalUniformRows, MixedRows, UniformRows
from demb_torchrec.options import DynamicEmbPoolingMode

__all__ = ["EvalPath", "TrainPath", "eval_path", "train_path"]


class TrainPath(Protocol):
    """A training forward (tables found or inserted into, rows wired to the update)."""

    def forward(self, bags: Bags, grad: bool) -> TrainOutput:
        """A checked, non-empty batch's output, statuses and table bounds (``grad``: the
        output takes part in backward)."""
        ...

    def output(self, found: Found, bags: Bags, grad: bool) -> torch.Tensor:
        """The output of ``bags`` whose keys are ``found`` (a caching module's lookup)."""
        ...


class EvalPath(Protocol):
    """An eval forward (nothing inserted, no score touched)."""

    def forward(self, bags: Bags) -> torch.Tensor:
        """A checked, non-empty batch's output in ``output_dtype``."""
        ...


def train_path(state: ForwardState) -> TrainPath:
    """The training path of a module:

    - :class:`~demb_torchrec._direct.DirectRows`: NONE pooling, one-launch gathers (one dim,
      one dtype, <= 64 tables);
    - :class:`~demb_torchrec._direct.PooledFromTables`: SUM / MEAN over float32 tables of one
      dim, no gradient clipping;
    - :class:`~demb_torchrec._unique_rows.UniformRows`: any other module whose tables have one
      dim;
    - :class:`~demb_torchrec._unique_rows.MixedRows`: tables of several dims.

    A module with admission takes DirectRows or the last two (they fill the rejected keys'
    rows). Each starts with the same :class:`~demb_torchrec._find_or_insert.FindOrInsert` (on
    CUDA the one-sync lookup while no table can grow).
    """
    configs = state.tables.configs
    pooled = state.pooling_mode is not DynamicEmbPoolingMode.NONE
    if state.gathers_none_rows:  # with admission too: it fills the rejected keys' rows
        return DirectRows(state)
    if state.admission is not None:  # rejected keys' rows come from an initializer
        return UniformRows(state) if state.one_dim else MixedRows(state)
    if (
        pooled
        and state.one_dim
        and all(c.dtype == torch.float32 for c in configs)
        and not state.optimizer.gradient_clipping
    ):
        return PooledFromTables(state)
    if state.one_dim:
        return UniformRows(state)
    return MixedRows(state)


def eval_path(state: ForwardState) -> EvalPath:
    """The eval path of a module:

    - :class:`~demb_torchrec._direct.EvalDirectRows`: NONE pooling, one-launch gathers;
    - :class:`~demb_torchrec._direct.EvalPooledFromTables`: SUM / MEAN over float32 tables
      whose features' eval initializers are zeros;
    - :class:`~demb_torchrec._unique_rows.EvalUniformRows`: any other module whose tables
      have one dim;
    - :class:`~demb_torchrec._unique_rows.EvalMixedRows`: tables of several dims.
    """
    if state.gathers_none_rows:
        return EvalDirectRows(state)
    configs = state.tables.configs
    fills = any(
        state.features_of_table[t] and not is_zero(a) for t, a in enumerate(state.eval_args)
    )
    pooled = state.pooling_mode is not DynamicEmbPoolingMode.NONE
    if pooled and not fills and all(c.dtype == torch.float32 for c in configs):
        return EvalPooledFromTables(state)
    if state.one_dim:
        return EvalUniformRows(state)
    return EvalMixedRows(state)
