"""``DynamicEmbParameterConstraints``: the one place a user marks a TorchRec table dynamic, and
the checks and per-rank preparation the planner runs on it (spec: "Sharding planner", steps
1-3).

Worked example: a table of ``num_embeddings=1000``, ``embedding_dim=16`` planned on 3 ranks with
``bucket_capacity=128`` and ``global_hbm_for_values=1000``: each rank holds ``ceil(1000 / 3) =
334`` rows aligned up to 384 (3 buckets of 128), so ``max_capacity = init_capacity = 384``,
``dim = 16``, ``local_hbm_for_values = 334`` and UNIFORM bounds ``±1/sqrt(1000)``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from demb_planner import (
    DistType,
    SupportsEmbeddingShape,
    align_init_capacity,
    local_hbm_for_values,
    sharded_table_bucket_layout,
)
from demb_storage import InitializerArgs, InitializerMode
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from demb_torchrec.errors import ConfigError
from demb_torchrec.options import DynamicEmbTableOptions

__all__ = [
    "DynamicEmbParameterConstraints",
    "check_constraints",
    "complete_initializer_args",
    "prepare_table_options",
]


@dataclass
class DynamicEmbParameterConstraints(ParameterConstraints):  # type: ignore[misc]
    """TorchRec's ``ParameterConstraints`` plus the dynamic-table switch and options.

    Attributes:
        use_dynamicemb: plan this table as a dynamic table.
        dynamicemb_options: the table's options (each constraint gets its own default
            instance); the planner fills the per-rank fields (see
            :func:`prepare_table_options`).
    """

    use_dynamicemb: bool | None = False
    dynamicemb_options: DynamicEmbTableOptions | None = field(
        default_factory=DynamicEmbTableOptions
    )

    def __hash__(self) -> int:
        return int(super().__hash__())


def check_constraints(
    eb_configs: Sequence[BaseEmbeddingConfig],
    constraints: Mapping[str, ParameterConstraints] | None,
) -> None:
    """The planner's first check: every table name appears once in ``eb_configs``, and the keys
    of ``constraints`` (when given) are exactly those names.

    Raises:
        ValueError: naming the duplicated, unconstrained or unknown tables.
    """
    names = [c.name for c in eb_configs]
    twice = sorted(n for n, k in Counter(names).items() if k > 1)
    if twice:
        raise ConfigError(f"eb_configs: tables {twice} appear more than once")
    if constraints is None:
        return
    missing = sorted(set(names) - set(constraints))
    if missing:
        raise ConfigError(f"constraints: no entry for tables {missing} of eb_configs")
    extra = sorted(set(constraints) - set(names))
    if extra:
        raise ConfigError(f"constraints: keys {extra} are not tables of eb_configs")


def complete_initializer_args(
    args: InitializerArgs, embedding_config: SupportsEmbeddingShape | None = None
) -> InitializerArgs:
    """Step 1: a copy of ``args`` with missing UNIFORM / TRUNCATED_NORMAL bounds filled:
    ``±1/sqrt(num_embeddings)`` of ``embedding_config``; without one, UNIFORM gets 0.0 and
    1.0. Other modes are returned unchanged."""
    if embedding_config is not None:
        return args.complete(embedding_config.num_embeddings)
    if args.mode is not InitializerMode.UNIFORM:
        return dataclasses.replace(args)
    return dataclasses.replace(
        args,
        lower=0.0 if args.lower is None else args.lower,
        upper=1.0 if args.upper is None else args.upper,
    )


def prepare_table_options(
    options: DynamicEmbTableOptions,
    embedding_config: SupportsEmbeddingShape,
    world_size: int,
) -> DynamicEmbTableOptions:
    """The options one rank's shard of a row-wise sharded dynamic table gets (a new object):

    1. ``initializer_args`` completed (:func:`complete_initializer_args`); ``dim`` set to the
       config's ``embedding_dim``.
    2. ``bucket_capacity`` set to the effective bucket width and ``max_capacity`` to the
       per-rank slots (:func:`demb_planner.sharded_table_bucket_layout`); ``init_capacity``
       becomes ``max_capacity`` if unset, else it is aligned up to the bucket width and
       clamped to ``max_capacity``.
    3. ``local_hbm_for_values`` set to ``ceil(global_hbm_for_values / world_size)``.

    Raises:
        demb_planner.PlannerConfigError: a bad ``bucket_capacity``, ``init_capacity``,
            ``dist_type``, row count or world size, naming it.
    """
    DistType.parse(options.dist_type)  # refused here, at planning, rather than at a forward
    layout = sharded_table_bucket_layout(embedding_config, world_size, options.bucket_capacity)
    return dataclasses.replace(
        options,
        initializer_args=complete_initializer_args(options.initializer_args, embedding_config),
        dim=embedding_config.embedding_dim,
        bucket_capacity=layout.bucket_width,
        max_capacity=layout.capacity,
        init_capacity=align_init_capacity(
            options.init_capacity, layout.bucket_width, layout.capacity
        ),
        local_hbm_for_values=local_hbm_for_values(options.global_hbm_for_values, world_size),
    )
