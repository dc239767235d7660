"""The dynamic tables of a model, as the model-level APIs (dumps, loads, incremental dumps,
replays, scores) find them: each table's collection (the collection's module path in the model,
DistributedModelParallel's wrapper left out; ``model`` for a model that is itself a
collection), its module and index there, and how it is sharded; and the helpers those APIs share
(table selection, process groups, host arrays).

The dynamic tables are those of TorchRec collections sharded by the dynamic-table sharders and
any :class:`~demb_torchrec.DynamicEmbeddingTables` module of the model (a rank of its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from demb_planner import continuous_block_size
from torch import nn

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.errors import ConfigError, NotSupportedError

__all__ = [
    "ModelTable",
    "TableNames",
    "check_group",
    "dtype_name",
    "dynamic_tables",
    "from_numpy",
    "gather_errors",
    "index_words",
    "process_group",
    "refuse_caching",
    "select_tables",
    "to_numpy",
]

_WRAPPER = "_dmp_wrapped_module"  # DistributedModelParallel's
_ROOT = "model"  # the collection name of a model that is itself a collection
TableNames = Mapping[str, Sequence[str]] | Sequence[str] | None


@dataclass(frozen=True)
class ModelTable:
    """One dynamic table of this rank: where it lives and how it is sharded."""

    collection: str
    module: DynamicEmbeddingTables
    index: int
    rank: int
    world_size: int
    num_embeddings: int | None

    @property
    def name(self) -> str:
        return self.module.table_names[self.index]

    @property
    def dist_type(self) -> str:
        return str(self.module.options[self.index].dist_type)

    def block_size(self) -> int | None:
        if self.dist_type != "continuous":
            return None
        if self.num_embeddings is None:
            raise ConfigError(f"table {self.name!r}: continuous sharding needs num_embeddings")
        return continuous_block_size(self.num_embeddings, self.world_size)


def _collection_name(path: str) -> str:
    parts = [p for p in path.split(".") if p and p != _WRAPPER]
    return ".".join(parts) or _ROOT


def dynamic_tables(model: nn.Module) -> list[ModelTable]:
    """Every dynamic table of ``model`` on this rank, by collection then table."""
    from demb_torchrec.lookup import DynamicEmbeddingKernel
    from demb_torchrec.sharders import (
        ShardedDynamicEmbeddingBagCollection,
        ShardedDynamicEmbeddingCollection,
    )

    found: list[ModelTable] = []
    for path, m in model.named_modules():
        name = _collection_name(path)
        if isinstance(m, ShardedDynamicEmbeddingCollection | ShardedDynamicEmbeddingBagCollection):
            env = m._env
            for lookup in m._lookups:  # TorchRec keeps lookups out of the module tree
                for kernel in lookup.modules():
                    if not isinstance(kernel, DynamicEmbeddingKernel):
                        continue
                    configs = kernel.config.embedding_tables
                    for t in range(kernel.tables.num_tables):
                        n = configs[t].num_embeddings
                        found.append(
                            ModelTable(name, kernel.tables, t, env.rank, env.world_size, n)
                        )
        elif isinstance(m, DynamicEmbeddingTables):
            found += [ModelTable(name, m, t, 0, 1, None) for t in range(m.num_tables)]
    return found


def is_caching(t: ModelTable) -> bool:
    """Whether table ``t`` is a cache over a storage tier (``caching=True``)."""
    cache = t.module.cache
    return cache is not None and cache.below[t.index] is not None


def refuse_caching(tables: Sequence[ModelTable], api: str) -> None:
    """Raise :class:`~demb_torchrec.errors.NotSupportedError` naming the first table with
    ``caching=True``: ``api`` does not read or write a cache's storage tier yet."""
    for t in tables:
        if is_caching(t):
            raise NotSupportedError(
                "DynamicEmbTableOptions.caching",
                f"{api} does not cover the storage tier under a cache yet (the rows there would "
                "be missed); it supports tables with caching=False",
                table=f"{t.collection}/{t.name}",
            )


def select_tables(tables: list[ModelTable], table_names: TableNames) -> list[ModelTable]:
    """The tables ``table_names`` names (``{collection: [table, ...]}``, or table names in
    any collection); every name must exist."""
    if table_names is None:
        return tables
    if isinstance(table_names, Mapping):
        wanted = {(c, t) for c, names in table_names.items() for t in names}
        missing = wanted - {(t.collection, t.name) for t in tables}
        picked = [t for t in tables if (t.collection, t.name) in wanted]
    else:
        names = {table_names} if isinstance(table_names, str) else set(table_names)
        missing = {("*", n) for n in names - {t.name for t in tables}}
        picked = [t for t in tables if t.name in names]
    if missing:
        raise ConfigError(
            f"table_names: no dynamic table {sorted(missing)} in the model (it has "
            f"{sorted({(t.collection, t.name) for t in tables})})"
        )
    return picked


def process_group(pg: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if not dist.is_available() or not dist.is_initialized():
        if pg is not None:
            raise ConfigError("pg: given, but torch.distributed is not initialized")
        return None
    return pg if pg is not None else dist.group.WORLD


def check_group(group: dist.ProcessGroup | None, tables: list[ModelTable]) -> None:
    size = 1 if group is None else group.size()
    for t in tables:
        if t.world_size > 1 and t.world_size != size:
            raise ConfigError(
                f"pg: {size} ranks, but table {t.collection}/{t.name} is sharded over "
                f"{t.world_size}; every rank of the sharding takes part in a dump or load"
            )


def gather_errors(group: dist.ProcessGroup | None, error: BaseException | None) -> list[str]:
    """Every rank's error (as text), gathered over ``group``."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if group is None:
        return [] if mine is None else [mine]
    errors: list[str | None] = [None] * group.size()
    dist.all_gather_object(errors, mine, group=group)
    return [e for e in errors if e is not None]


def to_numpy(t: torch.Tensor) -> npt.NDArray[np.generic]:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # demb-io stores bfloat16 as its uint16 words
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: npt.NDArray[np.generic], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def index_words(
    t: ModelTable, scores: torch.Tensor, ages: Sequence[int] = (), current: int = 0
) -> torch.Tensor:
    """``(W, n)`` int64 index score words (the index's words: its widest table's) of table
    ``t``'s ``(n, C)`` score columns in its ``score_strategy`` order, on their device; the
    columns ``ages`` hold ages, turned back into scores ``current - age``."""
    tables = t.module.tables
    layout = tables.configs[t.index].score_layout
    words = torch.zeros(
        (tables.index.score_words, scores.shape[0]), dtype=torch.int64, device=scores.device
    )
    for c, word in enumerate(layout.index_words):
        if c in ages:
            torch.sub(current, scores[:, c], out=words[word])
        else:
            words[word] = scores[:, c]
    return words
