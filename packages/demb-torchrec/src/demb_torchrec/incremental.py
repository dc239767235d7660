"""Incremental dumps (spec: ``incremental_dump`` / ``DeltaDumpResult``): the rows of every dynamic
table whose score crossed a threshold, with the slot each held, the keys erased and evicted since
the last dump, and the layout a replay checks (:mod:`demb_torchrec.replay` applies them).

A table whose score strategy has a TIMESTAMP column is thresholded on its last-access time (the
timestamp word of ``(TIMESTAMP, LFU)``), the others on their score; with the value of
:func:`~demb_torchrec.get_score` taken earlier as the threshold, a dump holds exactly the keys
touched since. Timestamp columns travel as ages (``current_score - score``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from demb_storage import TableExport
from torch import nn

from demb_torchrec.errors import ConfigError, InputTypeError, NotSupportedError
from demb_torchrec.model_tables import ModelTable, dynamic_tables, is_caching
from demb_torchrec.options import EvictedItemMode
from demb_torchrec.scores import current_scores

__all__ = ["TIMESTAMP", "DeltaDumpResult", "age_columns", "incremental_dump"]

TIMESTAMP = "TIMESTAMP"
"""The score column name whose values travel as ages."""

_LAYOUT = ("current_capacity", "row_capacity", "bucket_capacity", "num_scores", "world_size")
"""The meta fields every rank of a gathered dump must agree on."""


def age_columns(columns: tuple[str, ...] | list[str]) -> list[int]:
    """The positions of the TIMESTAMP columns of a score layout."""
    return [i for i, c in enumerate(columns) if c == TIMESTAMP]


@dataclass
class DeltaDumpResult:
    """One embedding collection's incremental dump: per-table lists, element ``i`` of each for
    ``table_names[i]``; tensors on the host.

    Attributes:
        table_names: the tables.
        keys: ``(n,)`` int64 keys whose score crossed the threshold.
        values: ``(n, dim)`` embeddings, in the table's ``embedding_dtype``.
        optimizer_states: ``(n, state_dim)`` optimizer state, or None (a table without state).
        scores: ``(n, num_scores)`` int64 score columns in the table's ``score_strategy``
            order, TIMESTAMP columns as ages ``current_score - score``.
        erased_keys: ``(e,)`` int64 keys recorded by erases since the last dump.
        evicted_keys: ``(v,)`` int64 keys evicted since the last dump (tables with
            ``evicted_item_mode=RETAIN_KEY``), else None.
        meta: per table ``current_score``, ``slot_index`` (``(n,)`` int64 each key's slot;
            for a caching table its cache slot, -1 for a row in the storage under the cache),
            ``current_capacity``, ``row_capacity`` (a caching table: its cache's rows and
            its ``max_capacity``), ``bucket_capacity``, ``num_scores``,
            ``world_size``, ``table_options`` (the table's ``DynamicEmbTableOptions``),
            ``score_strategy`` (the column names) and ``erased_slot_index`` (``(e,)`` int64 the
            slot each erased key was freed from: a replica clears it, since it may hold a key
            the erased one had evicted).
    """

    table_names: list[str] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    optimizer_states: list[torch.Tensor | None] = field(default_factory=list)
    scores: list[torch.Tensor] = field(default_factory=list)
    erased_keys: list[torch.Tensor | None] = field(default_factory=list)
    evicted_keys: list[torch.Tensor | None] = field(default_factory=list)
    meta: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Rows:
    """One table's dumped rows on this rank, before the ages are taken."""

    keys: torch.Tensor
    values: torch.Tensor
    state: torch.Tensor | None
    raw_scores: torch.Tensor
    slots: torch.Tensor
    erased: torch.Tensor
    erased_slots: torch.Tensor
    evicted: torch.Tensor | None
    meta: dict[str, Any]


def _thresholds(
    tables: list[ModelTable], score_threshold: int | Mapping[str, Mapping[str, int]]
) -> list[tuple[ModelTable, int]]:
    def checked(value: object, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputTypeError("score_threshold", f"must be an int, got {value!r}", where)
        return value

    if not isinstance(score_threshold, Mapping):
        value = checked(score_threshold, "score_threshold")
        return [(t, value) for t in tables]
    by_name = {(t.collection, t.name): t for t in tables}
    picked = []
    for collection, per_table in score_threshold.items():
        for name, value in per_table.items():
            if (collection, name) not in by_name:
                raise ConfigError(
                    f"incremental_dump: no dynamic table {collection}/{name} in the model (it "
                    f"has {sorted(by_name)})"
                )
            picked.append((by_name[(collection, name)], checked(value, f"{collection}/{name}")))
    return picked


def _check_dist(t: ModelTable) -> None:
    if t.dist_type == "continuous":
        raise NotSupportedError(
            "dist_type",
            "incremental dumps and replays route keys by (key or hash(key)) % world_size; "
            "'continuous' sharding is not supported (use roundrobin or hash_roundrobin)",
            table=f"{t.collection}/{t.name}",
        )


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: itself on the CPU; on CUDA a pinned copy, queued on the current
    stream without waiting (the caller synchronizes before reading it)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return out.copy_(t, non_blocking=True)


def _exports(picked: list[tuple[ModelTable, int]]) -> dict[int, TableExport]:
    """Per position in ``picked`` of a table that is not caching, its rows scored at least its
    threshold: the tables of one module exported together (one scan of their index)."""
    by_tables: dict[int, list[int]] = {}
    for i, (t, _) in enumerate(picked):
        if not (t.module.cache is not None and is_caching(t)):
            by_tables.setdefault(id(t.module.tables), []).append(i)
    out: dict[int, TableExport] = {}
    for members in by_tables.values():
        tables = picked[members[0]][0].module.tables
        ids = [picked[i][0].index for i in members]
        exports = tables.export_many(ids, [picked[i][1] for i in members])
        out.update(zip(members, exports, strict=True))
    return out


def _table_rows(
    t: ModelTable, threshold: int, current: int, ages: bool, ex: TableExport | None
) -> _Rows:
    """Table ``t``'s rows scored at least ``threshold`` on the host (queued: see
    :func:`_host`), score columns as ages from ``current`` when ``ages`` (else raw). The
    embeddings and the optimizer state are column views of one host copy of the rows.
    ``ex``: the table's export, when made already (:func:`_exports`)."""
    tables = t.module.tables
    config = tables.configs[t.index]
    capacity = tables.capacity(t.index)
    cache = t.module.cache
    options = t.module.options[t.index]
    if cache is not None and is_caching(t):  # both tiers; the storage's rows have slot -1
        ex = cache.export(t.index, min_score=threshold)
        row_capacity: tuple[int, ...] = (capacity, int(options.max_capacity or 0))
        retains = EvictedItemMode(options.evicted_item_mode) is EvictedItemMode.RETAIN_KEY
    else:
        if ex is None:
            ex = tables.export(t.index, min_score=threshold)
        row_capacity, retains = (capacity,), config.retain_evicted
    columns = tuple(c.name for c in config.score_layout.columns)
    scores = _aged(ex.scores, current, columns) if ages else ex.scores
    rows = _host(ex.values)
    evicted = tables.evicted_keys.pop(t.index) if retains else None
    erased, erased_slots = tables.erased_keys.pop_with_slots(t.index)
    meta: dict[str, Any] = {
        "current_score": current,
        "current_capacity": capacity,
        "row_capacity": row_capacity,
        "bucket_capacity": config.bucket_capacity,
        "num_scores": len(columns),
        "world_size": t.world_size,
        "table_options": t.module.options[t.index],
        "score_strategy": columns,
    }
    return _Rows(
        keys=_host(ex.keys),
        values=rows[:, : config.dim] if config.state_dim else rows,
        state=rows[:, config.dim :] if config.state_dim else None,
        raw_scores=_host(scores),
        slots=_host(ex.slots),
        erased=erased,
        erased_slots=erased_slots,
        evicted=evicted,
        meta=meta,
    )


def _gathered(group: dist.ProcessGroup, t: ModelTable, mine: _Rows) -> _Rows:
    """Every rank's rows of table ``t`` (this rank's meta and current score)."""
    everyone: list[_Rows | None] = [None] * group.size()
    dist.all_gather_object(everyone, mine, group=group)
    parts = [r for r in everyone if r is not None]
    for name in _LAYOUT:
        seen = {str(r.meta[name]) for r in parts}
        if len(seen) > 1:
            raise ConfigError(
                f"incremental_dump: table {t.collection}/{t.name}: the ranks of pg hold "
                f"{name} {sorted(seen)}; a gathered delta has one layout (dump with pg=None)"
            )

    def cat(items: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(items) if items else torch.zeros(0, dtype=torch.int64)

    evicted = [r.evicted for r in parts if r.evicted is not None]
    states = [r.state for r in parts if r.state is not None]
    return _Rows(
        keys=cat([r.keys for r in parts]),
        values=torch.cat([r.values for r in parts]),
        state=None if mine.state is None else torch.cat(states),
        raw_scores=torch.cat([r.raw_scores for r in parts]),
        slots=cat([r.slots for r in parts]),
        erased=cat([r.erased for r in parts]),  # each key erased on its owner only
        erased_slots=cat([r.erased_slots for r in parts]),
        evicted=None if mine.evicted is None else torch.unique(cat(evicted)),
        meta=mine.meta,
    )


def _with_ages(rows: _Rows) -> torch.Tensor:
    """The score columns with TIMESTAMP columns as ages from this rank's current score. Rows of
    another rank whose clock runs ahead of this one's get age 0 (ranks of one host share the
    clock: a gathered dump reads the clocks after every rank's last forward)."""
    return _aged(rows.raw_scores, int(rows.meta["current_score"]), rows.meta["score_strategy"])


def _aged(scores: torch.Tensor, current: int, columns: tuple[str, ...]) -> torch.Tensor:
    """``(n, C)`` ``scores`` with the TIMESTAMP columns as ages ``current - score``, within
    ``[0, current]`` (a copy; the other columns as they are)."""
    ages = age_columns(columns)
    if ages == [0] and scores.shape[1] == 1:  # one timestamp column: two ops
        return torch.sub(current, scores).clamp_(0, current)
    scores = scores.clone()
    for c in ages:
        scores[:, c] = (current - scores[:, c]).clamp(0, current)
    return scores


def incremental_dump(
    model: nn.Module,
    score_threshold: int | Mapping[str, Mapping[str, int]],
    pg: dist.ProcessGroup | None = None,
) -> dict[str, DeltaDumpResult]:
    """The rows of the model's dynamic tables whose score is not less than the threshold, per
    embedding collection (tensors on the host). Nothing in the tables changes, except that the
    erased and retained evicted keys returned leave their buffers.

    Args:
        model: holds the dynamic tables.
        score_threshold: an int for every table, or ``{collection: {table: threshold}}`` for
            the tables it names. Tables with a TIMESTAMP column are thresholded on their
            last-access time, the others on their score (see :func:`~demb_torchrec.get_score`).
        pg: gather every rank's rows over this group (every rank of it calls, and each gets
            the group's rows, the meta's ``current_score`` its own); None: this rank's rows.

    Returns:
        ``{collection: DeltaDumpResult}``.

    Raises:
        NotImplementedError: a table sharded with ``dist_type="continuous"``.
        ValueError: a named table the model lacks; with ``pg``, ranks whose tables differ in
            layout (capacity, bucket capacity, world size).
    """
    if pg is not None and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("incremental_dump: pg given, but torch.distributed is not initialized")
    picked = _thresholds(dynamic_tables(model), score_threshold)
    for t, _ in picked:
        _check_dist(t)
    if pg is not None:  # every rank's last forward is done before any rank reads its clock
        dist.barrier(group=pg)
    currents = current_scores([t for t, _ in picked])
    devices = {t.module.tables.device for t, _ in picked if t.module.tables.device.type == "cuda"}
    results: dict[str, DeltaDumpResult] = {}
    with torch.no_grad():
        exports = _exports(picked)
        for i, ((t, threshold), current) in enumerate(zip(picked, currents, strict=True)):
            rows = _table_rows(t, threshold, current, pg is None, exports.pop(i, None))
            if pg is not None:  # the copies are read (pickled) now; ages from the raw scores
                _synchronize(devices)
                rows = _gathered(pg, t, rows)
                rows.raw_scores = _with_ages(rows)
            result = results.setdefault(t.collection, DeltaDumpResult())
            result.table_names.append(t.name)
            result.keys.append(rows.keys)
            result.values.append(rows.values)
            result.optimizer_states.append(rows.state)
            result.scores.append(rows.raw_scores)
            result.erased_keys.append(rows.erased)
            result.evicted_keys.append(rows.evicted)
            result.meta.append(
                {**rows.meta, "slot_index": rows.slots, "erased_slot_index": rows.erased_slots}
            )
    _synchronize(devices)  # every queued host copy done
    return results


def _synchronize(devices: set[torch.device]) -> None:
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
