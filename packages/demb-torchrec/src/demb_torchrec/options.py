"""The spec's public option types: ``DynamicEmbTableOptions`` and the enums around it.

They carry the spec's names and signatures so that code written against the spec runs after
changing its import; the work is done by demb's own types (``demb_storage.TableConfig``,
``demb_storage.InitializerArgs``, ``demb_optim`` specs), which :func:`table_config` and the
table module build from them. Fields whose feature is not built yet raise
``NotImplementedError`` naming the field when set (see :func:`check_supported`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from demb_planner import DistType
from demb_storage import (
    InitializerArgs,
    InitializerMode,
    SafeCheckMode,
    ScoreStrategy,
    TableConfig,
    TableConfigError,
)

from demb_torchrec.errors import NotSupportedError

__all__ = [
    "DynamicEmbCheckMode",
    "DynamicEmbEvictStrategy",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbOptimType",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "EvictedItemMode",
    "check_supported",
    "table_config",
]

DynamicEmbScoreStrategy = ScoreStrategy
"""The spec's name of :class:`demb_storage.ScoreStrategy`."""
DynamicEmbCheckMode = SafeCheckMode
"""The spec's name of :class:`demb_storage.SafeCheckMode`."""
DynamicEmbInitializerMode = InitializerMode
"""The spec's name of :class:`demb_storage.InitializerMode`."""
DynamicEmbInitializerArgs = InitializerArgs
"""The spec's name of :class:`demb_storage.InitializerArgs`."""


@enum.unique
class DynamicEmbPoolingMode(enum.IntEnum):
    """How a table module combines the rows of a bag (the spec's values)."""

    SUM = 0
    """Sum of the bag's rows (optionally weighted); output ``(B, sum of dims)``."""
    MEAN = 1
    """Mean of the bag's rows; an empty bag gives zeros."""
    NONE = 2
    """No pooling (sequence): one row per index, output ``(N, D)``."""


@enum.unique
class DynamicEmbOptimType(enum.Enum):
    """Optimizers FBGEMM's ``EmbOptimType`` has no member for; accepted wherever an optimizer
    type is. Never equal to an ``EmbOptimType``."""

    FTRL = "ftrl"


class DynamicEmbEvictStrategy(enum.IntEnum):
    """The legacy eviction knob. demb evicts by ``score_strategy``; only the default is
    accepted."""

    LRU = 0


class EvictedItemMode(enum.IntEnum):
    """What the last storage tier does with a key it evicts."""

    DISCARD = 0
    """Drop it."""
    RETAIN_KEY = 1
    """Keep the (key, table) for ``pop_evicted_keys``."""


def _eval_default() -> InitializerArgs:
    return InitializerArgs(mode=InitializerMode.CONSTANT, value=0.0)


@dataclass
class DynamicEmbTableOptions:
    """Per-table options of a dynamic table (the spec's ``DynamicEmbTableOptions``).

    The fields and defaults are the spec's; see the README's table of options for what each
    does here. ``dim`` and ``max_capacity`` are required by the table module (the planner fills
    them in a sharded model).
    """

    embedding_dtype: torch.dtype | None = None
    dim: int | None = None
    max_capacity: int | None = None
    evict_strategy: DynamicEmbEvictStrategy = DynamicEmbEvictStrategy.LRU
    local_hbm_for_values: int = 0
    device_id: int | None = None
    training: bool = True
    initializer_args: InitializerArgs = field(default_factory=InitializerArgs)
    eval_initializer_args: InitializerArgs = field(default_factory=_eval_default)
    caching: bool = False
    init_capacity: int | None = None
    max_load_factor: float = 0.5
    score_strategy: ScoreStrategy | tuple[ScoreStrategy, ...] = ScoreStrategy.TIMESTAMP
    bucket_capacity: int = 128
    safe_check_mode: SafeCheckMode = SafeCheckMode.IGNORE
    global_hbm_for_values: int = 0
    external_storage: Any = None
    index_type: torch.dtype | None = None
    admit_strategy: Any = None
    admission_counter: Any = None
    evicted_item_mode: EvictedItemMode = EvictedItemMode.DISCARD
    score_function: Callable[..., float] | None = None
    dist_type: str = "roundrobin"
    """How row-wise sharding routes keys to ranks: ``"roundrobin"`` (default),
    ``"hash_roundrobin"`` or ``"continuous"`` (:mod:`demb_planner.ownership`)."""


