"""Model-level checkpoints of dynamic tables (spec: ``DynamicEmbDump``), written through
demb-io's checkpoint format (:mod:`demb_torchrec.load` reads them back).

A checkpoint is one directory with a folder per embedding collection
(:mod:`demb_torchrec.model_tables`) and, per dynamic table and rank, the files of
:mod:`demb_io.shard`: keys, values at the table's ``embedding_dtype``, optimizer state with
``optim=True``, and scores in the table's ``score_strategy`` order. Every rank writes its shards
into one staging directory that rank 0 commits atomically once all ranks are done, so a failed
dump leaves the previous checkpoint whole. A non-blocking dump copies the tables on their device
and writes from the copy in a thread.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, overload

import numpy as np
import torch
import torch.distributed as dist
from demb_io import ShardData, ShardMeta, ShardWriter, commit_checkpoint, staging_path
from demb_storage import TableExport
from torch import nn

from demb_torchrec._background import DumpHandle
from demb_torchrec._counters import (
    CounterRows,
    admit_calls,
    attach_counter,
    counter_rows,
    with_counter,
)
from demb_torchrec._snapshot import (
    TableSnapshot,
    background_reads,
    release_snapshot_memory,
    snapshots,
)
from demb_torchrec.errors import CheckpointError
from demb_torchrec.load import DynamicEmbLoad
from demb_torchrec.model_tables import (
    ModelTable,
    TableNames,
    check_group,
    dtype_name,
    dynamic_tables,
    gather_errors,
    is_caching,
    process_group,
    select_tables,
    to_numpy,
)

__all__ = [
    "DumpHandle",
    "DynamicEmbDump",
    "DynamicEmbLoad",
    "dynamic_tables",
    "release_snapshot_memory",
]

_CHUNK_SLOTS = 1 << 20


def _meta(t: ModelTable, optim: bool, capacity: int) -> ShardMeta:
    """The shard meta of table ``t`` with ``capacity`` slots (its rows carry their slots; a
    caching table's do not: its rows come from two tiers)."""
    config = t.module.tables.configs[t.index]
    layout = config.score_layout
    spec = t.module.optimizer
    return ShardMeta(
        collection=t.collection,
        table=t.name,
        rank=t.rank,
        world_size=t.world_size,
        dist_type=t.dist_type,
        embedding_dtype=dtype_name(config.dtype),
        embedding_dim=config.dim,
        rows=-1,
        score_strategy=tuple(c.name for c in layout.columns),
        optimizer=spec.kind.value,
        optim_state_dtype=dtype_name(config.dtype) if optim and config.state_dim else None,
        state_width=config.state_dim if optim else 0,
        hyper_parameters=spec.hyper_parameters(),
        num_embeddings=t.num_embeddings,
        slot_layout=None
        if is_caching(t)
        else (capacity, t.module.tables.index.bucket_width_list[t.index]),
    )


def _on_host(ex: TableExport) -> TableExport:
    """An export of a CUDA table copied into pinned host memory (queued on the current stream,
    then that stream synchronized); a CPU export as it is.

    A pageable device-to-host copy is staged by the driver, which stalls the CUDA calls of the
    other threads while it runs: a training thread beside a background dump then saw some of
    its steps take several times as long. Pinned copies do not stall it (and run at the bus's
    full speed); the caching host allocator reuses their memory from chunk to chunk."""
    if not ex.keys.is_cuda:
        return ex

    def pinned(t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)

    state = None if ex.state is None else pinned(ex.state)
    host = TableExport(pinned(ex.keys), pinned(ex.scores), ex.slots, pinned(ex.values), state)
    torch.cuda.current_stream(ex.keys.device).synchronize()
    return host


def _shard_data(ex: TableExport, dim: int, optim: bool, slots: bool = True) -> ShardData:
    """One chunk of a shard: an export's keys, embeddings, scores (and optimizer state, and
    with ``slots`` its slots), read on the host (:func:`_on_host`)."""
    ex = _on_host(ex)
    if ex.state is not None:  # exported split at dim: both halves contiguous
        values, state = ex.values, ex.state if optim else None
    else:
        values = ex.values[:, :dim]
        state = ex.values[:, dim:] if optim and ex.values.shape[1] > dim else None
    return ShardData(
        keys=to_numpy(ex.keys).astype(np.int64, copy=False),
        values=to_numpy(values),
        scores=to_numpy(ex.scores).astype(np.int64, copy=False),
        state=None if state is None else to_numpy(state),
        slots=to_numpy(ex.slots).astype(np.int64, copy=False) if slots else None,
    )


def _chunks(t: ModelTable, optim: bool) -> Iterator[ShardData]:
    """The table's rows, a slot range at a time."""
    tables = t.module.tables
    dim = tables.configs[t.index].dim
    if is_caching(t):
        yield from _tier_chunks(t, optim)
        return
    capacity = tables.capacity(t.index)
    split = _split(dim, tables.values[t.index])
    for begin in range(0, capacity, _CHUNK_SLOTS):
        ex = tables.export(t.index, begin, min(capacity, begin + _CHUNK_SLOTS), split=split)
        yield _shard_data(ex, dim, optim)


def _tier_chunks(t: ModelTable, optim: bool) -> Iterator[ShardData]:
    """The rows of caching table ``t``: its cache's, then its storage's (without slots)."""
    cache = t.module.cache
    assert cache is not None
    cache.settle()
    tables = t.module.tables
    config = tables.configs[t.index]
    ex = tables.export(t.index)
    if ex.keys.numel():
        yield _shard_data(ex, config.dim, optim, slots=False)
    for chunk in cache.storage_chunks(t.index, _CHUNK_SLOTS):
        yield _shard_data(chunk, config.dim, optim, slots=False)


def _snapshot_chunks(snap: TableSnapshot, t: ModelTable, optim: bool) -> Iterator[ShardData]:
    """The rows table ``t`` held at the snapshot ``snap``, a slot range at a time."""
    dim = snap.configs[t.index].dim
    capacity = snap.capacity(t.index)
    split = _split(dim, snap.values[t.index])
    for begin in range(0, capacity, _CHUNK_SLOTS):
        ex = snap.export(t.index, begin, min(capacity, begin + _CHUNK_SLOTS), split=split)
        yield _shard_data(ex, dim, optim)


def _split(dim: int, values: torch.Tensor) -> int | None:
    """Where an export of ``values`` splits its rows: the embedding columns, then the optimizer
    state (each gathered contiguous, as the shard writes them); None without state."""
    return dim if values.shape[1] > dim else None


def _write_shard(folder: Path, meta: ShardMeta, chunks: Iterator[ShardData]) -> None:
    """Write one table's shard of this rank into the collection's ``folder`` of the staging
    directory (made if missing)."""
    folder.mkdir(exist_ok=True)
    ShardWriter(folder, meta).write_all(chunks)


def _stage(
    group: dist.ProcessGroup | None, rank: int, target: Path
) -> tuple[Path, BaseException | None]:
    """The staging directory of a dump to ``target`` (rank 0's, broadcast), made by rank 0,
    and this rank's error making it (a barrier after)."""
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
    return staged[0], error


def _finish(
    group: dist.ProcessGroup | None,
    rank: int,
    staged: Path,
    target: Path,
    error: BaseException | None,
) -> None:
    """After every rank wrote its shards (or failed): gather the errors, rank 0 commits the
    staging directory to ``target`` (or removes it on any error), a barrier, and every rank
    raises :class:`CheckpointError` when some rank failed."""
    errors = gather_errors(group, error)
    if rank == 0:
        if errors:
            shutil.rmtree(staged, ignore_errors=True)
        else:
            commit_checkpoint(staged, target)
    if group is not None:
        dist.barrier(group=group)
    if errors:
        raise CheckpointError(f"DynamicEmbDump to {target}: {'; '.join(errors)}") from error


@overload
def DynamicEmbDump(
    path: str | Path,
    model: nn.Module,
    table_names: TableNames = ...,
    optim: bool = ...,
    pg: dist.ProcessGroup | None = ...,
    *,
    counter: bool = ...,
    blocking: Literal[True] = ...,
) -> None: ...


@overload
def DynamicEmbDump(
    path: str | Path,
    model: nn.Module,
    table_names: TableNames = ...,
    optim: bool = ...,
    pg: dist.ProcessGroup | None = ...,
    *,
    counter: bool = ...,
    blocking: Literal[False],
) -> DumpHandle: ...


@overload
def DynamicEmbDump(
    path: str | Path,
    model: nn.Module,
    table_names: TableNames = ...,
    optim: bool = ...,
    pg: dist.ProcessGroup | None = ...,
    *,
    counter: bool = ...,
    blocking: bool,
) -> DumpHandle | None: ...


def DynamicEmbDump(  # noqa: N802 (the spec's name)
    path: str | Path,
    model: nn.Module,
    table_names: TableNames = None,
    optim: bool = False,
    pg: dist.ProcessGroup | None = None,
    *,
    counter: bool = True,
    blocking: bool = True,
) -> DumpHandle | None:
    """Write the model's dynamic tables (every rank's rows) to the checkpoint ``path``.

    Collective over ``pg`` (default: the world group, if ``torch.distributed`` is
    initialized): every rank calls it. ``path`` is replaced atomically once every rank has
    written its shards; on any rank's error no rank commits and every rank raises.

    With ``blocking=False`` the call copies the selected tables (their index and value rows,
    on their device: on CUDA queued on the current stream, no host transfer) and returns a
    :class:`DumpHandle` at once; a background thread writes this rank's shards from that copy
    (on CUDA on a side stream that waits for the copy) while training goes on, and the
    checkpoint holds exactly the tables as they were at the call. ``handle.done()`` says
    whether this rank's thread has finished writing; ``handle.wait()`` waits for it, then
    commits as the blocking call does: it is collective over ``pg``, so every rank must call
    it (and must not start another collective on ``pg`` that another rank could run before
    its ``wait()``: keep the calls in the same order on every rank), and it raises
    :class:`CheckpointError` when some rank failed. A second ``wait()`` returns at once (or
    raises the same error). A handle dropped without ``wait()`` commits nothing: the staging
    directory stays behind. The copy costs the tables' memory again until the thread is done
    (without ``optim``, only the embedding columns of the value rows are copied); on the CPU
    that memory is then kept for the next non-blocking dump (the call copies into it instead of
    into fresh pages) until :func:`release_snapshot_memory`. A caching table (its rows in a
    cache and a storage) is written before the call returns; the others in the background.

    Args:
        path: the checkpoint directory (created or replaced).
        model: holds the tables (a DistributedModelParallel model, a sharded collection, or
            any module with :class:`DynamicEmbeddingTables`).
        table_names: ``{collection: [table, ...]}`` (or table names) to dump; default all.
        optim: also write each key's optimizer state.
        pg: the process group of the dump's collectives (all ranks the tables are sharded
            over).
        counter: also write each table's admission counter (the keys waiting to be admitted
            and their counts; tables with frequency admission), taken at the call.
        blocking: write before returning (None); False: write in the background and return
            the :class:`DumpHandle`.

    Raises:
        ValueError: a name in ``table_names`` the model lacks; a ``pg`` smaller than a
            table's sharding.
        RuntimeError: writing failed on some rank (the message holds every rank's error);
            from ``wait()`` with ``blocking=False``.
    """
    group = process_group(pg)
    tables = select_tables(dynamic_tables(model), table_names)
    check_group(group, tables)
    target = Path(path)
    rank = 0 if group is None else dist.get_rank(group)
    staged, error = _stage(group, rank, target)
    if not blocking:
        return _dump_in_background(group, rank, staged, target, tables, optim, counter, error)
    if error is None:
        try:
            for t in tables:
                rows = counter_rows(t) if counter else None
                _write_shard(
                    staged / t.collection,
                    with_counter(
                        _meta(t, optim, t.module.tables.capacity(t.index)),
                        rows,
                        admit_calls(t) if counter else None,
                    ),
                    attach_counter(_chunks(t, optim), rows),
                )
        except Exception as err:  # every rank must reach the gather below
            error = err
    _finish(group, rank, staged, target, error)
    return None


def _dump_in_background(
    group: dist.ProcessGroup | None,
    rank: int,
    staged: Path,
    target: Path,
    tables: list[ModelTable],
    optim: bool,
    counter: bool,
    error: BaseException | None,
) -> DumpHandle:
    """The non-blocking dump after the staging directory was made: snapshot ``tables`` now,
    write their shards from the snapshot into ``staged`` in a thread, commit in ``wait()``."""

    def finish(failed: BaseException | None) -> None:
        _finish(group, rank, staged, target, failed)

    def job(
        t: ModelTable, meta: ShardMeta, rows: CounterRows | None
    ) -> Callable[[TableSnapshot], None]:
        folder = staged / t.collection
        return lambda snap: _write_shard(
            folder, with_counter(meta, rows), attach_counter(_snapshot_chunks(snap, t, optim), rows)
        )

    def failure() -> None:  # rank 0 could not stage, or the snapshot failed: wait() says so
        assert error is not None
        raise error

    if error is None:
        try:
            # A caching table's rows are in two tiers: written now, before the call returns.
            for t in [t for t in tables if is_caching(t)]:
                rows = counter_rows(t) if counter else None
                calls = admit_calls(t) if counter else None
                meta = with_counter(_meta(t, optim, t.module.tables.capacity(t.index)), rows, calls)
                _write_shard(staged / t.collection, meta, attach_counter(_chunks(t, optim), rows))
            tables = [t for t in tables if not is_caching(t)]
            metas = [  # the admitters' call counts at the call, like the counters
                with_counter(
                    _meta(t, optim, t.module.tables.capacity(t.index)),
                    None,
                    admit_calls(t) if counter else None,
                )
                for t in tables
            ]
            counts = [counter_rows(t) if counter else None for t in tables]
            snaps = snapshots([(t.module.tables, t.index) for t in tables], state=optim)
            jobs = [
                (id(t.module.tables), job(t, m, c))
                for t, m, c in zip(tables, metas, counts, strict=True)
            ]
            return DumpHandle(background_reads(snaps, jobs), finish, name="demb-dump")
        except Exception as err:  # (out of memory copying) every rank must reach the gather
            error = err
    return DumpHandle(failure, finish, name="demb-dump")
