"""demb-storage: the scored hash table, score strategies, eviction, tiers and admission.

:class:`ScoredHashTable` holds fused tables (index + value rows) with growth and safe checks;
:mod:`demb_storage.options` has the per-table options.
"""

from demb_storage._errors import (
    AdmissionConfigError,
    CounterDataError,
    InsertFailedError,
    StorageBatchError,
    StorageClosedError,
    StorageError,
    TableConfigError,
)
from demb_storage._export import export_table, export_tables
from demb_storage._gated import find_or_insert_launched
from demb_storage._retained import KeyBuffer
from demb_storage.admission import (
    DEFAULT_COUNTER_CAPACITY,
    AdmissionStrategy,
    FrequencyAdmissionStrategy,
    MultiTableAdmitter,
    MultiTableFrequencyAdmitter,
)
from demb_storage.counter import (
    Counter,
    KVCounter,
    MemoryType,
    MultiTableKVCounter,
)
from demb_storage.device_storage import DynamicEmbeddingTable, LocatedEntries
from demb_storage.initializers import (
    InitializerArgs,
    InitializerMode,
    initialize_rows,
    new_rows_spec,
    table_seed,
)
from demb_storage.options import (
    VALUE_DTYPES,
    SafeCheckMode,
    ScoreLayout,
    ScoreStrategy,
    TableConfig,
    resolve_score_strategy,
)
from demb_storage.probabilistic_admission import (
    MultiTableProbabilisticAdmitter,
    ProbabilisticAdmissionStrategy,
)
from demb_storage.rocksdb_storage import RocksDBStorage
from demb_storage.score_function import ScoreFunction, float_rank
from demb_storage.scored_table import EvictedRows, InsertOutcome, ScoredHashTable, TableExport
from demb_storage.slot_writes import SlotWriteBatch, SlotWrites, clear_slots
from demb_storage.storage import Storage
from demb_storage.storage_results import (
    EvictedEntries,
    FoundEntries,
    InsertedEntries,
    MemoryUsage,
    RowLayout,
    StorageExport,
)
from demb_storage.table_counts import per_table_counts

__all__ = [
    "DEFAULT_COUNTER_CAPACITY",
    "VALUE_DTYPES",
    "AdmissionConfigError",
    "AdmissionStrategy",
    "Counter",
    "CounterDataError",
    "DynamicEmbeddingTable",
    "EvictedEntries",
    "EvictedRows",
    "FoundEntries",
    "FrequencyAdmissionStrategy",
    "InitializerArgs",
    "InitializerMode",
    "InsertFailedError",
    "InsertOutcome",
    "InsertedEntries",
    "KVCounter",
    "KeyBuffer",
    "LocatedEntries",
    "MemoryType",
    "MemoryUsage",
    "MultiTableAdmitter",
    "MultiTableFrequencyAdmitter",
    "MultiTableKVCounter",
    "MultiTableProbabilisticAdmitter",
    "ProbabilisticAdmissionStrategy",
    "RocksDBStorage",
    "RowLayout",
    "SafeCheckMode",
    "ScoreFunction",
    "ScoreLayout",
    "ScoreStrategy",
    "ScoredHashTable",
    "SlotWriteBatch",
    "SlotWrites",
    "Storage",
    "StorageBatchError",
    "StorageClosedError",
    "StorageError",
    "StorageExport",
    "TableConfig",
    "TableConfigError",
    "TableExport",
    "clear_slots",
    "export_table",
    "export_tables",
    "find_or_insert_launched",
    "float_rank",
    "initialize_rows",
    "new_rows_spec",
    "per_table_counts",
    "resolve_score_strategy",
    "table_seed",
]