_NOT_YET: dict[str, tuple[Callable[[Any], bool], str]] = {
    "evict_strategy": (
        lambda v: v != DynamicEmbEvictStrategy.LRU,
        "demb evicts by score_strategy; evict_strategy takes only its default",
    ),
}


def check_supported(options: DynamicEmbTableOptions, table: str) -> None:
    """Raise ``NotImplementedError`` naming the first field of ``options`` that is set to a
    value whose feature demb does not have yet."""
    for name, (is_set, why) in _NOT_YET.items():
        if is_set(getattr(options, name)):
            raise NotSupportedError(
                f"DynamicEmbTableOptions.{name}",
                f"{getattr(options, name)!r} is not supported yet ({why})",
                table=table,
            )
    if options.global_hbm_for_values and not options.local_hbm_for_values:
        raise TableConfigError(
            "global_hbm_for_values",
            options.global_hbm_for_values,
            f"table {table!r}: the planner splits it into local_hbm_for_values per rank; a "
            "table module built without the planner takes local_hbm_for_values",
        )
    for name in ("local_hbm_for_values", "global_hbm_for_values"):
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise TableConfigError(name, value, f"table {table!r}: must be an int >= 0 (bytes)")
    if options.caching and not options.local_hbm_for_values:
        raise TableConfigError(
            "local_hbm_for_values",
            0,
            f"table {table!r}: caching=True sizes its device cache from this budget (bytes of "
            "value rows); 0 leaves no room for one",
        )
    if options.index_type not in (None, torch.int64, torch.int32):
        raise TableConfigError("index_type", options.index_type, "must be torch.int64 or int32")
    if options.evicted_item_mode not in list(EvictedItemMode):
        raise TableConfigError(
            "evicted_item_mode", options.evicted_item_mode, "must be an EvictedItemMode"
        )
    dist_types = [d.value for d in DistType]
    if options.dist_type not in dist_types:
        raise TableConfigError("dist_type", options.dist_type, f"must be one of {dist_types}")


def table_config(options: DynamicEmbTableOptions, state_dim: int, table: str) -> TableConfig:
    """The :class:`demb_storage.TableConfig` of one table: its options plus the optimizer's
    ``state_dim`` columns (0 when ``training=False``)."""
    check_supported(options, table)
    for name in ("dim", "max_capacity"):
        if getattr(options, name) is None:
            raise TableConfigError(
                name, None, f"table {table!r} needs it (the planner sets it in a sharded model)"
            )
    dim, max_capacity = options.dim, options.max_capacity
    assert dim is not None
    assert max_capacity is not None
    try:
        return _config(options, state_dim, dim, max_capacity)
    except TableConfigError as e:  # named: the table and the option
        raise TableConfigError(e.option, e.value, f"table {table!r}: {e.reason}") from None


def _config(
    options: DynamicEmbTableOptions, state_dim: int, dim: int, max_capacity: int
) -> TableConfig:
    return TableConfig(
        dim=dim,
        max_capacity=max_capacity,
        init_capacity=options.init_capacity,
        state_dim=state_dim if options.training else 0,
        dtype=options.embedding_dtype or torch.float32,
        bucket_capacity=options.bucket_capacity,
        max_load_factor=options.max_load_factor,
        score_strategy=options.score_strategy,
        safe_check_mode=options.safe_check_mode,
        retain_evicted=EvictedItemMode(options.evicted_item_mode) is EvictedItemMode.RETAIN_KEY,
        score_function=options.score_function,
    )
