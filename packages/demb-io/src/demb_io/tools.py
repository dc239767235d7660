"""Offline tools over checkpoints and deltas: merge deltas, apply a delta to a checkpoint,
reshard a checkpoint to another world size or dist type (exports are in ``export.py``). Each
writes its result atomically; inputs are never modified. Reshard and apply stream a table chunk
by chunk (one chunk and the delta in memory); merging delta directories holds one table of each
delta at a time.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
from demb_planner import continuous_block_size, owner_rank

from demb_io._errors import LayoutError
from demb_io.checkpoint import Checkpoint, CheckpointWriter
from demb_io.delta import DeltaMeta, DeltaTable, DeltaWriter, iter_delta
from demb_io.meta import ShardMeta
from demb_io.shard import ShardData

__all__ = ["apply_delta", "merge_delta_files", "merge_deltas", "reshard"]

_TIMESTAMP = "TIMESTAMP"


def _age_columns(strategy: Sequence[str]) -> list[int]:
    return [i for i, s in enumerate(strategy) if s == _TIMESTAMP]


def _take(table: DeltaTable, rows: npt.NDArray[np.bool_]) -> DeltaTable:
    return dataclasses.replace(
        table,
        keys=table.keys[rows],
        values=table.values[rows],
        scores=table.scores[rows],
        slots=table.slots[rows],
        state=None if table.state is None else table.state[rows],
    )


def _erased(
    old: DeltaTable, new: DeltaTable
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64] | None]:
    """The erased keys of both deltas, distinct, and with the slots of both (when both carry
    them) the slot of each key's latest erase."""
    keys = np.concatenate([old.erased, new.erased])
    if old.erased_slots is None or new.erased_slots is None:
        return np.unique(keys), None
    slots = np.concatenate([old.erased_slots, new.erased_slots])
    last = keys.size - 1 - np.unique(keys[::-1], return_index=True)[1]
    return keys[last], slots[last]


def _merge_two(old: DeltaTable, new: DeltaTable) -> DeltaTable:
    """``new`` after ``old``: later rows win; old rows whose key ``new`` erased or evicted, or
    whose slot a row of ``new`` holds, are gone."""
    name = f"{new.meta.collection}/{new.meta.table}"
    for field, value in new.meta.layout().items():
        if old.meta.layout()[field] != value:
            raise LayoutError(
                f"{name}: {field} differs between deltas ({old.meta.layout()[field]!r} "
                f"then {value!r})"
            )
    ages = _age_columns(old.meta.score_strategy)
    if ages and new.meta.current_score < old.meta.current_score:
        raise LayoutError(
            f"{name}: current_score goes back between deltas ({old.meta.current_score} then "
            f"{new.meta.current_score}): deltas out of order, or of another clock"
        )
    scores = old.scores.copy()
    for c in ages:  # ages were taken at old's current score
        scores[:, c] += new.meta.current_score - old.meta.current_score
    old = dataclasses.replace(old, scores=scores)
    # An old row is stale when its key was written, erased or evicted again, or when a newer
    # key holds its slot (the old key was evicted or moved, recorded or not). Not so in a
    # caching table (tiers > 1): a key that loses its cache slot moves to the storage below.
    gone = [new.keys, new.erased] + ([] if new.evicted is None else [new.evicted])
    taken = new.slots if len(new.meta.row_capacity) == 1 else new.slots[:0]
    kept = _take(old, ~np.isin(old.keys, np.concatenate(gone)) & ~np.isin(old.slots, taken))
    keys = np.concatenate([kept.keys, new.keys])
    erased, erased_slots = _erased(old, new)
    # An erase the merged rows undo is dropped; kept with its slot, which a replica clears.
    again = ~np.isin(erased, keys) if erased_slots is None else np.ones(erased.size, bool)
    evicted = None
    if old.evicted is not None or new.evicted is not None:
        parts = [e for e in (old.evicted, new.evicted) if e is not None]
        evicted = np.unique(np.concatenate(parts))
    return dataclasses.replace(
        new,
        keys=keys,
        values=np.concatenate([kept.values, new.values]),
        scores=np.concatenate([kept.scores, new.scores]),
        slots=np.concatenate([kept.slots, new.slots]),
        state=None if new.state is None else np.concatenate([kept.state, new.state]),
        erased=erased[again],
        erased_slots=None if erased_slots is None else erased_slots[again],
        evicted=evicted,
        meta=dataclasses.replace(
            new.meta,
            evicted_rows=None if evicted is None else 0,
            erased_slots=erased_slots is not None,
        ),
    )


def merge_deltas(deltas: Sequence[Sequence[DeltaTable]]) -> list[DeltaTable]:
    """Fold deltas, oldest first, into one that applies like all of them in order: a key's
    last row wins, erased keys leave (unless re-inserted later), timestamp ages are rebased to
    the newest delta's ``current_score``, retained evicted keys are united.

    Raises:
        LayoutError: a table whose layout (dtype, dim, scores, capacity, world size, ...)
            changes between deltas.
    """
    merged: dict[tuple[str, str], DeltaTable] = {}
    for delta in deltas:
        for table in delta:
            key = (table.meta.collection, table.meta.table)
            merged[key] = _merge_two(merged[key], table) if key in merged else table
    return [merged[k] for k in sorted(merged)]


