"""Sharders for collections with dynamic tables (spec: ``DynamicEmbeddingCollectionSharder``).

``DynamicEmbeddingCollectionSharder`` and ``DynamicEmbeddingBagCollectionSharder`` are TorchRec's
sharders that also offer row-wise sharding on ``CUSTOMIZED_KERNEL`` (on any device, TorchRec
offering no row-wise sharding on the CPU). They shard a collection into TorchRec's sharded
collection whose row-wise sharding of dynamic tables routes keys by the tables' ``dist_type``
(:class:`demb_torchrec.input_dist.DynamicRwSparseFeaturesDist`) and looks them up in dynamic
tables (:mod:`demb_torchrec.lookup`); the output dists are TorchRec's (rows all-to-all for an
``EmbeddingCollection``; partial bag sums reduce-scattered, then MEAN applied, for an
``EmbeddingBagCollection``). Tables planned otherwise are sharded by TorchRec as usual.

Example::

    sharder = DynamicEmbeddingCollectionSharder()
    plan = DynamicEmbeddingShardingPlanner(configs, topology, constraints=c).collective_plan(
        model, [sharder], pg
    )
    model = DistributedModelParallel(model, env, plan=plan, sharders=[sharder], device=device)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_sharding import (
    BaseSparseFeaturesDist,
    EmbeddingSharding,
    EmbeddingShardingInfo,
)
from torchrec.distributed.embedding_types import (
    BaseEmbeddingLookup,
    BaseGroupedFeatureProcessor,
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    KJTList,
)
from torchrec.distributed.embeddingbag import (
    EmbeddingBagCollectionContext,
    EmbeddingBagCollectionSharder,
    ShardedEmbeddingBagCollection,
)
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import (
    Awaitable,
    ParameterSharding,
    QuantizedCommCodecs,
    ShardingEnv,
    ShardingType,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from demb_torchrec.errors import ConfigError
from demb_torchrec.input_dist import DynamicRwSparseFeaturesDist
from demb_torchrec.lookup import (
    DynamicEmbeddingsLookup,
    DynamicPooledEmbeddingsLookup,
    planned_options,
)

__all__ = [
    "DynamicEmbeddingBagCollectionSharder",
    "DynamicEmbeddingCollectionSharder",
    "DynamicRwPooledEmbeddingSharding",
    "DynamicRwSequenceEmbeddingSharding",
    "ShardedDynamicEmbeddingBagCollection",
    "ShardedDynamicEmbeddingCollection",
]

_ROW_WISE = "row_wise"
_CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value


def _dynamic_input_dist(
    sharding: RwSequenceEmbeddingSharding | RwPooledEmbeddingSharding,
    is_sequence: bool,
    device: torch.device | None,
) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
    """A row-wise sharding's input dist, routing keys by its tables' ``dist_type`` (one for
    all of them). A sequence dist deduplicates ids unless a table clips gradients (clipping
    is per occurrence; a deduplicated key's occurrences reach the owner as one gradient)."""
    tables = [t for group in sharding._grouped_embedding_configs for t in group.embedding_tables]
    dist_types = {t.name: planned_options(t.name, t.fused_params).dist_type for t in tables}
    clips = any((t.fused_params or {}).get("gradient_clipping") for t in tables)
    kinds = sorted(set(dist_types.values()))
    if len(kinds) > 1:
        raise ConfigError(
            f"tables sharded row-wise in one collection share one dist_type; got {dist_types}"
        )
    return DynamicRwSparseFeaturesDist(
        pg=sharding._pg,
        num_features=sharding._get_num_features(),
        dist_type=kinds[0] if kinds else "roundrobin",
        feature_hash_sizes=sharding._get_feature_hash_sizes(),
        is_sequence=is_sequence,
        device=device if device is not None else sharding._device,
        dedup=is_sequence and not clips,
    )


class _DynamicRw:
    """What the dynamic row-wise shardings change in TorchRec's: the input dist routes keys by
    the tables' ``dist_type``, and the lookup is one
    :class:`demb_torchrec.lookup.DynamicEmbeddingKernel` per group of tables (pooled for an
    :class:`EmbeddingBagCollection`). Mixed in before TorchRec's sharding class, whose
    attributes it reads."""

    _is_sequence: bool
    _grouped_embedding_configs: list[GroupedEmbeddingConfig]
    _pg: ProcessGroup | None
    _device: torch.device | None
    _env: ShardingEnv

    def create_input_dist(
        self, device: torch.device | None = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        """Routes keys by the tables' ``dist_type``."""
        if getattr(self, "_has_feature_processor", False):
            raise NotImplementedError("dynamic tables: feature processors are not supported yet")
        return _dynamic_input_dist(self, self._is_sequence, device)

    def create_lookup(
        self,
        device: torch.device | None = None,
        fused_params: dict[str, Any] | None = None,
        feature_processor: BaseGroupedFeatureProcessor | None = None,
    ) -> BaseEmbeddingLookup:
        """The dynamic tables' lookup (``fused_params`` are the tables' own, already planned;
        feature processors are refused by the input dist)."""
        kwargs = {
            "grouped_configs": self._grouped_embedding_configs,
            "pg": self._pg,
            "device": device if device is not None else self._device,
            "env": self._env,
        }
        if self._is_sequence:
            return DynamicEmbeddingsLookup(**kwargs)
        return DynamicPooledEmbeddingsLookup(sharding_type=ShardingType.ROW_WISE, **kwargs)


class DynamicRwSequenceEmbeddingSharding(_DynamicRw, RwSequenceEmbeddingSharding):  # type: ignore[misc]
    """TorchRec's row-wise sequence sharding with the dynamic-table input dist and lookup."""

    _is_sequence = True


class DynamicRwPooledEmbeddingSharding(_DynamicRw, RwPooledEmbeddingSharding):  # type: ignore[misc]
    """TorchRec's row-wise pooled sharding with the dynamic-table input dist and lookup."""

    _is_sequence = False


def _check_row_wise(sharding_type: str, infos: list[EmbeddingShardingInfo]) -> bool:
    """Whether ``infos`` hold dynamic tables (which must be sharded row-wise)."""
    if all(info.param_sharding.compute_kernel != _CUSTOMIZED for info in infos):
        return False
    if sharding_type != _ROW_WISE:
        raise ConfigError(f"dynamic tables are sharded {_ROW_WISE}, not {sharding_type}")
    return True


@contextmanager
def _static_configs(
    module: ShardedEmbeddingCollection | ShardedEmbeddingBagCollection, attribute: str
) -> Iterator[None]:
    """``module.<attribute>`` (its table configs) without the dynamic tables, for the duration:
    TorchRec's weight initialization then skips them (they have no dense weight; a key's row
    is initialized when it is inserted)."""
    plan: dict[str, ParameterSharding] = module.module_sharding_plan
    configs: list[BaseEmbeddingConfig] = getattr(module, attribute)
    dynamic = {name for name, s in plan.items() if s.compute_kernel == _CUSTOMIZED}
    setattr(module, attribute, [c for c in configs if c.name not in dynamic])
    try:
        yield
    finally:
        setattr(module, attribute, configs)


class ShardedDynamicEmbeddingCollection(ShardedEmbeddingCollection):  # type: ignore[misc]
    """TorchRec's sharded ``EmbeddingCollection`` whose row-wise dynamic tables use
    :class:`DynamicRwSequenceEmbeddingSharding`."""

    @classmethod
    def create_embedding_sharding(
        cls,
        sharding_type: str,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> EmbeddingSharding:
        if not _check_row_wise(sharding_type, sharding_infos):
            return super().create_embedding_sharding(
                sharding_type, sharding_infos, env, device, qcomm_codecs_registry
            )
        return DynamicRwSequenceEmbeddingSharding(
            sharding_infos=sharding_infos,
            env=env,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    def reset_parameters(self) -> None:
        """TorchRec's initialization of the static tables only."""
        with _static_configs(self, "_embedding_configs"):
            super().reset_parameters()


class ShardedDynamicEmbeddingBagCollection(ShardedEmbeddingBagCollection):  # type: ignore[misc]
    """TorchRec's sharded ``EmbeddingBagCollection`` whose row-wise dynamic tables use
    :class:`DynamicRwPooledEmbeddingSharding`."""

    @classmethod
    def create_embedding_bag_sharding(
        cls,
        sharding_infos: list[EmbeddingShardingInfo],
        env: ShardingEnv,
        device: torch.device | None = None,
        permute_embeddings: bool = False,
        qcomm_codecs_registry: dict[str, QuantizedCommCodecs] | None = None,
    ) -> EmbeddingSharding:
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        if not _check_row_wise(sharding_type, sharding_infos):
            return super().create_embedding_bag_sharding(
                sharding_infos, env, device, permute_embeddings, qcomm_codecs_registry
            )
        return DynamicRwPooledEmbeddingSharding(
            sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry
        )

    def input_dist(
        self,
        ctx: EmbeddingBagCollectionContext,
        features: KeyedJaggedTensor,
    ) -> Awaitable[Awaitable[KJTList]]:
        """TorchRec's input dist; for a collection built ``is_weighted=False``, of the features
        without their weights: an unweighted collection ignores them (as TorchRec's unsharded
        one does), so neither its lookups pool by them nor TorchRec's row-wise MEAN divides a
        bag by their sum instead of its size. (TorchRec also takes a ``TensorDict``, which has
        no weights.)"""
        unweighted = isinstance(features, KeyedJaggedTensor) and not self._is_weighted
        if unweighted and features.weights_or_none() is not None:
            features = _without_weights(features)
        out: Awaitable[Awaitable[KJTList]] = super().input_dist(ctx, features)
        return out

    def reset_parameters(self) -> None:
        """TorchRec's initialization of the static tables only."""
        with _static_configs(self, "_embedding_bag_configs"):
            super().reset_parameters()


def _without_weights(features: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """``features`` with no weights (the same values, lengths, strides and inverse indices)."""
    variable = features.variable_stride_per_key()
    return KeyedJaggedTensor(
        keys=features.keys(),
        values=features.values(),
        lengths=features.lengths(),
        offsets=features.offsets_or_none(),
        stride=None if variable else features.stride(),
        stride_per_key_per_rank=features.stride_per_key_per_rank() if variable else None,
        length_per_key=features.length_per_key_or_none(),
        offset_per_key=features.offset_per_key_or_none(),
        inverse_indices=features.inverse_indices_or_none(),
    )


class _OffersDynamicRowWise:
    """What the dynamic-table sharders add to TorchRec's: row-wise sharding on every device
    (TorchRec offers none on the CPU) and ``CUSTOMIZED_KERNEL`` for it."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TorchRec's, plus ``row_wise`` on every device."""
        types: list[str] = list(super().sharding_types(compute_device_type))  # type: ignore[misc]
        return types if _ROW_WISE in types else [*types, _ROW_WISE]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """TorchRec's, plus ``CUSTOMIZED_KERNEL`` for ``row_wise``."""
        kernels: list[str] = list(
            super().compute_kernels(sharding_type, compute_device_type)  # type: ignore[misc]
        )
        return [*kernels, _CUSTOMIZED] if sharding_type == _ROW_WISE else kernels


class DynamicEmbeddingCollectionSharder(
    _OffersDynamicRowWise,
    EmbeddingCollectionSharder,  # type: ignore[misc]
):
    """TorchRec's ``EmbeddingCollectionSharder`` for collections with dynamic tables (same
    arguments). The dynamic tables' ids are deduplicated per feature before the all-to-all
    (:class:`demb_torchrec.input_dist.DynamicRwSparseFeaturesDist`)."""

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedDynamicEmbeddingCollection:
        """The sharded collection.

        Raises:
            ValueError: ``use_index_dedup`` with dynamic tables in ``module``: TorchRec's dedup
                (FBGEMM's ``jagged_unique_indices``) needs ids below ``num_embeddings``; the
                dynamic tables' dist deduplicates their ids itself.
        """
        dynamic = sorted(n for n, p in params.items() if p.compute_kernel == _CUSTOMIZED)
        if self._use_index_dedup and dynamic:
            raise ConfigError(
                f"use_index_dedup=True: TorchRec's index dedup cannot run over dynamic tables "
                f"{dynamic} (their ids are unbounded); their input dist already deduplicates ids"
            )
        return ShardedDynamicEmbeddingCollection(
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=self._use_index_dedup,
            module_fqn=module_fqn,
        )

    @property
    def sharded_module_type(self) -> type[nn.Module]:
        return ShardedDynamicEmbeddingCollection


class DynamicEmbeddingBagCollectionSharder(
    _OffersDynamicRowWise,
    EmbeddingBagCollectionSharder,  # type: ignore[misc]
):
    """TorchRec's ``EmbeddingBagCollectionSharder`` for collections with dynamic tables (same
    arguments)."""

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedDynamicEmbeddingBagCollection:
        """The sharded collection."""
        return ShardedDynamicEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            sharded_module_order_overwrite=self._sharded_module_order_overwrite,
        )

    @property
    def sharded_module_type(self) -> type[nn.Module]:
        return ShardedDynamicEmbeddingBagCollection
