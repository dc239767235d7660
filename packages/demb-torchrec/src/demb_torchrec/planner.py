"""Planning a TorchRec model whose tables are partly dynamic (spec: ``DynamicEmbeddingEnumerator``,
``DynamicEmbeddingShardingPlanner``, "Sharding planner").

A table is dynamic when its constraints are ``DynamicEmbParameterConstraints(use_dynamicemb=True)``.
Dynamic tables are planned row-wise on TorchRec's ``CUSTOMIZED_KERNEL`` (the kernel a dynamic-table
sharder offers); every other table is planned by TorchRec as usual, never on that kernel. The
planner first checks its inputs and prepares each dynamic table's per-rank options
(:func:`demb_torchrec.constraints.prepare_table_options`); its plan carries those options to the
sharders in :class:`DynamicEmbParameterSharding`. FTRL, which only dynamic tables run, is refused
at plan time on any other table that is not data-parallel (data-parallel tables are updated by the
dense optimizer), naming the table.

Example::

    constraints = {
        "user": DynamicEmbParameterConstraints(
            use_dynamicemb=True, dynamicemb_options=DynamicEmbTableOptions(bucket_capacity=128)
        ),
        "item": ParameterConstraints(),
    }
    planner = DynamicEmbeddingShardingPlanner(eb_configs, topology, constraints=constraints)
    plan = planner.collective_plan(model, sharders, pg)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from demb_optim import optimizer_state_bytes
from demb_planner import dtype_bytes, local_hbm_for_values
from demb_storage import FrequencyAdmissionStrategy
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.constants import BATCH_SIZE
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import (
    Enumerator,
    ParameterConstraints,
    Partitioner,
    PerfModel,
    Proposer,
    ShardEstimator,
    ShardingOption,
    Stats,
    Storage,
    StorageReservation,
    Topology,
)
from torchrec.distributed.types import (
    ModuleSharder,
    ParameterSharding,
    ShardingPlan,
    ShardingType,
)
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from demb_torchrec.constraints import (
    DynamicEmbParameterConstraints,
    check_constraints,
    prepare_table_options,
)
from demb_torchrec.errors import ConfigError
from demb_torchrec.optimizers import FTRL, dynamic_optimizer_kind
from demb_torchrec.options import DynamicEmbTableOptions

__all__ = [
    "TABLES_KEY",
    "DynamicEmbParameterConstraints",
    "DynamicEmbParameterSharding",
    "DynamicEmbPerfEstimator",
    "DynamicEmbStorageEstimator",
    "DynamicEmbeddingEnumerator",
    "DynamicEmbeddingShardingPlanner",
    "PlannedTables",
    "dynamic_options",
]

_ROW_WISE = ShardingType.ROW_WISE.value
_CUSTOMIZED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
_FUSED = EmbeddingComputeKernel.FUSED.value
_INDEX_BYTES_PER_SLOT = 8 + 1  # key + digest; score words come on top (8 bytes each)


def dynamic_options(
    constraints: Mapping[str, ParameterConstraints] | None, table: str
) -> DynamicEmbTableOptions | None:
    """The options of ``table`` if its constraints make it dynamic, else None."""
    c = (constraints or {}).get(table)
    if not isinstance(c, DynamicEmbParameterConstraints) or not c.use_dynamicemb:
        return None
    if c.dynamicemb_options is None:
        raise ConfigError(f"table {table!r}: use_dynamicemb=True needs dynamicemb_options")
    return c.dynamicemb_options


class PlannedTables:
    """The prepared options of one plan's dynamic tables, by table name. One object per plan:
    TorchRec groups tables by their fused params (hashing them), and this one hashes by
    identity, so a plan's dynamic tables can share a kernel."""

    def __init__(self, options: Mapping[str, DynamicEmbTableOptions]) -> None:
        self._options = dict(options)

    def __getitem__(self, table: str) -> DynamicEmbTableOptions:
        found = self._options.get(table)
        if found is None:
            raise KeyError(f"table {table!r} is not a dynamic table of this plan")
        return found

    def __contains__(self, table: object) -> bool:
        return table in self._options

    def __repr__(self) -> str:
        return f"PlannedTables({sorted(self._options)})"


TABLES_KEY = "dynamicemb_tables"
"""The fused-params key under which a dynamic table's sharding passes :class:`PlannedTables`."""