def merge_delta_files(
    paths: Sequence[str | Path], target: str | Path, *, verify: bool = True
) -> list[DeltaMeta]:
    """:func:`merge_deltas` from delta directories (oldest first) into a new delta directory
    ``target``, table by table: memory holds one table of each delta at a time.

    Returns:
        The merged tables' metas as written.

    Raises:
        FormatError: a bad delta (named with its file and field).
        LayoutError: as :func:`merge_deltas`.
    """
    readers = [iter_delta(p, verify=verify) for p in paths]
    heads: list[DeltaTable | None] = [next(r, None) for r in readers]

    def name(t: DeltaTable) -> tuple[str, str]:
        return (t.meta.collection, t.meta.table)

    with DeltaWriter(target) as out:
        while any(h is not None for h in heads):
            first = min(name(h) for h in heads if h is not None)
            merged: DeltaTable | None = None
            for i, head in enumerate(heads):  # oldest first
                if head is None or name(head) != first:
                    continue
                merged = head if merged is None else _merge_two(merged, head)
                heads[i] = next(readers[i], None)
            assert merged is not None
            out.write(merged)
    return out.written


def _block(
    meta: ShardMeta, dist_type: str, world_size: int, num_embeddings: int | None
) -> int | None:
    if dist_type != "continuous":
        return None
    n = num_embeddings or meta.num_embeddings
    if n is None:
        raise LayoutError(
            f"{meta.collection}/{meta.table}: dist_type 'continuous' needs num_embeddings (not "
            "in the meta; pass it)"
        )
    return continuous_block_size(n, world_size)


