"""Model-level checkpoint loads (spec: ``DynamicEmbLoad``): a load reads every shard of a
table, keeps the keys this rank owns under the model's own world size and ``dist_type``, and
inserts them, so a checkpoint loads into any world size; it is all or nothing. Into an empty
table of the checkpoint's own layout (capacity, bucket width, world size, ``dist_type``) each
key goes back to the slot it was dumped from, so the table equals the dumped one slot for slot
(and deltas taken after the dump replay onto it exactly)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from demb_io import Checkpoint, FormatError, ShardData, ShardMeta, iter_shard
from demb_planner import owner_rank
from demb_storage import SlotWrites, TableConfigError
from torch import nn

from demb_torchrec._counters import (
    CounterRows,
    admit_calls,
    counter_rows,
    load_calls,
    load_counter,
    restore_calls,
    restore_counter,
)
from demb_torchrec.errors import ConfigError
from demb_torchrec.model_tables import (
    ModelTable,
    TableNames,
    check_group,
    dtype_name,
    dynamic_tables,
    from_numpy,
    index_words,
    is_caching,
    process_group,
    select_tables,
)

__all__ = ["DynamicEmbLoad", "assign_rows"]


def _check_layout(t: ModelTable, meta: ShardMeta, optim: bool) -> None:
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


def _same_slots(t: ModelTable, metas: list[ShardMeta]) -> ShardMeta | None:
    """This rank's shard when the checkpoint's slots apply to table ``t`` as it is now: it is
    empty, and its capacity, bucket width, world size and ``dist_type`` are the checkpoint's
    (so this rank's keys are exactly its shard's, each in its home bucket here too)."""
    tables = t.module.tables
    if tables.size(t.index) != 0:
        return None
    layout = (tables.capacity(t.index), tables.index.bucket_width_list[t.index])
    mine = [m for m in metas if m.rank == t.rank]
    if len(mine) != 1 or any(
        m.slot_layout is None or tuple(m.slot_layout) != layout
        or m.world_size != t.world_size or m.dist_type != t.dist_type
        for m in metas
    ):  # fmt: skip
        return None
    return mine[0]


def _load_table(
    ckpt: Checkpoint,
    t: ModelTable,
    metas: list[ShardMeta],
    optim: bool,
    chunk_rows: int,
    counter: bool,
) -> None:
    """Insert the keys this rank owns from the table's shards ``metas`` (layout checked); into
    an empty table of the checkpoint's layout, at the slots they were dumped from. With
    ``counter``, the table's admission counter is replaced by the checkpoint's (its keys this
    rank owns)."""
    tables = t.module.tables
    config = tables.configs[t.index]
    folder = ckpt.path / t.collection
    block = t.block_size()
    initial = t.module.initial_states[t.index]
    own = None if is_caching(t) else _same_slots(t, metas)
    counters: list[CounterRows] = []
    for meta in [own] if own is not None else metas:
        for chunk in _iter(folder, meta, chunk_rows, dtype_name(config.dtype), config.dim):
            if chunk.admit_keys is not None and chunk.admit_counts is not None:
                counters.append((chunk.admit_keys, chunk.admit_counts))
            mine = owner_rank(chunk.keys, t.world_size, t.dist_type, block) == t.rank
            if not mine.any():
                continue
            keys = torch.from_numpy(chunk.keys[mine]).to(tables.device)
            scores = torch.from_numpy(chunk.scores[mine]).to(tables.device)
            rows = from_numpy(chunk.values[mine], config.dtype)
            if config.state_dim:
                if optim and chunk.state is not None:
                    state = from_numpy(chunk.state[mine], config.dtype)
                else:
                    assert initial is not None
                    state = initial.to(config.dtype).cpu().expand(rows.shape[0], -1)
                rows = torch.cat([rows, state], dim=1)
            if own is not None and chunk.slots is not None:
                slots = torch.from_numpy(chunk.slots[mine]).to(tables.device)
                _assign_at(t, keys, slots, scores, rows, folder)
            else:
                assign_rows(t, keys, scores, rows)
    if counter:
        load_counter(t, metas, counters)
        load_calls(t, metas)


def _assign_at(
    t: ModelTable,
    keys: torch.Tensor,
    slots: torch.Tensor,
    scores: torch.Tensor,
    rows: torch.Tensor,
    folder: Path,
) -> None:
    """Write ``keys`` of table ``t`` at their ``slots`` (each checked against its key's home
    bucket first) with their score columns and full rows."""
    tables = t.module.tables
    try:
        writes = SlotWrites.check(tables, t.index, keys, slots)
    except TableConfigError as err:
        raise FormatError(
            folder, "slots", f"table {t.name}: not slots of its keys in this layout ({err})"
        ) from None
    writes.apply(index_words(t, scores))
    tables.write(t.index, writes.slots, rows)


def assign_rows(
    t: ModelTable, keys: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor
) -> None:
    """Insert or overwrite ``keys`` of table ``t`` with their ``(n, C)`` score columns (the
    table's ``score_strategy`` order) and full rows (embedding and optimizer state)."""
    tables = t.module.tables
    words = index_words(t, scores)
    if t.module.cache is not None and is_caching(t):  # into the storage tier
        t.module.cache.assign(t.index, keys, words, rows)
        return
    values: list[torch.Tensor | None] = [None] * tables.num_tables
    values[t.index] = rows.to(tables.values[t.index].device)
    tables.insert_or_assign(keys, torch.full_like(keys, t.index), words, values)


class _Kept:
    """What a table holds before a load (its export, when it holds anything), put back by
    :meth:`restore` when the load fails: a load is all or nothing."""

    def __init__(self, t: ModelTable, counter: bool) -> None:
        self.table = t
        held = t.module.tables.export(t.index)
        if t.module.cache is not None and is_caching(t):  # and the rows below the cache
            held = t.module.cache.export(t.index)
        self.rows = held if held.keys.numel() else None
        self.counter = counter_rows(t) if counter else None
        self.calls = admit_calls(t) if counter else None

    def restore(self) -> None:
        """The table emptied, then its kept rows inserted again (keys, rows and scores); its
        admission counter as it was."""
        t = self.table
        t.module.tables.clear(t.index)
        if t.module.cache is not None and is_caching(t):
            t.module.cache.clear_storage(t.index)
        if self.rows is not None:
            assign_rows(t, self.rows.keys, self.rows.scores, self.rows.values)
        restore_counter(t, self.counter)
        restore_calls(t, self.calls)


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
    counter: bool = True,
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
        counter: also replace each table's admission counter by the checkpoint's (tables with
            frequency admission; a checkpoint without counters warns once per table and leaves
            the counter empty: counts start from zero). False leaves the counters as they are.
        chunk_rows: rows read at a time (memory).

    Raises:
        demb_io.FormatError: not a checkpoint; a missing collection or table; a corrupted,
            truncated or mis-sized file; an ``embedding_dim`` other than the table's.
        ValueError: a name in ``table_names`` the model lacks; another ``score_strategy``
            order; ``optim=True`` without (matching) optimizer state in the checkpoint.
    """
    group = process_group(pg)
    tables = select_tables(dynamic_tables(model), table_names)
    check_group(group, tables)
    ckpt = Checkpoint(path)
    shards = [ckpt.shards(t.collection, t.name) for t in tables]
    for t, metas in zip(tables, shards, strict=True):  # every table checked before any write
        _check_layout(t, metas[0], optim)
    with torch.no_grad():
        kept = [_Kept(t, counter) for t in tables]
        try:
            for t, metas in zip(tables, shards, strict=True):
                _load_table(ckpt, t, metas, optim, chunk_rows, counter)
        except BaseException:  # a bad shard (size, CRC, values) found mid-load: undo it all
            for k in kept:
                k.restore()
            raise
    if group is not None:
        dist.barrier(group=group)
