"""Model-level scores (spec: ``get_score`` / ``set_score``): the score each dynamic table gives
the keys of its next forward, read as an ``incremental_dump`` threshold, and the scores users
register for CUSTOMIZED tables."""

from __future__ import annotations

from collections.abc import Mapping

from demb_kernels.table import ScorePolicy
from torch import nn

from demb_torchrec.errors import ConfigError, InputTypeError
from demb_torchrec.model_tables import ModelTable, dynamic_tables

__all__ = ["current_scores", "get_score", "set_score"]

_MAX_SCORE = 2**63 - 1

ScoreMap = dict[str, dict[str, int]]


def current_scores(tables: list[ModelTable]) -> list[int]:
    """The current score of each table (one reading per fused module: its tables share it)."""
    read: dict[int, list[int]] = {}
    out = []
    for t in tables:
        key = id(t.module.tables)
        if key not in read:
            read[key] = t.module.tables.current_scores()
        out.append(read[key][t.index])
    return out


def get_score(model: nn.Module) -> ScoreMap | None:
    """The score each dynamic table gives the keys of its next forward:
    ``{collection: {table: score}}``, or None when the model has no dynamic table.

    TIMESTAMP (and NO_EVICTION, (TIMESTAMP, LFU)): a clock reading that splits time exactly,
    later than every key scored so far and not later than the next forward's (the device's
    global timer on CUDA, a monotonic clock on the CPU); STEP: the table's step after its last
    forward (the next forward's step); CUSTOMIZED: the registered score; LFU: 0 (an LFU table
    has no batch score, so a dump thresholded on it holds every key). Use it as the threshold
    of a later :func:`~demb_torchrec.incremental_dump`: that dump then holds exactly the keys
    touched since.
    """
    tables = dynamic_tables(model)
    if not tables:
        return None
    out: ScoreMap = {}
    for t, score in zip(tables, current_scores(tables), strict=True):
        out.setdefault(t.collection, {})[t.name] = score
    return out


def _score(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputTypeError("table_score", f"the score must be an int, got {value!r}", where)
    if not 0 <= value <= _MAX_SCORE:
        raise ConfigError(f"set_score: {where}: the score {value} is outside [0, 2**63 - 1]")
    return value


def set_score(model: nn.Module, table_score: int | Mapping[str, Mapping[str, int]]) -> None:
    """Register the score the next forwards give the keys of CUSTOMIZED tables.

    Args:
        model: holds the dynamic tables.
        table_score: an int for every CUSTOMIZED table of the model, or
            ``{collection: {table: score}}`` for the tables it names (each must be CUSTOMIZED).

    Warns when a score is lower than the table's previous one, unless
    ``DYNAMICEMB_CSTM_SCORE_CHECK=0`` was set when the table was built.

    Raises:
        ValueError: a named collection or table the model lacks, a table that is not
            CUSTOMIZED, an int given to a model without CUSTOMIZED tables, or a score outside
            ``[0, 2**63 - 1]``.
        TypeError: a score that is not an int.
    """
    tables = dynamic_tables(model)
    custom = [
        t for t in tables if t.module.tables.index.policy_list[t.index] is ScorePolicy.CUSTOMIZED
    ]
    if not isinstance(table_score, Mapping):
        score = _score(table_score, "every table")
        if not custom:
            raise ConfigError(
                "set_score: the model has no CUSTOMIZED table (only those take set scores; "
                f"its tables: {sorted((t.collection, t.name) for t in tables)})"
            )
        for t in custom:
            t.module.tables.set_score(t.index, score)
        return
    by_name = {(t.collection, t.name): t for t in tables}
    picked = []
    for collection, scores in table_score.items():
        for name, value in scores.items():
            where = f"{collection}/{name}"
            if (collection, name) not in by_name:
                raise ConfigError(
                    f"set_score: no dynamic table {where} in the model (it has {sorted(by_name)})"
                )
            t = by_name[(collection, name)]
            if t not in custom:
                strategy = t.module.options[t.index].score_strategy
                raise ConfigError(
                    f"set_score: table {where} scores by {strategy!r}; only CUSTOMIZED tables "
                    "take set scores"
                )
            picked.append((t, _score(value, where)))
    for t, score in picked:  # every name checked before any score is set
        t.module.tables.set_score(t.index, score)