@dataclasses.dataclass
class DynamicEmbParameterSharding(ParameterSharding):  # type: ignore[misc]
    """A dynamic table's ``ParameterSharding``: TorchRec's fields plus the table's per-rank
    options; TorchRec merges :meth:`get_additional_fused_params` into this table's fused params
    (``CUSTOMIZED_KERNEL`` shardings only), after the in-backward optimizer's kwargs.

    ``additional_fused_params`` are per-table extras a trainer sets on the plan, e.g.
    ``{"initial_accumulator_value": 0.1}`` for one table's Adagrad / row-wise Adagrad / FTRL
    state (spec seed 001: the hook where dynamic and static tables can be told apart). Each must
    be something the table's optimizer takes, or sharding raises naming it.
    """

    dynamicemb_options: DynamicEmbTableOptions | None = None
    planned_tables: PlannedTables | None = None
    additional_fused_params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def get_additional_fused_params(self) -> dict[str, Any]:
        """``additional_fused_params`` plus ``{"dynamicemb_tables": the plan's
        PlannedTables}``."""
        return {**self.additional_fused_params, TABLES_KEY: self.planned_tables}


class DynamicEmbPerfEstimator(ShardEstimator):  # type: ignore[misc]
    """TorchRec's performance estimate; a dynamic table's row-wise shard is costed as a FUSED
    (FBGEMM TBE) shard of the same rows would be, TorchRec having no model of
    ``CUSTOMIZED_KERNEL``: a proxy that ranks plans, not a prediction of demb's time."""

    def __init__(
        self, topology: Topology, constraints: Mapping[str, ParameterConstraints] | None = None
    ) -> None:
        self._constraints = constraints
        self._inner = EmbeddingPerfEstimator(topology=topology, constraints=constraints)

    def estimate(
        self,
        sharding_options: list[ShardingOption],
        sharder_map: dict[str, ModuleSharder[nn.Module]] | None = None,
    ) -> None:
        """Fill ``shard.perf`` of every option."""
        self._inner.estimate([_costed_as_fused(o) for o in sharding_options], sharder_map)


def _costed_as_fused(option: ShardingOption) -> ShardingOption:
    if option.compute_kernel != _CUSTOMIZED:
        return option
    proxy = copy.copy(option)  # its shards are the original's: their perf lands there
    proxy.compute_kernel = _FUSED
    return proxy


class DynamicEmbStorageEstimator(ShardEstimator):  # type: ignore[misc]
    """TorchRec's storage estimate for static tables; for a dynamic table, each row-wise shard
    holds its prepared ``max_capacity`` slots: value rows ``[embedding | optimizer state]`` (the
    state of the table's in-backward optimizer, from demb-optim: e.g. 2 x dim for Adam and
    FTRL) plus the index (key, digest and score words per slot), on the compute device's memory
    (HBM on CUDA, DDR on the CPU). On CUDA only ``ceil(global_hbm_for_values / world_size)``
    bytes of the value rows are HBM, the others DDR (0, the default: all of them)."""

    def __init__(
        self, topology: Topology, constraints: Mapping[str, ParameterConstraints] | None = None
    ) -> None:
        self._topology = topology
        self._constraints = constraints
        self._static = EmbeddingStorageEstimator(topology=topology, constraints=constraints)

    def estimate(
        self,
        sharding_options: list[ShardingOption],
        sharder_map: dict[str, ModuleSharder[nn.Module]] | None = None,
    ) -> None:
        """Fill ``shard.storage`` of every option."""
        found = [(o, dynamic_options(self._constraints, o.name)) for o in sharding_options]
        self._static.estimate([o for o, d in found if d is None], sharder_map)
        for option, options in found:
            if options is None:
                continue
            world = self._topology.world_size
            per_shard = shard_bytes(option.name, option.tensor, options, world)
            on_gpu = self._topology.compute_device == "cuda"
            hbm, ddr = (per_shard, 0) if on_gpu else (0, per_shard)
            budget = local_hbm_for_values(options.global_hbm_for_values, world)
            if on_gpu and options.caching:  # the cache's rows on the GPU, the others on the host
                values = shard_value_bytes(option.name, option.tensor, options, world)
                hbm, ddr = per_shard - values + min(values, budget), values
                if options.external_storage is not None:  # rows outside the host's memory
                    ddr = 0
            elif on_gpu:  # the rows past the budget on the host (budget 0: every row)
                values = shard_value_bytes(option.name, option.tensor, options, world)
                device = min(values, budget)
                hbm, ddr = per_shard - values + device, values - device
            for shard in option.shards:
                shard.storage = Storage(hbm=hbm, ddr=ddr)


def shard_value_bytes(
    table: str, param: torch.Tensor, options: DynamicEmbTableOptions, world_size: int
) -> int:
    """Bytes of the value rows (embedding and optimizer state) of one rank's shard of
    dynamic table ``table``: :func:`shard_bytes` without the index and the counter."""
    return shard_bytes(table, param, options, world_size, values_only=True)


