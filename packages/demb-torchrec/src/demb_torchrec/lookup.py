"""One rank's dynamic tables inside a sharded TorchRec collection: the compute kernel TorchRec
runs for ``CUSTOMIZED_KERNEL`` tables, backed by :class:`DynamicEmbeddingTables`.

TorchRec hands each group of tables (a ``GroupedEmbeddingConfig``) to a kernel with the group's
per-table fused params: the in-backward optimizer (``"optimizer"`` and its hyper-parameters),
the planner's per-rank options (``"dynamicemb_tables"``, see :class:`demb_torchrec.planner.
DynamicEmbParameterSharding`), and TorchRec's own keys. Every key either takes effect or raises
naming it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx
from torchrec.distributed.embedding_kernel import BaseEmbedding
from torchrec.distributed.embedding_lookup import (
    GroupedEmbeddingsLookup,
    GroupedPooledEmbeddingsLookup,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import data_type_to_dtype
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.errors import ConfigError, TrainingStateError
from demb_torchrec.options import DynamicEmbPoolingMode, DynamicEmbTableOptions
from demb_torchrec.planner import TABLES_KEY, PlannedTables

__all__ = [
    "DynamicEmbeddingKernel",
    "DynamicEmbeddingsLookup",
    "DynamicPooledEmbeddingsLookup",
    "kernel_arguments",
    "planned_options",
]

# TorchRec keys that carry no setting for a dynamic table when they hold these values.
_INERT: dict[str, tuple[object, ...]] = {
    "stochastic_rounding": (None, False),
    "enforce_hbm": (None, False),
    "bounds_check_mode": (None,),
    "output_dtype": (None,),
}


def planned_options(table: str, fused_params: Mapping[str, Any] | None) -> DynamicEmbTableOptions:
    """The per-rank options the planner gave dynamic table ``table`` (from its fused params).

    Raises:
        ValueError: there are none (the table was not planned by
            :class:`demb_torchrec.planner.DynamicEmbeddingShardingPlanner`).
    """
    planned = (fused_params or {}).get(TABLES_KEY)
    if not isinstance(planned, PlannedTables) or table not in planned:
        raise ConfigError(
            f"table {table!r}: no planned dynamic-table options in its fused params; plan "
            "dynamic tables with DynamicEmbeddingShardingPlanner"
        )
    return planned[table]


def kernel_arguments(
    table: str, fused_params: Mapping[str, Any] | None
) -> tuple[DynamicEmbTableOptions, object | None, dict[str, Any]]:
    """``(options, optimizer, hyper_parameters)`` of one dynamic table from its fused params;
    ``optimizer`` None when the table has none (an eval or export build: no
    ``apply_optimizer_in_backward`` and no ``optimizer`` in the sharder's fused params).

    Raises:
        ValueError: no planned options (:func:`planned_options`); optimizer hyper-parameters
            without an optimizer, naming them.
        NotImplementedError: a TorchRec setting dynamic tables do not have (caching,
            stochastic rounding, ...), naming it.
    """
    options = planned_options(table, fused_params)
    params = dict(fused_params or {})
    del params[TABLES_KEY]
    optimizer = params.pop("optimizer", None)
    for key, inert in _INERT.items():
        if key in params:
            value = params.pop(key)
            if value not in inert:
                raise NotImplementedError(
                    f"table {table!r}: {key}={value!r} is not supported on dynamic tables"
                )
    unsupported = sorted(k for k in params if k.startswith(("cache_", "prefetch")))
    if unsupported:
        raise NotImplementedError(
            f"table {table!r}: {', '.join(unsupported)}: TorchRec's UVM caching does not apply "
            "to dynamic tables (DynamicEmbTableOptions.caching is their cache)"
        )
    if optimizer is None and params:
        raise ConfigError(
            f"table {table!r}: {', '.join(sorted(params))} given, but no optimizer (give the "
            "collection's parameters one with apply_optimizer_in_backward, or the sharder "
            "fused_params={'optimizer': ...})"
        )
    return options, optimizer, params


def _training_refusal(optimizer: object | None, trainable: list[bool]) -> str:
    """Why a group of tables cannot train ('' when it can): no optimizer, or every table built
    with ``training=False``. (A group that mixes trainable and frozen tables is refused by
    :class:`DynamicEmbeddingTables` itself in a training forward.)"""
    if optimizer is None:
        return (
            "no optimizer, so they cannot train (the model was sharded "
            "without apply_optimizer_in_backward on their collection, or a sharder "
            "fused_params={'optimizer': ...}); look them up in eval mode or under "
            "torch.no_grad(), or detach their output"
        )
    if not any(trainable):
        return (
            "planned with training=False, so they hold no optimizer "
            "state and cannot train; look them up in eval mode or under torch.no_grad(), or "
            "detach their output"
        )
    return ""


class _CannotTrain(torch.autograd.Function):
    """Identity on the looked-up rows of tables that cannot train; its backward raises."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        trigger: torch.Tensor,
        rows: torch.Tensor,
        names: list[str],
        refusal: str,
    ) -> torch.Tensor:
        ctx.refusal = (names, refusal)  # type: ignore[attr-defined]
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, None, None, None]:
        raise TrainingStateError(*ctx.refusal)  # type: ignore[attr-defined]


