"""Capacity math of a row-wise sharded dynamic table (spec: "Sharding planner", steps 2 and 3).

Worked example, ``num_embeddings=1000``, ``world_size=3``, ``bucket_capacity=128``:
``ceil(1000 / 3) = 334`` rows per rank, aligned up to the bucket width gives 384, so each rank
holds ``3`` buckets of ``128`` slots and ``max_capacity = 384``. With ``MAX_BUCKET_CAPACITY``
each rank is one bucket of ``align_up(334, BUCKET_ALIGNMENT) = 336`` slots.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from demb_planner._errors import PlannerConfigError
from demb_planner._validate import non_negative_int, positive_int

__all__ = [
    "BUCKET_ALIGNMENT",
    "MAX_BUCKET_CAPACITY",
    "BucketLayout",
    "SupportsEmbeddingShape",
    "SupportsNumEmbeddings",
    "align_init_capacity",
    "align_up",
    "check_bucket_capacity",
    "dtype_bytes",
    "get_sharded_table_capacity",
    "get_table_value_bytes",
    "local_hbm_for_values",
    "sharded_table_bucket_layout",
]

BUCKET_ALIGNMENT = 16
"""Bucket widths (and the single-bucket sentinel's width) are multiples of this."""
MAX_BUCKET_CAPACITY = 2**63 - 1
"""Sentinel ``bucket_capacity``: one bucket spanning each rank's whole shard."""


class SupportsNumEmbeddings(Protocol):
    """Anything with a global row count, e.g. a TorchRec ``EmbeddingConfig``."""

    @property
    def num_embeddings(self) -> int: ...


class SupportsEmbeddingShape(SupportsNumEmbeddings, Protocol):
    """Anything with a global row count and a row width, e.g. a TorchRec ``EmbeddingConfig``."""

    @property
    def embedding_dim(self) -> int: ...


class BucketLayout(NamedTuple):
    """Per-rank bucket layout of a sharded table."""

    num_buckets: int
    """Buckets on each rank."""
    bucket_width: int
    """Slots per bucket (the effective ``bucket_capacity``)."""

    @property
    def capacity(self) -> int:
        """Slots on each rank: ``num_buckets * bucket_width``."""
        return self.num_buckets * self.bucket_width


def align_up(value: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is ``>= value`` (both positive integers)."""
    return -(-positive_int("value", value) // positive_int("multiple", multiple)) * multiple


def check_bucket_capacity(bucket_capacity: int) -> int:
    """Validate a requested ``bucket_capacity``: a positive multiple of 16, or the sentinel."""
    width = positive_int("bucket_capacity", bucket_capacity)
    if width != MAX_BUCKET_CAPACITY and width % BUCKET_ALIGNMENT != 0:
        raise PlannerConfigError(
            "bucket_capacity",
            bucket_capacity,
            f"must be a multiple of BUCKET_ALIGNMENT ({BUCKET_ALIGNMENT}) "
            "or MAX_BUCKET_CAPACITY (2**63 - 1)",
        )
    return width


def sharded_table_bucket_layout(
    embedding_config: SupportsNumEmbeddings, world_size: int, bucket_capacity: int = 128
) -> BucketLayout:
    """Per-rank ``(num_buckets, bucket_width)`` of a table sharded row-wise over ``world_size``.

    Rows per rank are ``ceil(num_embeddings / world_size)``. With ``MAX_BUCKET_CAPACITY`` the
    layout is one bucket of those rows aligned up to ``BUCKET_ALIGNMENT``; otherwise the rows
    are aligned up to ``bucket_capacity`` and split into buckets of that width.

    Raises:
        PlannerConfigError: non-positive ``num_embeddings`` or ``world_size``, or a
            ``bucket_capacity`` that is not a multiple of 16 (nor the sentinel).
    """
    rows = positive_int("num_embeddings", embedding_config.num_embeddings)
    world = positive_int("world_size", world_size)
    width = check_bucket_capacity(bucket_capacity)
    per_rank = -(-rows // world)
    if width == MAX_BUCKET_CAPACITY:
        return BucketLayout(1, align_up(per_rank, BUCKET_ALIGNMENT))
    return BucketLayout(align_up(per_rank, width) // width, width)


def get_sharded_table_capacity(
    embedding_config: SupportsNumEmbeddings, world_size: int, bucket_capacity: int = 128
) -> int:
    """Per-rank slot capacity (the planner's ``max_capacity``) of a row-wise sharded table."""
    return sharded_table_bucket_layout(embedding_config, world_size, bucket_capacity).capacity


def align_init_capacity(init_capacity: int | None, bucket_width: int, max_capacity: int) -> int:
    """The planner's ``init_capacity``: ``max_capacity`` if unset, else aligned up to the
    effective bucket width and clamped to ``max_capacity``."""
    cap = positive_int("max_capacity", max_capacity)
    if init_capacity is None:
        return cap
    aligned = align_up(
        positive_int("init_capacity", init_capacity), positive_int("bucket_width", bucket_width)
    )
    return min(aligned, cap)


def local_hbm_for_values(global_hbm_for_values: int, world_size: int) -> int:
    """Per-rank HBM byte budget: ``ceil(global_hbm_for_values / world_size)``."""
    total = non_negative_int("global_hbm_for_values", global_hbm_for_values)
    return -(-total // positive_int("world_size", world_size))


def get_table_value_bytes(
    embedding_config: SupportsEmbeddingShape,
    optimizer_state_bytes: int,
    world_size: int,
    bucket_capacity: int = 128,
    embedding_dtype_bytes: int = 4,
) -> int:
    """Bytes of value storage (embedding + optimizer state rows) over all ranks.

    Args:
        embedding_config: global ``num_embeddings`` and ``embedding_dim``.
        optimizer_state_bytes: per-row optimizer state in bytes
            (``demb_optim.optimizer_state_bytes`` has them per optimizer).
        world_size: number of ranks.
        bucket_capacity: as for :func:`get_sharded_table_capacity`.
        embedding_dtype_bytes: bytes per embedding element (4 for float32, 2 for 16-bit types).

    Returns:
        ``world_size * capacity_per_rank * (embedding_dim * embedding_dtype_bytes +
        optimizer_state_bytes)``.
    """
    dim = positive_int("embedding_dim", embedding_config.embedding_dim)
    state = non_negative_int("optimizer_state_bytes", optimizer_state_bytes)
    elem = positive_int("embedding_dtype_bytes", embedding_dtype_bytes)
    per_rank = get_sharded_table_capacity(embedding_config, world_size, bucket_capacity)
    return world_size * per_rank * (dim * elem + state)


_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
}


def dtype_bytes(dtype: object) -> int:
    """Bytes per element of an embedding dtype.

    Args:
        dtype: a name (``"float32"``, ``"float16"``, ``"bfloat16"``, optionally prefixed
            ``"torch."``) or any dtype object with an integer ``itemsize`` (numpy or torch).
    """
    if isinstance(dtype, str):
        found = _DTYPE_BYTES.get(dtype.removeprefix("torch."))
        if found is None:
            raise PlannerConfigError("embedding_dtype", dtype, "unknown dtype name")
        return found
    itemsize = getattr(dtype, "itemsize", None)
    if isinstance(itemsize, int) and itemsize > 0:
        return itemsize
    raise PlannerConfigError("embedding_dtype", dtype, "not a dtype name or dtype object")
