"""Where a table's values live, decided once when the table module is built (docs/tiers.md).

A table with ``caching=True`` becomes a cache of ``local_hbm_for_values`` bytes of value rows
(buckets of :data:`CACHE_BUCKET` slots) over a storage holding the rest: its
``external_storage``, or by default a :class:`~demb_storage.DynamicEmbeddingTable` of the
table's full capacity whose rows are in host memory (pinned, on a CUDA module; the index stays
on the module's device). A table with ``caching=False`` and a budget below its value bytes is
hybrid (one index, its first rows in device memory, the others in host memory; a budget of 0,
the default, puts every value in host memory, as the spec says); with a budget that holds all
its rows, all its values are in the module's device memory.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence

import torch
from demb_storage import (
    DynamicEmbeddingTable,
    RowLayout,
    ScoreStrategy,
    Storage,
    TableConfig,
    TableConfigError,
)

from demb_torchrec._cache_groups import StorageSlot
from demb_torchrec.errors import NotSupportedError
from demb_torchrec.options import DynamicEmbTableOptions

__all__ = [
    "CACHE_BUCKET",
    "Placement",
    "cache_config",
    "hybrid_config",
    "memory_limit",
    "place_tables",
]

CACHE_BUCKET = 1024
"""Slots per bucket of a cache (the spec's default for a table that serves as a cache), or
fewer when the table or the budget is smaller (a multiple of 16 slots)."""

BUCKET_ALIGNMENT = 16
"""The smallest bucket, and the multiple every bucket width is of."""

_log = logging.getLogger("demb_torchrec")


@dataclasses.dataclass(frozen=True)
class Placement:
    """What :func:`place_tables` decided for a module's tables."""

    configs: list[TableConfig]
    """Per table, the config of the module's own table: the cache of a caching table."""
    below: list[StorageSlot | None]
    """Per table, the storage under its cache, or None (no caching)."""
    retains: list[bool]
    """Per table, whether it records what its last tier evicts (``RETAIN_KEY``)."""


def memory_limit(device: torch.device) -> int:
    """Bytes of memory a budget on ``device`` can ask for: the GPU's total memory, or the
    host's physical memory for the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _check_budget(budget: int, table: str, device: torch.device) -> None:
    """A device budget no larger than the device's memory (:func:`memory_limit`)."""
    if budget > (limit := memory_limit(device)):
        raise TableConfigError(
            f"{table}.local_hbm_for_values",
            budget,
            f"more than the {limit} bytes of memory of {device}",
        )


def cache_config(config: TableConfig, budget: int, table: str, device: torch.device) -> TableConfig:
    """The cache of a caching table: as many rows as ``budget`` bytes hold, in whole buckets of
    :data:`CACHE_BUCKET` slots (fewer, a multiple of 16, when the table or the budget is
    smaller), never more than the table's ``max_capacity``. It never grows; a NO_EVICTION
    table's cache evicts by timestamp (its evictions go to the storage, which never evicts).

    Raises:
        TableConfigError: a budget below one bucket of 16 rows, or above the device's memory.
    """
    _check_budget(budget, table, device)
    row_bytes = RowLayout.of(config).row_bytes
    rows = budget // row_bytes
    if rows < BUCKET_ALIGNMENT:
        raise TableConfigError(
            f"{table}.local_hbm_for_values",
            budget,
            f"a cache needs at least one bucket: {BUCKET_ALIGNMENT} rows of {row_bytes} bytes "
            f"({BUCKET_ALIGNMENT * row_bytes} bytes)",
        )
    bucket = min(CACHE_BUCKET, config.max_capacity, rows // BUCKET_ALIGNMENT * BUCKET_ALIGNMENT)
    capacity = min(rows, config.max_capacity) // bucket * bucket
    strategy = config.score_strategy
    if strategy == ScoreStrategy.NO_EVICTION:
        strategy = ScoreStrategy.TIMESTAMP
    return dataclasses.replace(
        config,
        max_capacity=capacity,
        init_capacity=capacity,
        bucket_capacity=bucket,
        score_strategy=strategy,
        retain_evicted=False,
    )


def place_tables(
    options: Sequence[DynamicEmbTableOptions],
    configs: Sequence[TableConfig],
    names: Sequence[str],
    device: torch.device,
) -> Placement:
    """Each table's cache and storage (see the module docstring); logs where each table's
    values live.

    Raises:
        TableConfigError: a bad budget (:func:`cache_config`), an ``external_storage`` that is
            not a :class:`~demb_storage.Storage` or whose rows disagree with its tables'.
        NotSupportedError: ``external_storage`` without ``caching``.
    """
    own: list[TableConfig] = []
    below: list[StorageSlot | None] = [None] * len(configs)
    host: list[int] = []
    for t, (o, c, name) in enumerate(zip(options, configs, names, strict=True)):
        if not o.caching:
            _check_uncached(o, name)
            own.append(hybrid_config(c, o.local_hbm_for_values, name, device))
            continue
        own.append(cache_config(c, o.local_hbm_for_values, name, device))
        if o.external_storage is None:
            host.append(t)
    if host:
        # device_rows=0: every row in host memory that the device reads and writes itself
        # (demb_kernels.hybrid), so a write-back is a kernel over the bus, not a copy through
        # pageable memory
        shared = DynamicEmbeddingTable.create(
            [dataclasses.replace(configs[t], retain_evicted=False, device_rows=0) for t in host],
            device,
            names=[names[t] for t in host],
        )
        for i, t in enumerate(host):
            below[t] = StorageSlot(shared, i)
    _attach_external(options, configs, names, below)
    for t, slot in enumerate(below):
        if slot is not None:
            _log.info(
                "table %s: %d of %d rows cached in %s memory (local_hbm_for_values=%d bytes), "
                "the rest in %s",
                names[t], own[t].max_capacity, configs[t].max_capacity, device.type,
                options[t].local_hbm_for_values, type(slot.storage).__name__,
            )  # fmt: skip
    retains = [c.retain_evicted for c in configs]
    return Placement(own, below, retains)


def _check_uncached(o: DynamicEmbTableOptions, name: str) -> None:
    if o.external_storage is not None:
        raise NotSupportedError(
            "DynamicEmbTableOptions.external_storage",
            "an external storage is the tier under a cache: set caching=True and "
            "local_hbm_for_values (or global_hbm_for_values with the planner)",
            table=name,
        )


def hybrid_config(
    config: TableConfig, budget: int, table: str, device: torch.device
) -> TableConfig:
    """The table of ``caching=False`` with a device budget of ``budget`` bytes of value rows
    (the spec's meaning): all-device when the budget holds ``max_capacity`` rows; else a
    hybrid table, its first ``budget // row_bytes`` rows in device memory and the others in
    host memory (:attr:`TableConfig.device_rows`; a budget of 0, the default, or below one
    row: every value in host memory). On the CPU both are the host's memory. Logs where the
    values live.

    Raises:
        TableConfigError: a budget above the device's memory.
    """
    _check_budget(budget, table, device)
    rows = budget // RowLayout.of(config).row_bytes
    if rows >= config.max_capacity:
        _log.info(
            "table %s: all values in %s memory (local_hbm_for_values=%d bytes holds its %d "
            "rows)",
            table, device.type, budget, config.max_capacity,
        )  # fmt: skip
        return config
    if rows == 0:
        _log.info(
            "table %s: all values in host memory (local_hbm_for_values=%d bytes: %s)",
            table, budget, "the default, none on the device" if not budget else "below one row",
        )  # fmt: skip
    else:
        _log.info(
            "table %s: a hybrid table, the values of its first %d rows in %s memory (of %d at "
            "most; local_hbm_for_values=%d bytes), the others in host memory",
            table, rows, device.type, config.max_capacity, budget,
        )  # fmt: skip
    return dataclasses.replace(config, device_rows=rows)


def _attach_external(
    options: Sequence[DynamicEmbTableOptions],
    configs: Sequence[TableConfig],
    names: Sequence[str],
    below: list[StorageSlot | None],
) -> None:
    """The tables sharing one ``external_storage`` object are its tables ``0, 1, ...`` in the
    module's table order; its rows and score words must fit theirs."""
    groups: dict[int, list[int]] = {}
    for t, o in enumerate(options):
        if o.caching and o.external_storage is not None:
            storage = o.external_storage
            if not isinstance(storage, Storage):
                raise TableConfigError(
                    f"{names[t]}.external_storage",
                    type(storage).__name__,
                    "must be a demb_storage.Storage (demb_torchrec.types.Storage)",
                )
            groups.setdefault(id(storage), []).append(t)
    for members in groups.values():
        storage = options[members[0]].external_storage
        storage.check_layouts(
            [RowLayout.of(configs[t]) for t in members], names=[names[t] for t in members]
        )
        for i, t in enumerate(members):
            words = len(configs[t].score_layout.columns)
            if storage.score_words < words:
                raise TableConfigError(
                    f"{names[t]}.external_storage",
                    type(storage).__name__,
                    f"stores {storage.score_words} score word(s) per key; the table's "
                    f"score_strategy needs {words}",
                )
            below[t] = StorageSlot(storage, i)
