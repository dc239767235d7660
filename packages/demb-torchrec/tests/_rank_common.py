"""What the rank scripts (``_*_rank.py``) build alike: TorchRec table configs from
``(name, feature, dim, num_embeddings)`` rows, the dynamic-table constraints, a
model planned by DynamicEmbeddingShardingPlanner and sharded under DistributedModelParallel
over the world's process group, the KJTs they feed it, and the dynamic-table kernels of the
sharded collections with the rows those hold.

A rank script imports it in its ``main``, after :func:`_rank_join.join` (run as a script, a
rank script has this folder first on ``sys.path``; the tests load rank scripts only for their
batches and constants, without running ``main``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torchrec.optim as trec_optim
from demb_storage import TableExport
from demb_torchrec import DynamicEmbParameterConstraints, DynamicEmbTableOptions
from demb_torchrec.lookup import DynamicEmbeddingKernel
from demb_torchrec.planner import DynamicEmbeddingShardingPlanner
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import Topology
from torchrec.distributed.types import ModuleSharder, ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

Table = tuple[str, str, int, int]
"""A table's (name, feature, dim, num_embeddings)."""

META = torch.device("meta")

OPTIMIZER_CLASSES: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": trec_optim.SGD,
    "adagrad": trec_optim.Adagrad,
    "rowwise_adagrad": trec_optim.RowWiseAdagrad,
    "adam": trec_optim.Adam,
}
"""TorchRec's in-backward optimizer classes, by the name the rank scripts take."""


def sequence_configs(tables: Iterable[Table]) -> list[EmbeddingConfig]:
    """The EmbeddingCollection configs of ``tables``: one feature each."""
    return [
        EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f])
        for n, f, d, r in tables
    ]


def bag_configs(
    tables: Iterable[Table], pooling: PoolingType = PoolingType.SUM
) -> list[EmbeddingBagConfig]:
    """The EmbeddingBagCollection configs of ``tables``: one feature each, pooled by
    ``pooling`` (TorchRec's default SUM unless given)."""
    return [
        EmbeddingBagConfig(
            name=n, embedding_dim=d, num_embeddings=r, feature_names=[f], pooling=pooling
        )
        for n, f, d, r in tables
    ]


def sequence_collection(
    tables: Iterable[Table], device: torch.device = META
) -> EmbeddingCollection:
    """An EmbeddingCollection of ``tables`` on ``device`` (the meta device unless given: the
    sharded tables are made by the sharders)."""
    return EmbeddingCollection(tables=sequence_configs(tables), device=device)


def bag_collection(
    tables: Iterable[Table],
    pooling: PoolingType = PoolingType.SUM,
    device: torch.device = META,
    is_weighted: bool = False,
) -> EmbeddingBagCollection:
    """An EmbeddingBagCollection of ``tables`` pooled by ``pooling`` on ``device`` (the meta
    device unless given), weighted or not."""
    return EmbeddingBagCollection(
        tables=bag_configs(tables, pooling), is_weighted=is_weighted, device=device
    )


def table_configs(*collections: nn.Module) -> list[EmbeddingConfig | EmbeddingBagConfig]:
    """The table configs of ``collections`` (EmbeddingCollections and
    EmbeddingBagCollections), in order: what the planner plans."""
    return [
        config
        for c in collections
        for config in (
            c.embedding_configs()
            if isinstance(c, EmbeddingCollection)
            else c.embedding_bag_configs()  # type: ignore[operator]
        )
    ]


def dynamic(**options: Any) -> DynamicEmbParameterConstraints:
    """The constraints of a dynamic table with the table options ``options``."""
    return DynamicEmbParameterConstraints(
        use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions(**options)
    )


def shard(
    model: nn.Module,
    configs: Sequence[EmbeddingConfig | EmbeddingBagConfig],
    constraints: dict[str, Any],
    sharders: list[ModuleSharder[nn.Module]],
    device: torch.device,
) -> DistributedModelParallel:
    """``model`` planned by DynamicEmbeddingShardingPlanner (``configs``' tables under
    ``constraints``, one topology of the world's ranks on ``device``'s type; every rank the
    same plan) and sharded by ``sharders`` under DistributedModelParallel over the world's
    process group. The plan is the returned module's ``plan``."""
    group = dist.GroupMember.WORLD
    assert group is not None
    planner = DynamicEmbeddingShardingPlanner(
        list(configs),
        Topology(world_size=dist.get_world_size(), compute_device=device.type),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, group)
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(group),
        plan=plan,
        sharders=sharders,
        device=device,
    )


def features(
    names: Sequence[str],
    lengths: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    device: torch.device,
    weights: Sequence[torch.Tensor] | None = None,
) -> KeyedJaggedTensor:
    """One KJT on ``device`` of the features ``names``, each with its bags' lengths and its
    ids (and weights) in ``lengths``, ``values`` (and ``weights``), in ``names``' order."""
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(names),
        values=torch.cat(list(values)),
        lengths=torch.cat(list(lengths)),
        weights=None if weights is None else torch.cat(list(weights)),
    ).to(device)


def dynamic_kernels(*collections: nn.Module) -> list[DynamicEmbeddingKernel]:
    """The dynamic-table kernels of the sharded ``collections`` (TorchRec keeps a sharded
    collection's lookups out of the module tree)."""
    return [
        kernel
        for collection in collections
        for lookup in collection._lookups  # type: ignore[union-attr]
        for kernel in lookup.modules()
        if isinstance(kernel, DynamicEmbeddingKernel)
    ]


def held_rows(kernels: Iterable[DynamicEmbeddingKernel]) -> dict[str, TableExport]:
    """Per table of ``kernels``, what it holds on this rank (its export: keys, rows with
    optimizer state, scores)."""
    return {
        name: kernel.tables.tables.export(t)
        if kernel.tables.cache is None or kernel.tables.cache.below[t] is None
        else kernel.tables.cache.export(t)  # a caching table: the cache's rows and the storage's
        for kernel in kernels
        for t, name in enumerate(kernel.tables.table_names)
    }
