"""Keys that left a model's dynamic tables (spec: ``pop_evicted_keys`` / ``pop_erased_keys``)
and the model-level erase that records them.

Evictions are recorded by tables built with ``evicted_item_mode=RETAIN_KEY`` (the others record
nothing and pay nothing); erases are recorded when the erase call asks to (``mode``). Both are
read and cleared per table: each key is reported once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from demb_storage import KeyBuffer, ScoredHashTable
from torch import nn

from demb_torchrec.errors import ConfigError, InputTypeError
from demb_torchrec.model_tables import ModelTable, dynamic_tables, is_caching, select_tables
from demb_torchrec.options import EvictedItemMode

__all__ = ["erase_keys", "pop_erased_keys", "pop_evicted_keys"]

KeysByTable = dict[str, dict[str, torch.Tensor]]


def _pop(
    model: nn.Module,
    table_names: Mapping[str, Sequence[str]] | None,
    pg: dist.ProcessGroup | None,
    wanted: Callable[[ModelTable], bool],
    buffer: Callable[[ScoredHashTable], KeyBuffer],
) -> KeysByTable:
    if pg is not None and not (dist.is_available() and dist.is_initialized()):
        raise ConfigError("pg: given, but torch.distributed is not initialized")
    tables = [t for t in select_tables(dynamic_tables(model), table_names) if wanted(t)]
    out: KeysByTable = {}
    for t in tables:
        keys = buffer(t.module.tables).pop(t.index)
        if pg is not None:
            everyone: list[torch.Tensor | None] = [None] * pg.size()
            dist.all_gather_object(everyone, keys, group=pg)
            keys = torch.unique(torch.cat([k for k in everyone if k is not None]))
        out.setdefault(t.collection, {})[t.name] = keys
    return out


def pop_evicted_keys(
    model: nn.Module,
    table_names: Mapping[str, Sequence[str]] | None = None,
    pg: dist.ProcessGroup | None = None,
) -> KeysByTable:
    """Return and clear the keys evicted since the last call (or the last incremental dump),
    per table with ``evicted_item_mode=RETAIN_KEY``; other tables are omitted.

    Args:
        model: holds the dynamic tables.
        table_names: ``{collection: [table, ...]}`` to pop; default every retaining table.
        pg: gather every rank's keys over this group (each rank gets the union; each clears
            only its own); None: this rank's keys.

    Returns:
        ``{collection: {table: keys}}``, keys a 1-D int64 host tensor of distinct keys,
        ascending; ``{}`` when no table retains evictions.
    """

    def retains(t: ModelTable) -> bool:  # the option: a cache's own config retains nothing
        mode = EvictedItemMode(t.module.options[t.index].evicted_item_mode)
        return mode is EvictedItemMode.RETAIN_KEY

    return _pop(model, table_names, pg, retains, lambda s: s.evicted_keys)


def pop_erased_keys(
    model: nn.Module,
    table_names: Mapping[str, Sequence[str]] | None = None,
    pg: dist.ProcessGroup | None = None,
) -> KeysByTable:
    """Return and clear the keys recorded by :func:`erase_keys` calls (``mode=RETAIN_KEY``)
    since the last call (or the last incremental dump), for every table (an empty tensor when
    none). Arguments and result as :func:`pop_evicted_keys`."""
    return _pop(model, table_names, pg, lambda t: True, lambda s: s.erased_keys)


def erase_keys(
    model: nn.Module,
    keys: Mapping[str, Mapping[str, torch.Tensor]],
    mode: EvictedItemMode = EvictedItemMode.RETAIN_KEY,
) -> dict[str, dict[str, int]]:
    """Remove keys from the model's dynamic tables (the keys this rank holds).

    Args:
        model: holds the dynamic tables.
        keys: ``{collection: {table: keys}}``, keys a 1-D int64 tensor.
        mode: ``RETAIN_KEY`` (default) records the keys removed for :func:`pop_erased_keys`
            and the next incremental dump's ``erased_keys``, so replicas remove them too;
            ``DISCARD`` records nothing.

    Returns:
        ``{collection: {table: keys removed}}``.

    Raises:
        ValueError: a table the model lacks; TypeError: keys that are not a 1-D int64 tensor.
    """
    record = EvictedItemMode(mode) is EvictedItemMode.RETAIN_KEY
    names = {c: list(per_table) for c, per_table in keys.items()}
    tables = {(t.collection, t.name): t for t in select_tables(dynamic_tables(model), names)}
    for collection, per_table in keys.items():
        for name, k in per_table.items():
            if not isinstance(k, torch.Tensor) or k.dtype != torch.int64 or k.dim() != 1:
                raise InputTypeError("keys", "must be a 1-D int64 tensor", f"{collection}/{name}")
    out: dict[str, dict[str, int]] = {}
    with torch.no_grad():
        for collection, per_table in keys.items():
            for name, k in per_table.items():
                t = tables[(collection, name)]
                s = t.module.tables
                device_keys = k.to(s.device)
                ids = torch.full_like(device_keys, t.index)
                freed = s.erase(device_keys, ids, record=record)
                removed = int((freed >= 0).sum())
                if t.module.cache is not None and is_caching(t):  # and from its storage
                    removed += t.module.cache.erase(t.index, device_keys, record)
                out.setdefault(collection, {})[name] = removed
    return out