class DynamicEmbeddingKernel(BaseEmbedding):  # type: ignore[misc]
    """The dynamic tables of one ``GroupedEmbeddingConfig`` on this rank. ``forward(features)``
    returns, without ``pooled``, ``(N, D)`` rows, one per value of ``features`` (TorchRec's
    sequence path; the features' weights, if any, are LFU frequency counters); with
    ``pooled``, ``(B, sum of dims)`` bag sums, weighted by the features' weights when the
    group's tables are weighted (a collection built ``is_weighted=True``; an unweighted one's
    weights are ignored) (TorchRec's row-wise pooled path sums partial bags across ranks and
    applies MEAN afterwards). The backward updates the rows in place."""

    def __init__(
        self, config: GroupedEmbeddingConfig, device: torch.device | None, pooled: bool = False
    ) -> None:
        super().__init__()
        self._pooled = pooled
        self._config = config
        tables = config.embedding_tables
        args = [kernel_arguments(t.name, t.fused_params) for t in tables]
        optimizer, hyper = args[0][1], args[0][2]
        for t, (_, opt, hp) in zip(tables, args, strict=True):
            if opt != optimizer or hp != hyper:
                raise ConfigError(
                    f"tables {tables[0].name!r} and {t.name!r} are grouped together but have "
                    "different optimizers"
                )
        for t in tables:
            if t.local_cols != t.embedding_dim:
                raise ConfigError(f"table {t.name!r}: dynamic tables are not column-sharded")
        options = [a[0] for a in args]
        names = [t.name for t in tables]
        self._refusal = _training_refusal(optimizer, [o.training for o in options])
        self._names = names
        """Why these tables cannot train ('' when they can)."""
        if optimizer is None:  # no optimizer state; SGD (stateless) only stands in for one
            options = [dataclasses.replace(o, training=False) for o in options]
        self.tables = DynamicEmbeddingTables(
            options,
            table_names=names,
            feature_table_map=[i for i, t in enumerate(tables) for _ in range(t.num_features())],
            pooling_mode=DynamicEmbPoolingMode.SUM if pooled else DynamicEmbPoolingMode.NONE,
            output_dtype=data_type_to_dtype(config.data_type),
            device=device,
            optimizer="sgd" if optimizer is None else optimizer,
            **hyper,
        )
        self._trigger = torch.zeros((), device=self.tables.device, requires_grad=True)

    @property
    def config(self) -> GroupedEmbeddingConfig:
        """The group this kernel serves."""
        return self._config

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """``(N, D)`` rows or ``(B, sum of dims)`` bag sums of ``features`` (feature-major, one
        stride). Tables that cannot train (no optimizer, or all planned ``training=False``)
        look up in training mode as under ``torch.no_grad()`` (inserting missing keys, as a
        training-mode lookup does), and the backward of such a lookup made with grad enabled
        raises ``TrainingStateError`` (a ``RuntimeError``) naming them; in eval mode nothing is
        inserted."""
        if self._refusal and self.training and torch.is_grad_enabled():
            with torch.no_grad():  # what a training-mode lookup does under no_grad
                rows = self._lookup(features)
            wired: torch.Tensor = _CannotTrain.apply(  # type: ignore[no-untyped-call]
                self._trigger, rows, self._names, self._refusal
            )
            return wired
        return self._lookup(features)

    def _lookup(self, features: KeyedJaggedTensor) -> torch.Tensor:
        weights = features.weights_or_none()
        if self._pooled:
            # Pooling weights only for a weighted collection: an unweighted one ignores the
            # KJT's weights (TorchRec's unsharded EmbeddingBagCollection passes them to its
            # bags only when ``is_weighted``; the channel carries other things too).
            pooling = weights if self._config.is_weighted else None
            rows: torch.Tensor = self.tables(features.values(), features.offsets(), pooling)
            return rows
        # The sequence path's weights are LFU frequency counters (the input dist's dedup
        # counts, or the user's).
        counters = None if weights is None else weights.to(torch.int64)
        rows = self.tables(features.values(), features.offsets(), frequency_counters=counters)
        return rows

    def named_parameters_by_table(self) -> Iterator[tuple[str, torch.Tensor]]:
        """None: a dynamic table has no dense weight for TorchRec to expose (its rows live in
        the hash table; DynamicEmbDump / DynamicEmbLoad move them)."""
        return iter(())


