"""Sharders for collections with dynamic tables (spec: ``DynamicEmbeddingCollectionSharder``).

``DynamicEmbeddingCollectionSharder`` is TorchRec's ``EmbeddingCollectionSharder`` that also
offers row-wise sharding on ``CUSTOMIZED_KERNEL`` (on any device, TorchRec offering no row-wise
sharding on the CPU), and shards an ``EmbeddingCollection`` into
:class:`ShardedDynamicEmbeddingCollection`: TorchRec's sharded collection whose row-wise
sharding routes keys by the tables' ``dist_type`` (:class:`DynamicRwSparseFeaturesDist`) and
looks them up in dynamic tables (:class:`demb_torchrec.lookup.DynamicEmbeddingsLookup`); the
sequence output dist is TorchRec's. Tables planned otherwise are sharded by TorchRec as usual.

Example::

    sharder = DynamicEmbeddingCollectionSharder()
    plan = DynamicEmbeddingShardingPlanner(configs, topology, constraints=c).collective_plan(
        model, [sharder], pg
    )
    model = DistributedModelParallel(model, env, plan=plan, sharders=[sharder], device=device)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
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
)
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.types import ParameterSharding, QuantizedCommCodecs, ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from demb_torchrec.input_dist import DynamicRwSparseFeaturesDist
from demb_torchrec.lookup import DynamicEmbeddingsLookup, kernel_arguments

__all__ = [
    "DynamicEmbeddingCollectionSharder",
    "DynamicRwSequenceEmbeddingSharding",
    "ShardedDynamicEmbeddingCollection",
]

_ROW_WISE = "row_wise"
_CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value


class DynamicRwSequenceEmbeddingSharding(RwSequenceEmbeddingSharding):  # type: ignore[misc]
    """TorchRec's row-wise sequence sharding with the dynamic-table input dist and lookup."""

    def create_input_dist(
        self, device: torch.device | None = None
    ) -> BaseSparseFeaturesDist[KeyedJaggedTensor]:
        """Routes keys by the tables' ``dist_type`` (one for all tables of the sharding)."""
        dist_types = {}
        for group in self._grouped_embedding_configs:
            for table in group.embedding_tables:
                options, _, _ = kernel_arguments(table.name, table.fused_params)
                dist_types[table.name] = options.dist_type
        kinds = sorted(set(dist_types.values()))
        if len(kinds) > 1:
            raise ValueError(
                f"tables sharded row-wise in one collection share one dist_type; got {dist_types}"
            )
        return DynamicRwSparseFeaturesDist(
            pg=self._pg,
            num_features=self._get_num_features(),
            dist_type=kinds[0] if kinds else "roundrobin",
            feature_hash_sizes=self._get_feature_hash_sizes(),
            is_sequence=True,
            device=device if device is not None else self._device,
        )

    def create_lookup(
        self,
        device: torch.device | None = None,
        fused_params: dict[str, Any] | None = None,
        feature_processor: BaseGroupedFeatureProcessor | None = None,
    ) -> BaseEmbeddingLookup:
        """One :class:`demb_torchrec.lookup.DynamicEmbeddingKernel` per group of tables."""
        return DynamicEmbeddingsLookup(
            grouped_configs=self._grouped_embedding_configs,
            pg=self._pg,
            device=device if device is not None else self._device,
            env=self._env,
        )


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
        kernels = {info.param_sharding.compute_kernel for info in sharding_infos}
        if _CUSTOMIZED not in kernels:
            return super().create_embedding_sharding(
                sharding_type, sharding_infos, env, device, qcomm_codecs_registry
            )
        if sharding_type != _ROW_WISE:
            raise ValueError(f"dynamic tables are sharded {_ROW_WISE}, not {sharding_type}")
        return DynamicRwSequenceEmbeddingSharding(
            sharding_infos=sharding_infos,
            env=env,
            device=device,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    def reset_parameters(self) -> None:
        """TorchRec's initialization of the static tables; dynamic tables have no dense weight
        (a key's row is initialized when it is inserted)."""
        dynamic = {
            name
            for name, sharding in self.module_sharding_plan.items()
            if sharding.compute_kernel == _CUSTOMIZED
        }
        configs: list[EmbeddingConfig] = self._embedding_configs  # type: ignore[has-type]
        self._embedding_configs = [c for c in configs if c.name not in dynamic]
        try:
            super().reset_parameters()
        finally:
            self._embedding_configs = configs


class DynamicEmbeddingCollectionSharder(EmbeddingCollectionSharder):  # type: ignore[misc]
    """TorchRec's ``EmbeddingCollectionSharder`` for collections with dynamic tables (same
    arguments)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TorchRec's, plus ``row_wise`` on every device."""
        types: list[str] = list(super().sharding_types(compute_device_type))
        return types if _ROW_WISE in types else [*types, _ROW_WISE]

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """TorchRec's, plus ``CUSTOMIZED_KERNEL`` for ``row_wise``."""
        kernels: list[str] = list(super().compute_kernels(sharding_type, compute_device_type))
        return [*kernels, _CUSTOMIZED] if sharding_type == _ROW_WISE else kernels

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedDynamicEmbeddingCollection:
        """The sharded collection."""
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
