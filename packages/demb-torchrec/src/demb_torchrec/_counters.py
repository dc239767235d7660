"""Admission counters in checkpoints: a table's counter (the keys waiting to be admitted and
their counts) travels in its shard's ``admit_keys`` / ``admit_counts`` parts (demb-io's format,
checksummed and listed in the manifest like every part), read back by a load into the tables
that own each key."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import torch
from demb_io import ShardData, ShardMeta
from demb_planner import owner_rank
from demb_storage import MultiTableKVCounter, MultiTableProbabilisticAdmitter

from demb_torchrec.errors import NotSupportedError
from demb_torchrec.model_tables import ModelTable

__all__ = [
    "CounterRows",
    "admit_calls",
    "attach_counter",
    "counter_rows",
    "load_calls",
    "load_counter",
    "restore_calls",
    "restore_counter",
    "with_counter",
]

CounterRows = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]
"""``(m,)`` int64 keys and their ``(m,)`` int64 counts."""


def _counter(t: ModelTable) -> tuple[MultiTableKVCounter, int] | None:
    """Table ``t``'s counter and its id there, or None when it keeps none."""
    admission = t.module.admission
    found = None if admission is None else admission.counter_of(t.index)
    if found is None:
        return None
    counter, local = found
    if not isinstance(counter, MultiTableKVCounter):
        raise NotSupportedError(
            "counter",
            f"{type(counter).__name__} is not a MultiTableKVCounter: demb checkpoints only "
            "KVCounter state (dump and load with counter=False to leave it out)",
            table=f"{t.collection}/{t.name}",
        )
    return counter, local


def counter_rows(t: ModelTable) -> CounterRows | None:
    """Table ``t``'s counter now (on the host), or None when it keeps none."""
    found = _counter(t)
    if found is None:
        return None
    counter, local = found
    keys, counts = counter.export(local)
    return keys.cpu().numpy().astype(np.int64), counts.cpu().numpy().astype(np.int64)


def with_counter(meta: ShardMeta, rows: CounterRows | None, calls: int | None = None) -> ShardMeta:
    """``meta`` announcing the admission parts when ``rows`` is given, and the probabilistic
    admitter's call count ``calls`` (see :func:`admit_calls`)."""
    if calls is not None:
        meta = dataclasses.replace(meta, admit_calls=calls)
    if rows is None:
        return meta
    return dataclasses.replace(meta, admission_rows=0)


def _probabilistic(t: ModelTable) -> MultiTableProbabilisticAdmitter | None:
    admission = t.module.admission
    admitter = None if admission is None else admission.admitter_of(t.index)
    return admitter if isinstance(admitter, MultiTableProbabilisticAdmitter) else None


def admit_calls(t: ModelTable) -> int | None:
    """Table ``t``'s probabilistic admitter's call count (the toss index of its next call:
    restored, a resumed run tosses as an uninterrupted one), or None when it has none."""
    admitter = _probabilistic(t)
    return None if admitter is None else admitter.calls


def load_calls(t: ModelTable, metas: list[ShardMeta]) -> None:
    """Table ``t``'s probabilistic admitter's call count from its checkpoint shards
    (``metas``): this rank's own shard's when the world size is the checkpoint's, else the
    largest (each toss index then unused here); left as it is when no shard has one."""
    admitter = _probabilistic(t)
    found = [m for m in metas if m.admit_calls is not None]
    if admitter is None or not found:
        return
    own = [m for m in found if m.world_size == t.world_size and m.rank == t.rank]
    calls = own[0].admit_calls if own else max(m.admit_calls or 0 for m in found)
    assert calls is not None
    admitter.calls = calls


def restore_calls(t: ModelTable, calls: int | None) -> None:
    """Table ``t``'s probabilistic admitter's call count put back (a failed load's undo)."""
    admitter = _probabilistic(t)
    if admitter is not None and calls is not None:
        admitter.calls = calls


def attach_counter(chunks: Iterator[ShardData], rows: CounterRows | None) -> Iterator[ShardData]:
    """``chunks`` (at least one), the first carrying the counter ``rows`` when given."""
    for i, chunk in enumerate(chunks):
        if i == 0 and rows is not None:
            yield dataclasses.replace(chunk, admit_keys=rows[0], admit_counts=rows[1])
        else:
            yield chunk


def load_counter(t: ModelTable, metas: list[ShardMeta], found: list[CounterRows]) -> None:
    """Replace table ``t``'s counter with the counter rows ``found`` in its checkpoint shards
    (``metas``) that this rank owns; a checkpoint without counters warns once and leaves the
    counter empty (counting starts from zero)."""
    target = _counter(t)
    if target is None:
        return
    counter, local = target
    counter.clear(local)
    if all(m.admission_rows is None for m in metas):
        warnings.warn(
            f"table {t.collection}/{t.name}: the checkpoint holds no admission counter; its "
            "counts start from zero",
            stacklevel=3,
        )
        return
    for keys, counts in found:
        mine = owner_rank(keys, t.world_size, t.dist_type, t.block_size()) == t.rank
        if mine.any():
            _import(counter, local, (keys[mine], counts[mine]))


def restore_counter(t: ModelTable, rows: CounterRows | None) -> None:
    """Table ``t``'s counter put back to ``rows`` (a failed load's undo)."""
    target = _counter(t)
    if target is None or rows is None:
        return
    counter, local = target
    counter.clear(local)
    _import(counter, local, rows)


def _import(counter: MultiTableKVCounter, local: int, rows: CounterRows) -> None:
    """Host counter ``rows`` inserted into table ``local`` of ``counter``."""
    device = counter.device
    keys, counts = (torch.from_numpy(a).to(device) for a in rows)
    counter.import_(local, keys, counts)
