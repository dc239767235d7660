"""Incremental dumps on disk: a model's :class:`~demb_torchrec.DeltaDumpResult`\\ s written in
demb-io's delta format (atomic, checksummed, with a manifest) and read back, so that
``demb-io inspect / verify / merge / apply`` work on what training produced.

A table's ``table_options`` travel as the JSON settings :data:`OPTION_FIELDS` names; reading
them back gives a ``DynamicEmbTableOptions`` with those fields (the others at their defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from demb_io import DeltaMeta, DeltaTable, iter_delta, write_delta
from demb_storage import SafeCheckMode, ScoreStrategy

from demb_torchrec._background import DumpHandle
from demb_torchrec.errors import ConfigError
from demb_torchrec.incremental import DeltaDumpResult
from demb_torchrec.model_tables import dtype_name, from_numpy, to_numpy
from demb_torchrec.options import DynamicEmbTableOptions, EvictedItemMode

__all__ = ["OPTION_FIELDS", "delta_tables", "read_delta_dump", "write_delta_dump"]

OPTION_FIELDS = (
    "dim",
    "max_capacity",
    "init_capacity",
    "bucket_capacity",
    "max_load_factor",
    "dist_type",
    "training",
    "evicted_item_mode",
    "safe_check_mode",
)
"""The ``DynamicEmbTableOptions`` fields a delta file keeps (with ``embedding_dtype`` and
``score_strategy``, which the delta meta holds itself)."""

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _options_json(options: DynamicEmbTableOptions) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in OPTION_FIELDS:
        value = getattr(options, name)
        out[name] = int(value) if isinstance(value, EvictedItemMode | SafeCheckMode) else value
    return out


def _options(settings: Mapping[str, Any], meta: DeltaMeta) -> DynamicEmbTableOptions:
    fields = {k: v for k, v in settings.items() if k in OPTION_FIELDS}
    if "evicted_item_mode" in fields:
        fields["evicted_item_mode"] = EvictedItemMode(fields["evicted_item_mode"])
    if "safe_check_mode" in fields:
        fields["safe_check_mode"] = SafeCheckMode(fields["safe_check_mode"])
    strategy = tuple(ScoreStrategy[name] for name in meta.score_strategy)
    return DynamicEmbTableOptions(
        **fields,
        embedding_dtype=_DTYPES[meta.embedding_dtype],
        score_strategy=strategy[0] if len(strategy) == 1 else strategy,
    )


def _keys(t: torch.Tensor) -> npt.NDArray[np.int64]:
    return t.detach().cpu().numpy().astype(np.int64, copy=False)


def delta_tables(deltas: Mapping[str, DeltaDumpResult]) -> list[DeltaTable]:
    """The tables of ``deltas`` as demb-io :class:`~demb_io.DeltaTable`\\ s (host copies)."""
    out = []
    for collection, d in deltas.items():
        for i, name in enumerate(d.table_names):
            meta, values, state = d.meta[i], d.values[i], d.optimizer_states[i]
            options = meta["table_options"]
            evicted = d.evicted_keys[i]
            erased = d.erased_keys[i]
            freed = meta.get("erased_slot_index")
            out.append(
                DeltaTable(
                    meta=DeltaMeta(
                        collection=collection,
                        table=name,
                        embedding_dtype=dtype_name(values.dtype),
                        embedding_dim=int(values.shape[1]),
                        score_strategy=tuple(meta["score_strategy"]),
                        current_score=int(meta["current_score"]),
                        current_capacity=int(meta["current_capacity"]),
                        row_capacity=tuple(int(r) for r in meta["row_capacity"]),
                        bucket_capacity=int(meta["bucket_capacity"]),
                        world_size=int(meta["world_size"]),
                        dist_type=str(options.dist_type),
                        optim_state_dtype=None if state is None else dtype_name(state.dtype),
                        state_width=0 if state is None else int(state.shape[1]),
                        evicted_rows=None if evicted is None else int(evicted.numel()),
                        erased_slots=freed is not None,
                        table_options=_options_json(options),
                    ),
                    keys=_keys(d.keys[i]),
                    values=to_numpy(values),
                    scores=to_numpy(d.scores[i]).astype(np.int64, copy=False),
                    slots=_keys(meta["slot_index"]),
                    state=None if state is None else to_numpy(state),
                    erased=np.zeros(0, np.int64) if erased is None else _keys(erased),
                    evicted=None if evicted is None else _keys(evicted),
                    erased_slots=None if freed is None else _keys(freed),
                )
            )
    return out


def write_delta_dump(
    path: str | Path, deltas: Mapping[str, DeltaDumpResult], *, blocking: bool = True
) -> list[DeltaMeta] | DumpHandle:
    """Write ``deltas`` (an :func:`~demb_torchrec.incremental_dump` result) as the demb-io delta
    directory ``path``, committed atomically (the previous one at ``path`` stays whole until
    then).

    Args:
        path: the delta directory (created or replaced).
        deltas: ``{collection: DeltaDumpResult}`` (host tensors: the dump's own copy, so
            training may go on while they are written).
        blocking: write before returning; False: write in a background thread and return its
            :class:`~demb_torchrec.dump.DumpHandle` (``wait()`` raises what the write raised;
            it is local to this process, not collective). ``deltas`` must not be changed until
            the write is done.

    Returns:
        The table metas as written (``blocking=False``: the handle).

    Raises:
        ValueError: a table whose arrays disagree with its meta, or a delta missing a field
            (checked before anything is written, also with ``blocking=False``).
    """
    try:
        tables = delta_tables(deltas)
    except (KeyError, AttributeError, IndexError, TypeError) as err:
        raise ConfigError(f"write_delta_dump: a delta misses a field ({err!r})") from err
    for t in tables:
        t.check()
    if blocking:
        return write_delta(path, tables)

    def work() -> None:
        write_delta(path, tables)

    def finish(error: BaseException | None) -> None:
        if error is not None:
            raise error

    return DumpHandle(work, finish, name="demb-delta")


def read_delta_dump(path: str | Path, *, verify: bool = True) -> dict[str, DeltaDumpResult]:
    """Read a delta directory (written by :func:`write_delta_dump`, merged by ``demb-io
    merge``, ...) back into ``{collection: DeltaDumpResult}`` for
    :func:`~demb_torchrec.replay_increment`.

    Raises:
        demb_io.FormatError: not a delta, or a truncated, corrupted or inconsistent file
            (nothing is returned).
    """
    out: dict[str, DeltaDumpResult] = {}
    for t in iter_delta(path, verify=verify):
        m = t.meta
        result = out.setdefault(m.collection, DeltaDumpResult())
        dtype = _DTYPES[m.embedding_dtype]
        result.table_names.append(m.table)
        result.keys.append(torch.from_numpy(t.keys.copy()))
        result.values.append(from_numpy(t.values, dtype))
        state_dtype = None if m.optim_state_dtype is None else _DTYPES[m.optim_state_dtype]
        result.optimizer_states.append(
            None if t.state is None or state_dtype is None else from_numpy(t.state, state_dtype)
        )
        result.scores.append(torch.from_numpy(t.scores.copy()))
        result.erased_keys.append(torch.from_numpy(t.erased.copy()))
        result.evicted_keys.append(None if t.evicted is None else torch.from_numpy(t.evicted))
        result.meta.append(
            {
                "current_score": m.current_score,
                "slot_index": torch.from_numpy(t.slots.copy()),
                "current_capacity": m.current_capacity,
                "row_capacity": tuple(m.row_capacity),
                "bucket_capacity": m.bucket_capacity,
                "num_scores": m.num_scores,
                "world_size": m.world_size,
                "table_options": _options(m.table_options, m),
                "score_strategy": tuple(m.score_strategy),
            }
        )
        if t.erased_slots is not None:
            result.meta[-1]["erased_slot_index"] = torch.from_numpy(t.erased_slots.copy())
    return out
