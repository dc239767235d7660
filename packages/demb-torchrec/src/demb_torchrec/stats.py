"""Per-table statistics of a model's dynamic tables on this rank: size, capacity, load factor,
and what the inserts since the last read did (keys inserted, keys evicted, keys that found no
slot); with admission what it let in and kept out, and for a caching table what moved between
its tiers. Insert outcomes are counted only once :func:`count_insert_outcomes` switched them on
(a few small device ops per insert batch; nothing when off)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from demb_storage import MemoryType, MemoryUsage, MultiTableKVCounter
from torch import nn

from demb_torchrec.model_tables import ModelTable, dynamic_tables, is_caching

__all__ = [
    "TableStats",
    "count_insert_outcomes",
    "table_memory",
    "table_placement",
    "table_stats",
]


@dataclass(frozen=True)
class TableStats:
    """One dynamic table on this rank.

    Attributes:
        size: keys held.
        capacity: slots (value rows) now.
        load_factor: ``size / capacity``.
        inserted: keys inserted into a free slot since the last read (0 unless counting).
        evicted: keys inserted into an evicted key's slot since the last read (each evicted
            one key).
        failed: keys that found no slot since the last read.
        admitted: missing keys the table's admission strategy let in since the last read (0
            without ``admit_strategy``; counted always).
        rejected: missing keys it kept out since the last read.
        counter_evictions: keys its admission counter evicted since the last read (frequency
            admission).
        stored: keys in the storage under its cache (``caching=True``; then ``size``,
            ``capacity`` and ``load_factor`` are the cache's); 0 without caching.
        cache_hits: keys of training forwards found in its cache since the last read.
        storage_hits: keys found in the storage instead (moved up into the cache).
        cache_misses: keys in neither tier (new keys).
        write_backs: rows written from the cache to the storage.
        overflows: keys trained outside the cache (their bucket was full of the batch's keys).
        storage_evictions: keys the storage dropped (evicted, or no room).
    """

    size: int
    capacity: int
    load_factor: float
    inserted: int
    evicted: int
    failed: int
    admitted: int = 0
    rejected: int = 0
    counter_evictions: int = 0
    stored: int = 0
    cache_hits: int = 0
    storage_hits: int = 0
    cache_misses: int = 0
    write_backs: int = 0
    overflows: int = 0
    storage_evictions: int = 0

    def as_dict(self) -> dict[str, int | float]:
        return asdict(self)


def count_insert_outcomes(model: nn.Module, enabled: bool = True) -> None:
    """Start (from zero) or stop counting the insert outcomes of every dynamic table of
    ``model`` on this rank."""
    seen: set[int] = set()
    for t in dynamic_tables(model):
        tables = t.module.tables
        if id(tables) not in seen:
            seen.add(id(tables))
            tables.outcomes.enable(enabled)


def table_stats(model: nn.Module, reset: bool = True) -> dict[str, dict[str, TableStats]]:
    """``{collection: {table: TableStats}}`` of this rank's dynamic tables (a host sync per
    fused group of tables).

    Args:
        reset: start the insert counts again from zero.
    """
    out: dict[str, dict[str, TableStats]] = {}
    outcomes: dict[int, list[dict[str, int]]] = {}
    sizes: dict[int, list[int]] = {}
    admission: dict[int, dict[str, list[int]]] = {}
    caches: dict[int, list[dict[str, int]]] = {}
    for t in dynamic_tables(model):
        tables = t.module.tables
        key = id(tables)
        if key not in outcomes:
            outcomes[key] = tables.outcomes.read(reset=reset)
            sizes[key] = tables.index.sizes.tolist()
            admitters = t.module.admission
            if admitters is not None:
                read = admitters.read_counts(reset=reset)
                admission[key] = {name: v.tolist() for name, v in read.items()}
            if t.module.cache is not None:
                caches[key] = t.module.cache.read_stats(reset=reset)
        size = sizes[key][t.index]
        capacity = tables.capacity(t.index)
        counts = outcomes[key][t.index]
        out.setdefault(t.collection, {})[t.name] = TableStats(
            size=size,
            capacity=capacity,
            load_factor=size / capacity if capacity else 0.0,
            inserted=counts["inserted"],
            evicted=counts["evicted"],
            failed=counts["failed"],
            **{name: v[t.index] for name, v in admission.get(key, {}).items()},
            **_cache_fields(t, caches.get(key)),
        )
    return out


_CACHE_FIELDS = {
    "cache_hits": "cache_hits",
    "storage_hits": "storage_hits",
    "cache_misses": "misses",
    "write_backs": "write_backs",
    "overflows": "overflows",
    "storage_evictions": "evictions",
}
"""TableStats field -> the cache tier's count (:data:`demb_torchrec._cache.STAT_NAMES`)."""


def _cache_fields(t: ModelTable, read: list[dict[str, int]] | None) -> dict[str, int]:
    cache = t.module.cache
    if read is None or cache is None or not is_caching(t):
        return {}
    below = cache.below[t.index]
    assert below is not None
    counts = read[t.index]
    stored = below.storage.size(below.table_id)
    return {"stored": stored, **{f: counts[c] for f, c in _CACHE_FIELDS.items()}}


def table_memory(model: nn.Module) -> dict[str, dict[str, MemoryUsage]]:
    """``{collection: {table: MemoryUsage}}``: the bytes each dynamic table of ``model`` holds on
    this rank, by kind of memory (``device``: GPU memory; ``host``: host memory, which is where
    a CPU table lives; ``external``: files), now (a table that grew holds more): its slots' keys,
    digests and scores, its value rows (embedding and optimizer state) and its admission
    counter (frequency admission); for a caching table, its cache and its share of the storage
    under it. No sync."""
    out: dict[str, dict[str, MemoryUsage]] = {}
    for t in dynamic_tables(model):
        tables = t.module.tables
        index = tables.index
        lo, hi = index.slot_range(t.index)
        slots = [index.keys[lo:hi], index.digests[lo:hi], index.scores[:, lo:hi]]
        values = tables.values[t.index]
        rows = tables.configs[t.index].device_rows
        used = MemoryUsage.of_tensors(slots) + MemoryUsage.of_values(values, rows)
        admission = t.module.admission
        found = None if admission is None else admission.counter_of(t.index)
        if found is not None:
            counter, local = found
            share = 1.0  # a custom counter's memory is counted whole, with each of its tables
            if isinstance(counter, MultiTableKVCounter):  # its slots' share of the fused one
                share = counter.capacities[local] / sum(counter.capacities)
            used = used + MemoryUsage(
                device=round(counter.memory_usage(MemoryType.DEVICE) * share),
                host=round(counter.memory_usage(MemoryType.HOST) * share),
            )
        if t.module.cache is not None and is_caching(t):  # and its rows below the cache
            used = used + t.module.cache.storage_memory(t.index)
        out.setdefault(t.collection, {})[t.name] = used
    return out


def table_placement(model: nn.Module) -> dict[str, dict[str, str]]:
    """``{collection: {table: where its values live}}`` on this rank, in words: all its slots
    in the module's device memory, or a cache of so many rows there over its storage."""
    out: dict[str, dict[str, str]] = {}
    for t in dynamic_tables(model):
        tables = t.module.tables
        device = tables.device.type
        capacity = tables.capacity(t.index)
        cache = t.module.cache
        rows = tables.configs[t.index].device_rows
        if rows == 0:
            text = f"all values in host memory ({capacity} slots now)"
        elif rows is not None:
            text = (
                f"a hybrid table: the values of its first {rows} rows in {device} memory, the "
                f"others in host memory ({capacity} slots now)"
            )
        elif cache is None or not is_caching(t):
            text = f"all values in {device} memory ({capacity} slots now)"
        else:
            below = cache.below[t.index]
            assert below is not None
            storage = type(below.storage).__name__
            if storage == "DynamicEmbeddingTable":
                storage = "a host-memory table"
            rows = t.module.options[t.index].max_capacity
            text = f"a cache of {capacity} of its {rows} rows in {device} memory over {storage}"
        out.setdefault(t.collection, {})[t.name] = text
    return out
