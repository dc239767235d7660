"""The specification's sizing helpers: per-rank capacity and value bytes of a sharded table.

They follow the planner's rules (spec "Sharding planner", step 2), so a budget computed here
matches what :class:`~demb_torchrec.planner.DynamicEmbeddingShardingPlanner` plans::

    config = EmbeddingConfig(name="user", embedding_dim=16, num_embeddings=1000, ...)
    get_sharded_table_capacity(config, world_size=2, bucket_capacity=128)   # 512 a rank
    get_table_value_bytes(config, EmbOptimType.ADAM, world_size=2)          # 2 * 512 * 3 * 64
"""

from __future__ import annotations

from demb_optim import optimizer_state_bytes
from demb_planner import (
    BUCKET_ALIGNMENT,
    MAX_BUCKET_CAPACITY,
    SupportsEmbeddingShape,
    dtype_bytes,
    get_sharded_table_capacity,
)
from demb_planner import get_table_value_bytes as _value_bytes_of_state

from demb_torchrec.errors import InputError

__all__ = [
    "BUCKET_ALIGNMENT",
    "MAX_BUCKET_CAPACITY",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
]

_CONFIG_DTYPES = {"FP32": 4, "FP16": 2, "BF16": 2}


def _element_bytes(embedding_config: object, embedding_dtype: object | None) -> int:
    if embedding_dtype is not None:
        return dtype_bytes(embedding_dtype)
    data_type = getattr(embedding_config, "data_type", None)
    if data_type is None:
        return 4
    name = str(getattr(data_type, "value", data_type))
    found = _CONFIG_DTYPES.get(name)
    if found is None:
        table = getattr(embedding_config, "name", None)
        raise InputError(
            "embedding_config.data_type",
            f"{name}: dynamic tables hold FP32, FP16 or BF16 rows",
            table=table if isinstance(table, str) else None,
        )
    return found


def get_table_value_bytes(
    embedding_config: SupportsEmbeddingShape,
    optimizer_type: object,
    world_size: int,
    bucket_capacity: int = 128,
    embedding_dtype: object | None = None,
) -> int:
    """Bytes of value storage (embedding + optimizer-state rows) of a table over all ranks.

    Use it to size ``global_hbm_for_values`` before planning.

    Args:
        embedding_config: a TorchRec ``EmbeddingConfig`` / ``EmbeddingBagConfig`` (or anything
            with ``num_embeddings`` and ``embedding_dim``).
        optimizer_type: FBGEMM's ``EmbOptimType``, ``DynamicEmbOptimType`` or a name
            (``"adam"``, ``"sgd"``, ...); SGD adds no state.
        world_size: ranks the table is sharded over.
        bucket_capacity: slots per bucket, a multiple of ``BUCKET_ALIGNMENT`` or
            ``MAX_BUCKET_CAPACITY`` (one bucket a rank).
        embedding_dtype: the rows' dtype (``torch.float16``, ``"bfloat16"``, ...); default: the
            config's ``data_type`` (FP32 when it has none).

    Returns:
        ``world_size * get_sharded_table_capacity(...) * (dim + state) * element bytes``.

    Raises:
        InputError: a ``data_type`` dynamic tables cannot hold.
        PlannerConfigError, OptimizerConfigError: a bad size or an unknown optimizer.
    """
    elem = _element_bytes(embedding_config, embedding_dtype)
    state = optimizer_state_bytes(optimizer_type, embedding_config.embedding_dim, elem)
    return _value_bytes_of_state(embedding_config, state, world_size, bucket_capacity, elem)