def shard_bytes(
    table: str,
    param: torch.Tensor,
    options: DynamicEmbTableOptions,
    world_size: int,
    values_only: bool = False,
) -> int:
    """Bytes one rank's shard of dynamic table ``table`` takes (see
    :class:`DynamicEmbStorageEstimator`); ``param`` is the table's (unsharded) weight, carrying
    its in-backward optimizer class. ``values_only``: the value rows' bytes alone."""
    dim = options.dim if options.dim is not None else int(param.shape[1])
    capacity = options.max_capacity
    if capacity is None:
        config = prepare_table_options(options, _Shape(int(param.shape[0]), dim), world_size)
        capacity = config.max_capacity
    assert capacity is not None
    elem = dtype_bytes(options.embedding_dtype or torch.float32)
    classes = getattr(param, "_optimizer_classes", [None])
    try:
        kind = dynamic_optimizer_kind(classes[0])
    except ValueError as e:
        raise ConfigError(f"table {table!r}: {e}") from None
    state = optimizer_state_bytes(kind, dim, elem) if kind is not None and options.training else 0
    score_words = len(options.score_strategy) if isinstance(options.score_strategy, tuple) else 1
    if values_only:
        return capacity * (dim * elem + state)
    index = _INDEX_BYTES_PER_SLOT + 8 * score_words
    return capacity * (dim * elem + state + index) + counter_bytes(options)


def counter_bytes(options: DynamicEmbTableOptions) -> int:
    """Bytes of a rank's admission counter for a table with ``options``: frequency admission
    keeps one (its ``KVCounter``'s slots, each a key, a digest and a count; every rank's shard
    of the table has its own); other strategies keep nothing."""
    strategy = options.admit_strategy
    if not isinstance(strategy, FrequencyAdmissionStrategy):
        return 0
    return strategy.counter.slots * (_INDEX_BYTES_PER_SLOT + 8)


@dataclasses.dataclass(frozen=True)
class _Shape:
    num_embeddings: int
    embedding_dim: int


class DynamicEmbeddingEnumerator(EmbeddingEnumerator):  # type: ignore[misc]
    """TorchRec's ``EmbeddingEnumerator`` that offers a dynamic table only row-wise on
    ``CUSTOMIZED_KERNEL`` and never offers that kernel to a static table. Its default
    estimators are :class:`DynamicEmbPerfEstimator` and :class:`DynamicEmbStorageEstimator`.

    Raises (from ``enumerate``):
        ValueError: a dynamic table whose constraints rule out row-wise sharding or
            ``CUSTOMIZED_KERNEL``, naming it.
    """

    def __init__(
        self,
        topology: Topology,
        batch_size: int | None = BATCH_SIZE,
        constraints: dict[str, ParameterConstraints] | None = None,
        estimator: ShardEstimator | list[ShardEstimator] | None = None,
    ) -> None:
        if estimator is None:
            estimator = [
                DynamicEmbPerfEstimator(topology=topology, constraints=constraints),
                DynamicEmbStorageEstimator(topology=topology, constraints=constraints),
            ]
        super().__init__(topology, batch_size or BATCH_SIZE, constraints, estimator)

    def enumerate(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
    ) -> list[ShardingOption]:
        """TorchRec's options, less row-wise ones of static tables in a collection that holds
        dynamic tables (one collection has one row-wise sharding, which then routes raw keys
        to dynamic tables)."""
        options: list[ShardingOption] = super().enumerate(module, sharders)
        mixed = {o.module[0] for o in options if dynamic_options(self._constraints, o.name)}
        kept = [
            o
            for o in options
            if o.sharding_type != _ROW_WISE
            or o.module[0] not in mixed
            or dynamic_options(self._constraints, o.name) is not None
        ]
        lost = sorted({o.name for o in options} - {o.name for o in kept})
        if lost:
            raise ConfigError(
                f"tables {lost}: static tables in a collection with dynamic tables cannot be "
                f"sharded {_ROW_WISE}, and their constraints allow nothing else"
            )
        return kept

    def _filter_sharding_types(
        self, name: str, allowed_sharding_types: list[str], sharder_key: str = ""
    ) -> list[str]:
        if dynamic_options(self._constraints, name) is None:
            return list(super()._filter_sharding_types(name, allowed_sharding_types, sharder_key))
        wanted = self._constraints[name].sharding_types
        if wanted and _ROW_WISE not in wanted:
            raise ConfigError(
                f"table {name!r}: dynamic tables are sharded {_ROW_WISE}; its constraints allow "
                f"only {wanted}"
            )
        return [_ROW_WISE] if _ROW_WISE in allowed_sharding_types else []

    def _filter_compute_kernels(
        self, name: str, allowed_compute_kernels: list[str], sharding_type: str
    ) -> list[str]:
        if dynamic_options(self._constraints, name) is None:
            kernels = super()._filter_compute_kernels(name, allowed_compute_kernels, sharding_type)
            return [k for k in kernels if k != _CUSTOMIZED]
        wanted = self._constraints[name].compute_kernels
        if wanted and _CUSTOMIZED not in wanted:
            raise ConfigError(
                f"table {name!r}: dynamic tables run on the {_CUSTOMIZED} kernel; its "
                f"constraints allow only {wanted}"
            )
        return [_CUSTOMIZED] if _CUSTOMIZED in allowed_compute_kernels else []


