"""demb-planner: sharding math of dynamic tables (numpy only, no torch import).

The key-ownership rule (:mod:`demb_planner.ownership`), where a key lives in a rank's hash table
(:mod:`demb_planner.table_hash`), per-rank capacity, bucket layout and value bytes
(:mod:`demb_planner.capacity`; the per-row optimizer-state size comes from demb-optim).
"""

from demb_planner._errors import DembError, PlannerConfigError
from demb_planner.capacity import (
    BUCKET_ALIGNMENT,
    MAX_BUCKET_CAPACITY,
    BucketLayout,
    SupportsEmbeddingShape,
    SupportsNumEmbeddings,
    align_init_capacity,
    align_up,
    check_bucket_capacity,
    dtype_bytes,
    get_sharded_table_capacity,
    get_table_value_bytes,
    local_hbm_for_values,
    sharded_table_bucket_layout,
)
from demb_planner.ownership import (
    FMIX64_C1,
    FMIX64_C2,
    DistType,
    continuous_block_size,
    hash64,
    local_position,
    owner_rank,
    route_keys,
)
from demb_planner.table_hash import (
    DIGEST_MODULUS,
    TABLE_HASH_SEED,
    HomeSlots,
    home_slots,
    table_hash64,
)

__all__ = [
    "BUCKET_ALIGNMENT",
    "DIGEST_MODULUS",
    "FMIX64_C1",
    "FMIX64_C2",
    "MAX_BUCKET_CAPACITY",
    "TABLE_HASH_SEED",
    "BucketLayout",
    "DembError",
    "DistType",
    "HomeSlots",
    "PlannerConfigError",
    "SupportsEmbeddingShape",
    "SupportsNumEmbeddings",
    "align_init_capacity",
    "align_up",
    "check_bucket_capacity",
    "continuous_block_size",
    "dtype_bytes",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
    "hash64",
    "home_slots",
    "local_hbm_for_values",
    "local_position",
    "owner_rank",
    "route_keys",
    "sharded_table_bucket_layout",
    "table_hash64",
]
