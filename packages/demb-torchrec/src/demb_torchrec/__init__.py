"""demb-torchrec: dynamic embedding tables in TorchRec (table module, sharding, model APIs).

The spec's public names are exported here with the spec's signatures; demb's own names
(``DynamicEmbeddingTables``, ...) are the same objects. The names that build on TorchRec's own
classes (``FTRL``, ``DynamicEmbParameterConstraints``, the planner and sharders) import TorchRec
on first use, so that ``import demb_torchrec`` alone (the table module, the CLI) does not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from demb_storage import (
    AdmissionStrategy,
    Counter,
    DynamicEmbeddingTable,
    FrequencyAdmissionStrategy,
    KVCounter,
    MemoryType,
    MultiTableAdmitter,
    MultiTableKVCounter,
    ProbabilisticAdmissionStrategy,
    Storage,
)

from demb_torchrec import errors
from demb_torchrec._args import optimizer_spec
from demb_torchrec.batched_tables import BatchedDynamicEmbeddingTablesV2, DynamicEmbeddingTables
from demb_torchrec.capacity import (
    BUCKET_ALIGNMENT,
    MAX_BUCKET_CAPACITY,
    get_sharded_table_capacity,
    get_table_value_bytes,
)
from demb_torchrec.dump import DynamicEmbDump
from demb_torchrec.errors import (
    CheckpointError,
    ConfigError,
    DembError,
    FormatError,
    InputError,
    InputTypeError,
    InsertFailedError,
    IoError,
    LayoutError,
    NotSupportedError,
    OptimizerConfigError,
    PlannerConfigError,
    StorageError,
    TableConfigError,
    TrainingStateError,
)
from demb_torchrec.incremental import DeltaDumpResult, incremental_dump
from demb_torchrec.load import DynamicEmbLoad
from demb_torchrec.options import (
    DynamicEmbCheckMode,
    DynamicEmbEvictStrategy,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbOptimType,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EvictedItemMode,
)
from demb_torchrec.replay import ReplayContent, ReplayStats, replay_increment
from demb_torchrec.retained import erase_keys, pop_erased_keys, pop_evicted_keys
from demb_torchrec.scores import get_score, set_score
from demb_torchrec.stats import TableStats, count_insert_outcomes, table_memory, table_stats

__all__ = [
    "BUCKET_ALIGNMENT",
    "FTRL",
    "MAX_BUCKET_CAPACITY",
    "AdmissionStrategy",
    "BatchedDynamicEmbeddingTablesV2",
    "CheckpointError",
    "ConfigError",
    "Counter",
    "DeltaDumpResult",
    "DembError",
    "DynamicEmbCheckMode",
    "DynamicEmbDump",
    "DynamicEmbEvictStrategy",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbLoad",
    "DynamicEmbOptimType",
    "DynamicEmbParameterConstraints",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "DynamicEmbeddingBagCollectionSharder",
    "DynamicEmbeddingCollectionSharder",
    "DynamicEmbeddingEnumerator",
    "DynamicEmbeddingShardingPlanner",
    "DynamicEmbeddingTable",
    "DynamicEmbeddingTables",
    "EvictedItemMode",
    "FormatError",
    "FrequencyAdmissionStrategy",
    "InputError",
    "InputTypeError",
    "InsertFailedError",
    "IoError",
    "KVCounter",
    "LayoutError",
    "MemoryType",
    "MultiTableAdmitter",
    "MultiTableKVCounter",
    "NotSupportedError",
    "OptimizerConfigError",
    "PlannerConfigError",
    "ProbabilisticAdmissionStrategy",
    "ReplayContent",
    "ReplayStats",
    "Storage",
    "StorageError",
    "TableConfigError",
    "TableStats",
    "TrainingStateError",
    "complete_initializer_args",
    "count_insert_outcomes",
    "erase_keys",
    "errors",
    "get_score",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
    "incremental_dump",
    "optimizer_spec",
    "pop_erased_keys",
    "pop_evicted_keys",
    "replay_increment",
    "set_score",
    "table_memory",
    "table_stats",
]

_ON_TORCHREC = {
    "FTRL": "demb_torchrec.optimizers",
    "DynamicEmbParameterConstraints": "demb_torchrec.constraints",
    "complete_initializer_args": "demb_torchrec.constraints",
    "DynamicEmbeddingEnumerator": "demb_torchrec.planner",
    "DynamicEmbeddingShardingPlanner": "demb_torchrec.planner",
    "DynamicEmbeddingBagCollectionSharder": "demb_torchrec.sharders",
    "DynamicEmbeddingCollectionSharder": "demb_torchrec.sharders",
}

if TYPE_CHECKING:
    from demb_torchrec.constraints import (
        DynamicEmbParameterConstraints,
        complete_initializer_args,
    )
    from demb_torchrec.optimizers import FTRL
    from demb_torchrec.planner import DynamicEmbeddingEnumerator, DynamicEmbeddingShardingPlanner
    from demb_torchrec.sharders import (
        DynamicEmbeddingBagCollectionSharder,
        DynamicEmbeddingCollectionSharder,
    )


def __getattr__(name: str) -> object:
    module = _ON_TORCHREC.get(name)
    if module is None:
        raise AttributeError(f"module 'demb_torchrec' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
