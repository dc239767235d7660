"""Model-level checkpoints of dynamic tables (spec: ``DynamicEmbDump`` / ``DynamicEmbLoad``),
written and read through demb-io's checkpoint format.

A checkpoint is one directory with a folder per embedding collection (the collection's module
path in the model, DistributedModelParallel's wrapper left out) and, per dynamic table and rank,
the files of :mod:`demb_io.shard`: keys, values at the table's ``embedding_dtype``, optimizer
state with ``optim=True``, and scores in the table's ``score_strategy`` order. Every rank writes
its shards into one staging directory that rank 0 commits atomically once all ranks are done, so
a failed dump leaves the previous checkpoint whole. A load reads every shard of a table, keeps
the keys this rank owns under the model's own world size and ``dist_type``, and inserts them:
a checkpoint loads into any world size.

The dynamic tables are those of TorchRec collections sharded by the dynamic-table sharders and
any :class:`~demb_torchrec.DynamicEmbeddingTables` module of the model (a rank of its own). A
collection that is the model itself is named ``model``.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch
import torch.distributed as dist
from demb_io import (
    Checkpoint,
    ShardData,
    ShardMeta,
    ShardWriter,
    commit_checkpoint,
    iter_shard,
    staging_path,
)
from demb_planner import continuous_block_size, owner_rank
from torch import nn

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.errors import CheckpointError, ConfigError

__all__ = ["DynamicEmbDump", "DynamicEmbLoad", "dynamic_tables"]

_CHUNK_SLOTS = 1 << 20
_WRAPPER = "_dmp_wrapped_module"  # DistributedModelParallel's
_ROOT = "model"  # the collection name of a model that is itself a collection
TableNames = Mapping[str, Sequence[str]] | Sequence[str] | None


@dataclass(frozen=True)
class _Table:
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


def dynamic_tables(model: nn.Module) -> list[_Table]:
    """Every dynamic table of ``model`` on this rank, by collection then table."""
    from demb_torchrec.lookup import DynamicEmbeddingKernel
    from demb_torchrec.sharders import (
        ShardedDynamicEmbeddingBagCollection,
        ShardedDynamicEmbeddingCollection,
    )

    found: list[_Table] = []
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
                        found.append(_Table(name, kernel.tables, t, env.rank, env.world_size, n))
        elif isinstance(m, DynamicEmbeddingTables):
            found += [_Table(name, m, t, 0, 1, None) for t in range(m.num_tables)]
    return found


def _select(tables: list[_Table], table_names: TableNames) -> list[_Table]:
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


def _group(pg: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if not dist.is_available() or not dist.is_initialized():
        if pg is not None:
            raise ConfigError("pg: given, but torch.distributed is not initialized")
        return None
    return pg if pg is not None else dist.group.WORLD


def _check_group(group: dist.ProcessGroup | None, tables: list[_Table]) -> None:
    size = 1 if group is None else group.size()
    for t in tables:
        if t.world_size > 1 and t.world_size != size:
            raise ConfigError(
                f"pg: {size} ranks, but table {t.collection}/{t.name} is sharded over "
                f"{t.world_size}; every rank of the sharding takes part in a dump or load"
            )


def _gather_errors(group: dist.ProcessGroup | None, error: BaseException | None) -> list[str]:
    """Every rank's error (as text), gathered over ``group``."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if group is None:
        return [] if mine is None else [mine]
    errors: list[str | None] = [None] * group.size()
    dist.all_gather_object(errors, mine, group=group)
    return [e for e in errors if e is not None]


