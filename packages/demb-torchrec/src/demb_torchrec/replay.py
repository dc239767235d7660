"""Replaying incremental dumps into a model (spec: ``replay_increment``, ``ReplayContent``,
``ReplayStats``): per table, the delta's erased keys are removed, then every key this rank owns
is written at the slot it held in the source table, so a replica converges to its source
layout-identically.

Every table of the delta is checked (layout fields, column shapes, each slot in its key's home
bucket) before any is written: a mismatch raises ``ValueError`` naming the field, the model
untouched.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from demb_kernels.rows import scatter_rows_many
from demb_kernels.table import EMPTY_KEY, ScorePolicy
from demb_planner import owner_rank
from demb_storage import SlotWriteBatch, SlotWrites, TableConfigError, clear_slots
from torch import nn

from demb_torchrec.errors import ConfigError
from demb_torchrec.incremental import DeltaDumpResult, _check_dist, age_columns
from demb_torchrec.model_tables import ModelTable, dynamic_tables, index_words, is_caching
from demb_torchrec.scores import current_scores

__all__ = ["ReplayContent", "ReplayStats", "replay_increment"]


class ReplayContent(enum.Flag):
    """What travels with each replayed key besides its embedding (which always does)."""

    EMBEDDING_ONLY = 0
    """Neither: a key's row keeps its optimizer state only if the key already held that row
    (else the optimizer's initial state), and it is scored as a key just inserted."""
    OPTIMIZER_STATE = 1
    """The key's optimizer state."""
    SCORE = 2
    """The key's score words (TIMESTAMP ages turned back into timestamps)."""
    ALL = 3
    """Both (the default)."""
    BOTH = 3
    """Same as :attr:`ALL`."""


@dataclass(frozen=True)
class ReplayStats:
    """What a replay did to one table on this rank."""

    upserted: int
    """Keys written at their source slot."""
    erased: int
    """Keys removed: the erased keys this replica held, and the keys it held in the slots
    those erases freed in the source (keys the erased ones had evicted)."""
    skipped: int
    """Delta keys another rank owns."""


@dataclass
class _Plan:
    """One table's checked replay: what to erase, what to write where."""

    table: ModelTable
    keys: torch.Tensor
    slots: torch.Tensor | None
    """The keys' source slots, checked with every table's before any is written
    (:func:`_checked_writes`); None for a caching table (written by key, in its storage)."""
    values: torch.Tensor
    state: torch.Tensor | None
    scores: torch.Tensor | None
    erased: torch.Tensor
    erased_slots: torch.Tensor | None
    current_score: int
    skipped: int
    full_rows: bool = False
    """Whether :attr:`values` holds whole rows (embedding and optimizer state)."""


def _fail(where: str, field: str, why: str) -> ConfigError:
    return ConfigError(f"replay_increment: {where}: {field}: {why}")


def _tensor(
    value: object, where: str, field: str, shape: tuple[int, ...], dtype: torch.dtype | None
) -> None:
    if not isinstance(value, torch.Tensor):
        raise _fail(where, field, f"expected a tensor, got {type(value).__name__}")
    if tuple(value.shape) != shape:
        raise _fail(where, field, f"shape {tuple(value.shape)}, the replay needs {shape}")
    if dtype is not None and value.dtype != dtype:
        raise _fail(where, field, f"dtype {value.dtype}, the replay needs {dtype}")


def _check_layout(t: ModelTable, meta: Mapping[str, Any], where: str) -> None:
    """The delta's layout fields against table ``t`` (the first mismatch raises)."""
    tables = t.module.tables
    config = tables.configs[t.index]
    capacity = tables.capacity(t.index)
    columns = tuple(c.name for c in config.score_layout.columns)
    options = meta.get("table_options")
    rows = (
        (capacity, int(t.module.options[t.index].max_capacity or 0))
        if is_caching(t)
        else (capacity,)
    )
    expected: list[tuple[str, object, object]] = [
        ("current_capacity", meta.get("current_capacity"), capacity),
        ("row_capacity", tuple(meta.get("row_capacity") or ()), rows),
        ("bucket_capacity", meta.get("bucket_capacity"), config.bucket_capacity),
        ("num_scores", meta.get("num_scores"), len(columns)),
        ("world_size", meta.get("world_size"), t.world_size),
        ("score_strategy", tuple(meta.get("score_strategy") or ()), columns),
        ("table_options.dim", getattr(options, "dim", None), config.dim),
        ("table_options.dist_type", getattr(options, "dist_type", None), t.dist_type),
    ]
    for field, got, want in expected:
        if got != want:
            raise _fail(where, field, f"the delta has {got!r}, the table {want!r}")
    score = meta.get("current_score")
    if isinstance(score, bool) or not isinstance(score, int) or not 0 <= score < 2**63:
        raise _fail(where, "current_score", f"{score!r} is not an int in [0, 2**63)")


def _plan(t: ModelTable, delta: DeltaDumpResult, i: int, content: ReplayContent) -> _Plan:
    where = f"{t.collection}/{t.name}"
    meta = delta.meta[i]
    _check_dist(t)
    _check_layout(t, meta, where)
    config = t.module.tables.configs[t.index]
    keys = delta.keys[i]
    if not isinstance(keys, torch.Tensor) or keys.dim() != 1:
        raise _fail(where, "keys", "expected a 1-D int64 tensor")
    n = int(keys.shape[0])
    _tensor(keys, where, "keys", (n,), torch.int64)
    _tensor(meta.get("slot_index"), where, "slot_index", (n,), torch.int64)
    _tensor(delta.values[i], where, "values", (n, config.dim), None)
    _tensor(delta.scores[i], where, "scores", (n, int(meta["num_scores"])), torch.int64)
    state = delta.optimizer_states[i]
    carry_state = ReplayContent.OPTIMIZER_STATE in content and config.state_dim > 0
    if carry_state:
        if state is None:
            raise _fail(where, "optimizer_states", "None, but the replay carries optimizer state")
        _tensor(state, where, "optimizer_states", (n, config.state_dim), None)
    erased = delta.erased_keys[i]
    if erased is None:
        erased = torch.zeros(0, dtype=torch.int64)
    _tensor(erased, where, "erased_keys", (int(erased.shape[0]),), torch.int64)
    mine = _owned(t, keys)
    erased_mine = _owned(t, erased)
    freed = meta.get("erased_slot_index")
    caching = is_caching(t)
    if freed is not None:
        _tensor(freed, where, "erased_slot_index", tuple(erased.shape), torch.int64)
        if caching:  # a caching table is written by key: no slot to clear
            freed = None
    if freed is not None and freed.numel() == 0:
        freed = None
    if freed is not None:
        freed = _take(freed, erased_mine)
        freed = freed[freed >= 0]
        capacity = t.module.tables.capacity(t.index)
        if freed.numel() and (int(freed.min()) < 0 or int(freed.max()) >= capacity):
            raise _fail(where, "erased_slot_index", f"a slot outside [0, {capacity})")
        freed = torch.unique(freed)
    slots = None
    if caching:  # written by key: each key once, none the empty key
        _check_keys(_take(keys, mine), where)
    else:
        slots = _take(meta["slot_index"], mine)
    values = delta.values[i]
    rows = _joined(values, state) if carry_state and state is not None else None
    return _Plan(
        table=t,
        keys=_take(keys, mine),
        slots=slots,
        values=_take(values, mine) if rows is None else _take(rows, mine),
        state=None if rows is not None or not carry_state or state is None else _take(state, mine),
        scores=_take(delta.scores[i], mine) if ReplayContent.SCORE in content else None,
        erased=_take(erased, erased_mine),
        erased_slots=freed,
        current_score=int(meta["current_score"]),
        skipped=0 if mine is None else n - int(mine.sum()),
        full_rows=rows is not None,
    )


def _check_keys(keys: torch.Tensor, where: str) -> None:
    """The keys of a caching table's delta: distinct, none the empty key (-1)."""
    if bool((keys == EMPTY_KEY).any()):
        raise _fail(where, "keys", f"{EMPTY_KEY}, the empty key, cannot be written")
    ordered = torch.sort(keys).values
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise _fail(where, "keys", "a key is repeated; each key is written once")


def _owned(t: ModelTable, keys: torch.Tensor) -> torch.Tensor | None:
    """``(n,)`` bool: the keys this rank owns; None when it owns them all."""
    if t.world_size == 1:
        return None
    mine = torch.from_numpy(owner_rank(keys.cpu().numpy(), t.world_size, t.dist_type) == t.rank)
    return None if bool(mine.all()) else mine


def _take(x: torch.Tensor, mine: torch.Tensor | None) -> torch.Tensor:
    return x if mine is None else x[mine.to(x.device)]


def _joined(values: torch.Tensor, state: torch.Tensor) -> torch.Tensor | None:
    """The ``(n, dim + state_dim)`` rows whose column views ``values`` and ``state`` are (as
    :func:`~demb_torchrec.incremental_dump` returns them: no copy), else None."""
    n, dim = values.shape
    width = dim + state.shape[1]
    adjacent = (
        values.dtype == state.dtype
        and values.device == state.device
        and values.untyped_storage().data_ptr() == state.untyped_storage().data_ptr()
        and values.stride() == (width, 1)
        and state.stride() == (width, 1)
        and state.storage_offset() == values.storage_offset() + dim
    )
    if not adjacent or n == 0:
        return None
    return values.as_strided((n, width), (width, 1))


def _index_words(plan: _Plan, fresh: int) -> torch.Tensor:
    """``(W, n)`` int64 index score words of the plan's keys: the delta's (ages turned back into
    timestamps with the delta's current score), or those of a key just inserted (``fresh``: the
    table's current batch score; LFU counts 1)."""
    t = plan.table
    tables = t.module.tables
    layout = tables.configs[t.index].score_layout
    if plan.scores is not None:
        return _delta_words(t, plan.scores, plan.current_score)
    n = int(plan.keys.shape[0])
    words = torch.zeros((tables.index.score_words, n), dtype=torch.int64)
    policy = layout.policy
    if policy is ScorePolicy.LFU:
        words[0] = 1
    elif policy is ScorePolicy.TIMESTAMP_LFU:
        words[0], words[1] = 1, fresh
    else:
        words[0] = fresh
    return words


def _delta_words(t: ModelTable, scores: torch.Tensor, current: int) -> torch.Tensor:
    """``(W, n)`` int64 index words of ``(n, C)`` delta score columns of table ``t``'s layout,
    TIMESTAMP ages turned back into timestamps (``current - age``)."""
    layout = t.module.tables.configs[t.index].score_layout
    return index_words(t, scores, age_columns([c.name for c in layout.columns]), current)


def _batch_words(plans: list[_Plan], fresh: list[int]) -> torch.Tensor:
    """``(W, n)`` int64 index words of the plans' keys, concatenated in plan order (the words
    of :func:`_index_words` of each): when every plan carries scores of one layout from one
    current score, made for all at once."""
    first = plans[0].table
    layout = first.module.tables.configs[first.index].score_layout
    same = all(
        p.scores is not None
        and p.current_score == plans[0].current_score
        and p.table.module.tables.configs[p.table.index].score_layout == layout
        for p in plans
    )
    if not same or len(plans) == 1:
        return torch.cat([_index_words(p, f) for p, f in zip(plans, fresh, strict=True)], dim=1)
    scores = torch.cat([p.scores for p in plans if p.scores is not None])
    return _delta_words(first, scores, plans[0].current_score)


def _checked_writes(plans: list[_Plan]) -> list[tuple[SlotWriteBatch, list[_Plan]]]:
    """The slot-written plans (every non-caching table) grouped by table set, each group's
    writes checked in one batch; when a check fails, each table's own check names it.

    Raises:
        ConfigError: a key or slot that cannot be written, naming the table and the field.
    """
    groups: dict[int, list[_Plan]] = {}
    for plan in plans:
        if plan.slots is not None:
            groups.setdefault(id(plan.table.module.tables), []).append(plan)
    out = []
    for members in groups.values():
        tables = members[0].table.module.tables
        parts = [(p.table.index, p.keys, p.slots) for p in members if p.slots is not None]
        batch = SlotWriteBatch.check(tables, parts)
        if batch is None:  # some table's writes fail (or may): each table's own check says
            for plan in members:
                t = plan.table
                try:
                    assert plan.slots is not None
                    SlotWrites.check(tables, t.index, plan.keys, plan.slots)
                except TableConfigError as err:
                    raise _fail(f"{t.collection}/{t.name}", err.option, str(err)) from None
            batch = SlotWriteBatch.check(tables, parts, checked=True)
            assert batch is not None
        out.append((batch, members))
    return out


def _erase(plan: _Plan) -> int:
    """Remove the erased keys from the table's index (a caching table's: from its cache) and
    clear their source slots; how many it held."""
    t = plan.table
    tables = t.module.tables
    erased = 0
    if plan.erased.numel():
        ids = torch.full_like(plan.erased, t.index)
        device = tables.device
        erased = int((tables.erase(plan.erased.to(device), ids.to(device)) >= 0).sum())
    if plan.erased_slots is not None and plan.erased_slots.numel():
        # a key an erased one had evicted may still sit there
        erased += clear_slots(tables, t.index, plan.erased_slots)
    return erased


def _rows(plan: _Plan, slots: torch.Tensor, taken_over: torch.Tensor) -> torch.Tensor:
    """The value rows a slot-written table's keys get at their ``slots`` (their index entries
    written: ``taken_over`` says which slots held another key or none before), in the table's
    buffer's device and dtype."""
    t = plan.table
    tables = t.module.tables
    config = tables.configs[t.index]
    buf = tables.values[t.index]
    values = plan.values.to(buf.device, buf.dtype, non_blocking=True)
    if plan.full_rows or not config.state_dim:
        rows = values
    elif plan.state is not None:
        rows = torch.cat([values, plan.state.to(buf.device, buf.dtype, non_blocking=True)], 1)
    else:  # the rows' own state; a row another key held gets the initial state
        rows = tables.read(t.index, slots)
        rows[:, : config.dim] = values
        initial = t.module.initial_states[t.index]
        assert initial is not None
        rows[taken_over.to(rows.device), config.dim :] = initial.to(rows.device, rows.dtype)
    return rows.contiguous()


def _apply_by_key(plan: _Plan, fresh: int, erased: int) -> ReplayStats:
    """A caching table's replay: the erased keys leave both tiers, then every key is written
    into its storage with its row and score words (its cache copy dropped): the union of the
    tiers converges to the source's; the cache refills from the replica's own lookups."""
    t = plan.table
    tables = t.module.tables
    cache = t.module.cache
    assert cache is not None
    config = tables.configs[t.index]
    if plan.erased.numel():
        erased += cache.erase(t.index, plan.erased, record=False)
    keys = plan.keys.to(tables.device)
    values = plan.values.to(tables.device)
    if plan.full_rows or not config.state_dim:
        rows = values
    elif plan.state is not None:
        rows = torch.cat([values, plan.state.to(values)], 1)
    else:  # the key's own state where either tier holds it, else the initial state
        held, rows = cache.rows_of(t.index, keys)
        rows[:, : config.dim] = values.to(rows)
        initial = t.module.initial_states[t.index]
        assert initial is not None
        rows[~held.to(rows.device), config.dim :] = initial.to(rows)
    cache.assign(t.index, keys, _index_words(plan, fresh), rows)
    return ReplayStats(upserted=int(keys.numel()), erased=erased, skipped=plan.skipped)


def replay_increment(
    model: nn.Module,
    deltas: Mapping[str, DeltaDumpResult],
    content: ReplayContent = ReplayContent.ALL,
) -> dict[str, dict[str, ReplayStats]]:
    """Write :func:`~demb_torchrec.incremental_dump` results into the model's dynamic tables.

    Per table: the erased keys this rank owns are removed, then each key this rank owns (its
    owner recomputed from the key with the model's world size) is written at its source slot
    with its embedding and, per ``content``, its optimizer state and scores; the evicted keys
    are never applied (the key that took an evicted key's slot is in the delta). Every table is
    checked before any is written.

    Args:
        model: holds the dynamic tables (built like the source's: same capacities, bucket
            capacities, score strategies, dims and world size).
        deltas: ``{collection: DeltaDumpResult}``; collections or tables the model lacks are
            skipped with a warning.
        content: what travels besides the embeddings (default: optimizer state and scores).

    Returns:
        ``{collection: {table: ReplayStats}}``.

    Raises:
        ValueError: a table whose layout differs from the delta's, or a delta missing per-key
            data the replay needs (the message names the first offending field); nothing is
            written.
        NotImplementedError: a table sharded with ``dist_type="continuous"``.
    """
    tables = {(t.collection, t.name): t for t in dynamic_tables(model)}
    plans: list[_Plan] = []
    for collection, delta in deltas.items():
        lengths = {
            len(getattr(delta, f))
            for f in (
                "keys",
                "values",
                "optimizer_states",
                "scores",
                "erased_keys",
                "evicted_keys",
                "meta",
            )
        }
        if lengths != {len(delta.table_names)}:
            raise _fail(collection, "table_names", "the per-table lists differ in length")
        for i, name in enumerate(delta.table_names):
            t = tables.get((collection, name))
            if t is None:
                warnings.warn(
                    f"replay_increment: the model has no dynamic table {collection}/{name}; "
                    "its delta is skipped",
                    stacklevel=2,
                )
                continue
            plans.append(_plan(t, delta, i, content))
    batches = _checked_writes(plans)
    fresh = [0] * len(plans)
    if ReplayContent.SCORE not in content:  # keys are scored as just inserted
        fresh = current_scores([p.table for p in plans])
    score = {id(plan): f for plan, f in zip(plans, fresh, strict=True)}
    done: dict[int, ReplayStats] = {}
    with torch.no_grad():
        for batch, members in batches:  # tables of one set: their index written at once
            erased = [_erase(plan) for plan in members]
            device = members[0].table.module.tables.device
            words = _batch_words(members, [score[id(p)] for p in members])
            taken_over = batch.apply(words.to(device))
            slots = [batch.slots[batch.part(i)] for i in range(len(members))]
            rows = [
                _rows(p, s, taken_over[batch.part(i)])
                for i, (p, s) in enumerate(zip(members, slots, strict=True))
            ]
            bufs = [p.table.module.tables.values[p.table.index] for p in members]
            scatter_rows_many(
                bufs, [s.to(b.device) for s, b in zip(slots, bufs, strict=True)], rows
            )
            for i, plan in enumerate(members):
                upserted = int(slots[i].numel())
                done[id(plan)] = ReplayStats(upserted, erased[i], plan.skipped)
        for plan in plans:
            if plan.slots is None:  # the cache's copies of the erased keys go first
                done[id(plan)] = _apply_by_key(plan, score[id(plan)], _erase(plan))
    stats: dict[str, dict[str, ReplayStats]] = {}
    for plan in plans:
        stats.setdefault(plan.table.collection, {})[plan.table.name] = done[id(plan)]
    return stats
