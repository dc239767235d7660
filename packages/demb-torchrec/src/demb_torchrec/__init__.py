"""demb-torchrec: dynamic embedding tables in TorchRec (table module, sharding, model APIs).

The spec's public names are exported here with the spec's signatures; demb's own names
(``DynamicEmbeddingTables``, ...) are the same objects.
"""

from demb_torchrec._args import optimizer_spec
from demb_torchrec.batched_tables import BatchedDynamicEmbeddingTablesV2, DynamicEmbeddingTables
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

__all__ = [
    "BatchedDynamicEmbeddingTablesV2",
    "DynamicEmbCheckMode",
    "DynamicEmbEvictStrategy",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbOptimType",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "DynamicEmbeddingTables",
    "EvictedItemMode",
    "optimizer_spec",
]