def _prefetch(
    kernels: Iterable[object],
    splits: list[int],
    features: KeyedJaggedTensor,
    forward_stream: torch.cuda.Stream | None,
) -> None:
    """Each caching group's :meth:`DynamicEmbeddingTables.prefetch` of its part of
    ``features`` (split by group, as the lookup's forward splits them)."""
    kernels = list(kernels)
    if not kernels:
        return
    for kernel, part in zip(kernels, features.split(splits), strict=True):
        if isinstance(kernel, DynamicEmbeddingKernel) and kernel.tables.cache is not None:
            kernel.tables.prefetch(part.values(), part.offsets(), forward_stream)


def _check_dynamic(config: GroupedEmbeddingConfig) -> None:
    if config.compute_kernel != EmbeddingComputeKernel.CUSTOMIZED_KERNEL:
        names = [t.name for t in config.embedding_tables]
        raise NotImplementedError(
            f"tables {names}: static tables sharded row-wise beside dynamic ones in one "
            f"collection are not supported ({config.compute_kernel.value} kernel)"
        )


class DynamicEmbeddingsLookup(GroupedEmbeddingsLookup):  # type: ignore[misc]
    """TorchRec's sequence lookup whose groups are :class:`DynamicEmbeddingKernel`."""

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        env: ShardingEnv | None = None,
    ) -> BaseEmbedding:
        _check_dynamic(config)
        return DynamicEmbeddingKernel(config, device)

    def prefetch(
        self, sparse_features: KeyedJaggedTensor, forward_stream: torch.cuda.Stream | None = None
    ) -> None:
        """Read ahead the storage rows of the caching tables' keys in ``sparse_features`` (the
        next batch's, as TorchRec's prefetch pipeline calls it; other tables: nothing)."""
        _prefetch(self._emb_modules, self._feature_splits, sparse_features, forward_stream)


class DynamicPooledEmbeddingsLookup(GroupedPooledEmbeddingsLookup):  # type: ignore[misc]
    """TorchRec's pooled lookup whose groups are pooled :class:`DynamicEmbeddingKernel`."""

    def _create_embedding_kernel(
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None = None,
    ) -> BaseEmbedding:
        _check_dynamic(config)
        return DynamicEmbeddingKernel(config, device, pooled=True)

    def prefetch(
        self, sparse_features: KeyedJaggedTensor, forward_stream: torch.cuda.Stream | None = None
    ) -> None:
        """As :meth:`DynamicEmbeddingsLookup.prefetch`."""
        _prefetch(self._emb_modules, self._feature_splits, sparse_features, forward_stream)