class DynamicEmbeddingShardingPlanner:
    """TorchRec's ``EmbeddingShardingPlanner`` for a model with dynamic tables (spec
    signature). Construction checks ``eb_configs`` against ``constraints``
    (:func:`demb_torchrec.constraints.check_constraints`) and prepares every dynamic table's
    ``dynamicemb_options`` for ``topology.world_size`` ranks, in place. The default topology
    is the default process group's world size (1 without one) on CUDA when available, else the
    CPU; the default enumerator is :class:`DynamicEmbeddingEnumerator`.
    """

    def __init__(
        self,
        eb_configs: Sequence[BaseEmbeddingConfig],
        topology: Topology | None = None,
        batch_size: int | None = None,
        enumerator: Enumerator | None = None,
        storage_reservation: StorageReservation | None = None,
        proposer: Proposer | list[Proposer] | None = None,
        partitioner: Partitioner | None = None,
        performance_model: PerfModel | None = None,
        stats: Stats | list[Stats] | None = None,
        constraints: dict[str, ParameterConstraints] | None = None,
        debug: bool = True,
    ) -> None:
        check_constraints(eb_configs, constraints)
        if topology is None:
            world = dist.get_world_size() if dist.is_initialized() else 1
            device = "cuda" if torch.cuda.is_available() else "cpu"
            topology = Topology(world_size=world, compute_device=device)
        self.topology = topology
        self.constraints = constraints
        for config in eb_configs:
            options = dynamic_options(constraints, config.name)
            if options is not None:
                assert constraints is not None
                prepared = prepare_table_options(options, config, topology.world_size)
                constraints[config.name].dynamicemb_options = prepared
        batch_size = batch_size or BATCH_SIZE
        self._planner = EmbeddingShardingPlanner(
            topology=topology,
            batch_size=batch_size,
            enumerator=enumerator or DynamicEmbeddingEnumerator(topology, batch_size, constraints),
            storage_reservation=storage_reservation,
            proposer=proposer,
            partitioner=partitioner,
            performance_model=performance_model,
            stats=stats,
            constraints=constraints,
            debug=debug,
        )

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """The sharding plan of ``module`` (TorchRec's), dynamic tables' shardings as
        :class:`DynamicEmbParameterSharding`.

        Raises:
            ValueError: FTRL planned on a table that is neither dynamic nor data-parallel.
        """
        return self._finish(module, self._planner.plan(module, sharders))

    def collective_plan(
        self,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]] | None = None,
        pg: dist.ProcessGroup | None = None,
    ) -> ShardingPlan:
        """:meth:`plan` on rank 0 of ``pg``, broadcast to every rank (TorchRec's)."""
        return self._finish(module, self._planner.collective_plan(module, sharders, pg))

    def _finish(self, module: nn.Module, plan: ShardingPlan) -> ShardingPlan:
        planned = PlannedTables(
            {
                name: options
                for name in (self.constraints or {})
                if (options := dynamic_options(self.constraints, name)) is not None
            }
        )
        for path, module_plan in plan.plan.items():
            weights = _table_weights(module.get_submodule(path))
            for table, sharding in list(module_plan.items()):
                options = dynamic_options(self.constraints, table)
                if options is None:
                    _refuse_ftrl(table, sharding, weights.get(table))
                    continue
                fields = {f.name: getattr(sharding, f.name) for f in dataclasses.fields(sharding)}
                for own in ("dynamicemb_options", "planned_tables", "additional_fused_params"):
                    fields.pop(own, None)
                module_plan[table] = DynamicEmbParameterSharding(
                    **fields, dynamicemb_options=options, planned_tables=planned
                )
        return plan


def _table_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """Each table's weight in an EmbeddingBagCollection / EmbeddingCollection (by table name)."""
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] == "weight":
            out[parts[-2]] = param
    return out


def _refuse_ftrl(table: str, sharding: ParameterSharding, weight: torch.Tensor | None) -> None:
    classes = getattr(weight, "_optimizer_classes", [None]) if weight is not None else [None]
    if classes[0] is not FTRL or sharding.sharding_type == ShardingType.DATA_PARALLEL.value:
        return
    raise ConfigError(
        f"table {table!r}: FTRL runs only on dynamic tables (DynamicEmbParameterConstraints("
        f"use_dynamicemb=True)); this table is planned {sharding.sharding_type} on the "
        f"{sharding.compute_kernel} kernel (only data-parallel tables, updated by the dense "
        "optimizer, are exempt)"
    )
