"""The specification's ``dynamicemb.dynamicemb_config`` path: the table options, their enums and
``complete_initializer_args``, under the names the spec imports (the same objects as
:mod:`demb_torchrec.options` and :mod:`demb_torchrec.constraints` define)."""

from __future__ import annotations

from demb_torchrec.capacity import (
    BUCKET_ALIGNMENT,
    MAX_BUCKET_CAPACITY,
    get_sharded_table_capacity,
    get_table_value_bytes,
)
from demb_torchrec.constraints import complete_initializer_args
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
    "BUCKET_ALIGNMENT",
    "MAX_BUCKET_CAPACITY",
    "DynamicEmbCheckMode",
    "DynamicEmbEvictStrategy",
    "DynamicEmbInitializerArgs",
    "DynamicEmbInitializerMode",
    "DynamicEmbOptimType",
    "DynamicEmbPoolingMode",
    "DynamicEmbScoreStrategy",
    "DynamicEmbTableOptions",
    "EvictedItemMode",
    "complete_initializer_args",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
]