class _RoutedTable:
    """One table's new shards, open together: chunks are split by the ownership rule and
    appended to their ranks' shards (memory: one chunk). The new shards have no slots
    (``slot_layout`` None, no ``slots`` part, whatever the template's): a row routed to
    another rank, or upserted, has no slot in the table it will be loaded into."""

    def __init__(self, writer: CheckpointWriter, template: ShardMeta, block: int | None) -> None:
        self.template = template = dataclasses.replace(template, slot_layout=None)
        self.block = block
        self.shards = [
            writer.open_shard(dataclasses.replace(template, rank=rank))
            for rank in range(template.world_size)
        ]

    def owners(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        t = self.template
        return owner_rank(keys, t.world_size, t.dist_type, self.block)

    def append(self, rows: ShardData) -> None:
        """Each row (and admission counter) to the rank that owns its key, in order."""
        owners = self.owners(rows.keys)
        admit_keys, admit_counts = rows.admit_keys, rows.admit_counts
        admit = None if admit_keys is None else self.owners(admit_keys)
        for rank, shard in enumerate(self.shards):
            mine = owners == rank
            chunk = ShardData(
                rows.keys[mine],
                rows.values[mine],
                rows.scores[mine],
                None if rows.state is None else rows.state[mine],
            )
            if admit is not None and admit_keys is not None and admit_counts is not None:
                chunk.admit_keys = admit_keys[admit == rank]
                chunk.admit_counts = admit_counts[admit == rank]
            if chunk.rows or chunk.admit_keys is not None:
                shard.append(chunk)

    def close(self) -> None:
        for shard in self.shards:
            shard.close()


def reshard(
    source: str | Path,
    target: str | Path,
    world_size: int,
    dist_type: str,
    *,
    num_embeddings: int | None = None,
    chunk_rows: int = 1 << 20,
) -> None:
    """Write ``source`` re-sharded over ``world_size`` ranks by ``dist_type`` (demb-planner's
    ownership rule) into ``target``, chunk by chunk (memory: one chunk); rows keep their source
    order within each new rank. The output has no slots (``slot_layout`` None): a row's slot
    belongs to the table of its source rank.

    Args:
        num_embeddings: for ``continuous``, the table size its block size comes from (default:
            each table's meta).
        chunk_rows: rows read at a time.
    """
    ckpt = Checkpoint(source)
    with CheckpointWriter(target) as writer:
        for collection in ckpt.collections():
            for table in ckpt.tables(collection):
                first = ckpt.shards(collection, table)[0]
                template = dataclasses.replace(
                    first,
                    world_size=world_size,
                    dist_type=dist_type,
                    num_embeddings=num_embeddings or first.num_embeddings,
                )
                routed = _RoutedTable(
                    writer, template, _block(template, dist_type, world_size, num_embeddings)
                )
                for _, chunk in ckpt.iter_table(collection, table, chunk_rows):
                    routed.append(chunk)
                routed.close()


def _check_apply(meta: ShardMeta, delta: DeltaTable) -> None:
    d = delta.meta
    name = f"{meta.collection}/{meta.table}"
    for field in ("embedding_dtype", "embedding_dim", "state_width", "optim_state_dtype"):
        if getattr(meta, field) != getattr(d, field):
            raise LayoutError(
                f"{name}: {field} is {getattr(meta, field)!r} in the checkpoint, "
                f"{getattr(d, field)!r} in the delta"
            )
    if tuple(meta.score_strategy) != tuple(d.score_strategy):
        raise LayoutError(
            f"{name}: score_strategy is {meta.score_strategy} in the checkpoint, "
            f"{d.score_strategy} in the delta"
        )


def apply_delta(
    source: str | Path,
    deltas: Sequence[DeltaTable],
    target: str | Path,
    *,
    chunk_rows: int = 1 << 20,
) -> None:
    """Write ``source`` with ``deltas`` applied into ``target``, chunk by chunk (memory: one
    chunk and the delta): per table, the erased keys removed, then the delta's rows upserted
    (timestamp ages turned back into scores: ``current_score - age``): a key the checkpoint
    holds keeps its place, a new one goes after the rank's rows, each on the rank the
    checkpoint's ownership rule gives it. Apply does not go by slots, so the key that took an
    evicted key's slot cannot overwrite it here: retained evicted keys the delta does not write
    again are removed like erased ones (evictions of tables that retain none are not known, and
    their keys stay). Tables of the delta that the checkpoint lacks are skipped with a warning.
    The output has no slots (``slot_layout`` None; a checkpoint's slots are dropped), even for
    tables the delta leaves alone (simplest and safe: a row the delta adds has no slot in the
    checkpoint's table).

    Raises:
        LayoutError: a delta table whose dtype, dim, state or score columns differ from the
            checkpoint's (checked for every table before anything is written).
    """
    ckpt = Checkpoint(source)
    by_table = {(d.meta.collection, d.meta.table): d for d in deltas}
    present = {(c, t) for c in ckpt.collections() for t in ckpt.tables(c)}
    for key in sorted(set(by_table) - present):
        warnings.warn(f"delta table {key[0]}/{key[1]} is not in {source}; skipped", stacklevel=2)
    for key in sorted(set(by_table) & present):
        _check_apply(ckpt.shards(*key)[0], by_table[key])
    with CheckpointWriter(target) as writer:
        for collection, table in sorted(present):
            first = ckpt.shards(collection, table)[0]
            routed = _RoutedTable(
                writer, first, _block(first, first.dist_type, first.world_size, None)
            )
            delta = by_table.get((collection, table))
            upsert = None if delta is None else _Upsert(delta)
            for _, chunk in ckpt.iter_table(collection, table, chunk_rows):
                routed.append(chunk if upsert is None else upsert.update(chunk))
            if upsert is not None:
                routed.append(upsert.fresh())
            routed.close()


class _Upsert:
    """A delta table applied to a stream of a checkpoint's chunks: erased keys dropped, the
    keys it holds updated in place, the rest of its rows handed out at the end."""

    def __init__(self, delta: DeltaTable) -> None:
        scores = delta.scores.copy()
        for c in _age_columns(delta.meta.score_strategy):
            scores[:, c] = delta.meta.current_score - scores[:, c]
        self.delta = dataclasses.replace(delta, scores=scores)
        self.by_key = np.argsort(delta.keys, kind="stable")
        self.sorted_keys = delta.keys[self.by_key]
        # Retained evicted keys the delta does not write again left the source: they leave the
        # checkpoint too, like the erased ones.
        gone = [delta.erased] if delta.evicted is None else [delta.erased, delta.evicted]
        removed = np.unique(np.concatenate(gone))
        self.erased = removed[~np.isin(removed, delta.keys)]
        self.seen = np.zeros(delta.keys.size, dtype=bool)

    def update(self, rows: ShardData) -> ShardData:
        keep = ~np.isin(rows.keys, self.erased)
        keys = rows.keys[keep]
        values, scores = rows.values[keep].copy(), rows.scores[keep].copy()
        state = None if rows.state is None else rows.state[keep].copy()
        pos = np.searchsorted(self.sorted_keys, keys)
        inside = pos < self.sorted_keys.size
        hit = np.zeros(keys.size, dtype=bool)
        hit[inside] = self.sorted_keys[pos[inside]] == keys[inside]
        source = self.by_key[pos[hit]]
        self.seen[source] = True
        d = self.delta
        values[hit] = d.values[source]
        scores[hit] = d.scores[source]
        if state is not None and d.state is not None:
            state[hit] = d.state[source]
        return ShardData(keys, values, scores, state, rows.admit_keys, rows.admit_counts)

    def fresh(self) -> ShardData:
        """The delta's rows no chunk held, in delta order."""
        d, new = self.delta, ~self.seen
        return ShardData(
            d.keys[new], d.values[new], d.scores[new], None if d.state is None else d.state[new]
        )