def _numpy(t: torch.Tensor) -> npt.NDArray[np.generic]:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # demb-io stores bfloat16 as its uint16 words
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _torch(a: npt.NDArray[np.generic], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meta(t: _Table, optim: bool) -> ShardMeta:
    config = t.module.tables.configs[t.index]
    layout = config.score_layout
    spec = t.module.optimizer
    return ShardMeta(
        collection=t.collection,
        table=t.name,
        rank=t.rank,
        world_size=t.world_size,
        dist_type=t.dist_type,
        embedding_dtype=_dtype_name(config.dtype),
        embedding_dim=config.dim,
        rows=-1,
        score_strategy=tuple(c.name for c in layout.columns),
        optimizer=spec.kind.value,
        optim_state_dtype=_dtype_name(config.dtype) if optim and config.state_dim else None,
        state_width=config.state_dim if optim else 0,
        hyper_parameters=spec.hyper_parameters(),
        num_embeddings=t.num_embeddings,
    )


def _chunks(t: _Table, optim: bool) -> Iterator[ShardData]:
    """The table's rows, a slot range at a time."""
    tables = t.module.tables
    dim = tables.configs[t.index].dim
    capacity = tables.capacity(t.index)
    for begin in range(0, capacity, _CHUNK_SLOTS):
        ex = tables.export(t.index, begin, min(capacity, begin + _CHUNK_SLOTS))
        yield ShardData(
            keys=_numpy(ex.keys).astype(np.int64, copy=False),
            values=_numpy(ex.values[:, :dim]),
            scores=_numpy(ex.scores).astype(np.int64, copy=False),
            state=_numpy(ex.values[:, dim:]) if optim and ex.values.shape[1] > dim else None,
        )


def DynamicEmbDump(  # noqa: N802 (the spec's name)
    path: str | Path,
    model: nn.Module,
    table_names: TableNames = None,
    optim: bool = False,
    pg: dist.ProcessGroup | None = None,
) -> None:
    """Write the model's dynamic tables (every rank's rows) to the checkpoint ``path``.

    Collective over ``pg`` (default: the world group, if ``torch.distributed`` is
    initialized): every rank calls it. ``path`` is replaced atomically once every rank has
    written its shards; on any rank's error no rank commits and every rank raises.

    Args:
        path: the checkpoint directory (created or replaced).
        model: holds the tables (a DistributedModelParallel model, a sharded collection, or
            any module with :class:`DynamicEmbeddingTables`).
        table_names: ``{collection: [table, ...]}`` (or table names) to dump; default all.
        optim: also write each key's optimizer state.
        pg: the process group of the dump's collectives (all ranks the tables are sharded
            over).

    Raises:
        ValueError: a name in ``table_names`` the model lacks; a ``pg`` smaller than a
            table's sharding.
        RuntimeError: writing failed on some rank (the message holds every rank's error).
    """
    group = _group(pg)
    tables = _select(dynamic_tables(model), table_names)
    _check_group(group, tables)
    target = Path(path)
    rank = 0 if group is None else dist.get_rank(group)
    staged = [staging_path(target.absolute())]
    if group is not None:
        dist.broadcast_object_list(staged, src=dist.get_global_rank(group, 0), group=group)
    error: BaseException | None = None
    if rank == 0:
        try:
            target.absolute().parent.mkdir(parents=True, exist_ok=True)
            staged[0].mkdir()
        except OSError as err:
            error = err
    if group is not None:
        dist.barrier(group=group)
    if error is None:
        try:
            for t in tables:
                folder = staged[0] / t.collection
                folder.mkdir(exist_ok=True)
                ShardWriter(folder, _meta(t, optim)).write_all(_chunks(t, optim))
        except Exception as err:  # every rank must reach the gather below
            error = err
    errors = _gather_errors(group, error)
    if rank == 0:
        if errors:
            shutil.rmtree(staged[0], ignore_errors=True)
        else:
            commit_checkpoint(staged[0], target)
    if group is not None:
        dist.barrier(group=group)
    if errors:
        raise CheckpointError(f"DynamicEmbDump to {target}: {'; '.join(errors)}") from error


def _check_layout(t: _Table, meta: ShardMeta, optim: bool) -> None:
    """A checkpoint table that ``t`` can take (the dtype is converted by the reader)."""
    where = f"{t.collection}/{t.name}"
    config = t.module.tables.configs[t.index]
    columns = tuple(c.name for c in config.score_layout.columns)
    if tuple(meta.score_strategy) != columns:
        raise ConfigError(
            f"{where}: the checkpoint scores {meta.score_strategy}, the table {columns} "
            "(a checkpoint loads only into tables of the same score_strategy order)"
        )
    if not optim:
        return
    kind = t.module.optimizer.kind.value
    if meta.state_width == 0 and config.state_dim:
        raise ConfigError(f"{where}: optim=True, but the checkpoint holds no optimizer state")
    if meta.optimizer != kind or meta.state_width != config.state_dim:
        raise ConfigError(
            f"{where}: optim=True, but the checkpoint's optimizer state is {meta.optimizer!r} "
            f"({meta.state_width} wide) and the table's {kind!r} ({config.state_dim} wide)"
        )


def _load_table(
    ckpt: Checkpoint, t: _Table, metas: list[ShardMeta], optim: bool, chunk_rows: int
) -> None:
    """Insert the keys this rank owns from the table's shards ``metas`` (layout checked)."""
    tables = t.module.tables
    config = tables.configs[t.index]
    folder = ckpt.path / t.collection
    block = t.block_size()
    initial = t.module.initial_states[t.index]
    for meta in metas:
        for chunk in _iter(folder, meta, chunk_rows, _dtype_name(config.dtype), config.dim):
            mine = owner_rank(chunk.keys, t.world_size, t.dist_type, block) == t.rank
            if not mine.any():
                continue
            keys = torch.from_numpy(chunk.keys[mine]).to(tables.device)
            scores = torch.from_numpy(chunk.scores[mine]).to(tables.device)
            rows = _torch(chunk.values[mine], config.dtype)
            if config.state_dim:
                if optim and chunk.state is not None:
                    state = _torch(chunk.state[mine], config.dtype)
                else:
                    assert initial is not None
                    state = initial.to(config.dtype).cpu().expand(rows.shape[0], -1)
                rows = torch.cat([rows, state], dim=1)
            _assign(t, keys, scores, rows)


def _assign(t: _Table, keys: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor) -> None:
    """Insert or overwrite ``keys`` of table ``t`` with their ``(n, C)`` score columns (the
    table's ``score_strategy`` order) and full rows (embedding and optimizer state)."""
    tables = t.module.tables
    layout = tables.configs[t.index].score_layout
    width = tables.index.scores.shape[0]  # the index's words: its widest table's
    words = torch.zeros((width, keys.numel()), dtype=torch.int64, device=keys.device)
    for c, word in enumerate(layout.index_words):
        words[word] = scores[:, c]
    values: list[torch.Tensor | None] = [None] * tables.num_tables
    values[t.index] = rows.to(tables.values[t.index].device)
    tables.insert_or_assign(keys, torch.full_like(keys, t.index), words, values)


class _Kept:
    """What a table holds before a load (its export, when it holds anything), put back by
    :meth:`restore` when the load fails: a load is all or nothing."""

    def __init__(self, t: _Table) -> None:
        self.table = t
        held = t.module.tables.export(t.index)
        self.rows = held if held.keys.numel() else None

    def restore(self) -> None:
        """The table emptied, then its kept rows inserted again (keys, rows and scores)."""
        t = self.table
        t.module.tables.clear(t.index)
        if self.rows is not None:
            _assign(t, self.rows.keys, self.rows.scores, self.rows.values)


def _iter(
    folder: Path, meta: ShardMeta, chunk_rows: int, dtype: str, dim: int
) -> Iterator[ShardData]:
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # a converted precision warns once per shard
        yield from iter_shard(folder, meta, chunk_rows, expect_dtype=dtype, expect_dim=dim)


def DynamicEmbLoad(  # noqa: N802 (the spec's name)
    path: str | Path,
    model: nn.Module,
    table_names: TableNames = None,
    optim: bool = False,
    pg: dist.ProcessGroup | None = None,
    *,
    chunk_rows: int = 1 << 20,
) -> None:
    """Insert the rows of checkpoint ``path`` that this rank owns into the model's dynamic
    tables (existing keys are overwritten, others kept). All or nothing: when a shard turns out
    bad mid-load (a size or CRC that does not match), every table is put back as it was (the
    rows a table held before the load are kept aside until it completes). The checkpoint may
    come from any world size: ownership is recomputed from each key with the model's world size
    and each table's ``dist_type``. Values stored at another precision are converted, with a
    warning.

    Collective over ``pg`` (a barrier at the end), like :func:`DynamicEmbDump`.

    Args:
        path: a checkpoint written by :func:`DynamicEmbDump` (or demb-io).
        model: holds the tables (see :func:`DynamicEmbDump`).
        table_names: ``{collection: [table, ...]}`` (or table names) to load; default all.
        optim: also load each key's optimizer state (else new keys get the optimizer's
            initial state).
        pg: the process group of the load's barrier.
        chunk_rows: rows read at a time (memory).

    Raises:
        demb_io.FormatError: not a checkpoint; a missing collection or table; a corrupted,
            truncated or mis-sized file; an ``embedding_dim`` other than the table's.
        ValueError: a name in ``table_names`` the model lacks; another ``score_strategy``
            order; ``optim=True`` without (matching) optimizer state in the checkpoint.
    """
    group = _group(pg)
    tables = _select(dynamic_tables(model), table_names)
    _check_group(group, tables)
    ckpt = Checkpoint(path)
    shards = [ckpt.shards(t.collection, t.name) for t in tables]
    for t, metas in zip(tables, shards, strict=True):  # every table checked before any write
        _check_layout(t, metas[0], optim)
    with torch.no_grad():
        kept = [_Kept(t) for t in tables]
        try:
            for t, metas in zip(tables, shards, strict=True):
                _load_table(ckpt, t, metas, optim, chunk_rows)
        except BaseException:  # a bad shard (size, CRC, values) found mid-load: undo it all
            for k in kept:
                k.restore()
            raise
    if group is not None:
        dist.barrier(group=group)
