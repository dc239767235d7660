"""Typed wrappers of the ``demb`` torch ops, and their fake (meta) kernels.

Every op implements the key-ownership rule of :mod:`demb_planner.ownership` bit for bit, on CPU
(C++) and CUDA. Keys are int64 or int32 ids taken by their unsigned 64-bit pattern (int32
sign-extended). Bad arguments raise ``ValueError`` (values) or ``TypeError`` (dtypes) whose
message names the argument.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)

__all__ = ["BucketizedFeatures", "bucketize_by_owner", "hash64", "route_keys"]


def hash64(keys: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 ``fmix64`` of each key's unsigned 64-bit pattern.

    Args:
        keys: ``(*)`` int64 or int32 ids, on CPU or CUDA.

    Returns:
        ``(*)`` int64: the 64 hash bits of each key, stored as int64.
    """
    hashed: torch.Tensor = torch.ops.demb.hash64(keys)
    return hashed


def route_keys(
    keys: torch.Tensor, world_size: int, dist_type: str, block_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Owner rank and rank-local position of each key.

    Args:
        keys: ``(*)`` int64 or int32 ids.
        world_size: number of ranks, ``>= 1``.
        dist_type: ``"continuous"``, ``"roundrobin"`` or ``"hash_roundrobin"``.
        block_size: rows per rank for ``continuous`` (``ceil(num_embeddings / world_size)``);
            required there, rejected for the other rules.

    Returns:
        ``(owner, local)``: ``(*)`` int64 owner ranks in ``[0, world_size)`` and ``(*)`` int64
        holding the unsigned 64-bit rank-local positions' bits.
    """
    owner, local = torch.ops.demb.route_keys(
        keys, world_size, dist_type, 0 if block_size is None else block_size
    )
    return owner, local


class BucketizedFeatures(NamedTuple):
    """A jagged feature batch grouped by owner rank (see :func:`bucketize_by_owner`)."""

    lengths: torch.Tensor
    """``(world_size * S,)`` lengths dtype: rank ``r``'s lengths are ``[r * S, (r + 1) * S)``."""
    values: torch.Tensor
    """``(n,)`` values dtype: rank 0's keys, then rank 1's, ... (original keys, not local ids)."""
    weights: torch.Tensor | None
    """``(n,)`` the weights permuted like ``values``, or ``None`` when none were given."""
    unbucketize_permute: torch.Tensor
    """``(n,)`` int64: input position ``i`` went to output position ``unbucketize_permute[i]``."""


def bucketize_by_owner(
    lengths: torch.Tensor,
    values: torch.Tensor,
    world_size: int,
    dist_type: str,
    weights: torch.Tensor | None = None,
    block_sizes: torch.Tensor | None = None,
) -> BucketizedFeatures:
    """Group a jagged batch of several features by the owner rank of each key.

    The role FBGEMM's ``block_bucketize_sparse_features`` plays in TorchRec's row-wise input
    dist, with demb's ownership rule. Segment ``s`` (feature ``s // B``, sample ``s % B``, with
    ``B = S / F``) of the input becomes segment ``s`` of each rank's output; within a rank the
    keys keep their input order (stable). Keys are kept as they are (dynamic tables are keyed by
    raw ids).

    Args:
        lengths: ``(S,)`` int64 or int32, non-negative, feature-major (``S = F * B``).
        values: ``(n,)`` int64 or int32 keys, ``n == lengths.sum()``.
        world_size: number of ranks, ``>= 1``.
        dist_type: ``"continuous"``, ``"roundrobin"`` or ``"hash_roundrobin"``.
        weights: optional ``(n,)`` per-value weights (any dtype), permuted with the values.
        block_sizes: ``(F,)`` int64 per-feature block size for ``continuous`` (required there,
            rejected for the other rules).

    Returns:
        :class:`BucketizedFeatures`. Results computed per output position ``k`` go back to
        input order with ``result[unbucketize_permute]``.

    Example:
        >>> out = bucketize_by_owner(torch.tensor([2, 1]), torch.tensor([3, 4, 5]), 2,
        ...                          "roundrobin")
        >>> out.lengths.tolist(), out.values.tolist(), out.unbucketize_permute.tolist()
        ([1, 0, 1, 1], [4, 3, 5], [1, 0, 2])
    """
    new_lengths, new_values, new_weights, permute = torch.ops.demb.bucketize_by_owner(
        lengths, values, weights, world_size, dist_type, block_sizes
    )
    return BucketizedFeatures(new_lengths, new_values, new_weights, permute)


@torch.library.register_fake("demb::hash64")  # type: ignore[untyped-decorator]
def _hash64_fake(keys: torch.Tensor) -> torch.Tensor:
    return keys.new_empty(keys.shape, dtype=torch.int64)


@torch.library.register_fake("demb::route_keys")  # type: ignore[untyped-decorator]
def _route_keys_fake(
    keys: torch.Tensor, world_size: int, dist_type: str, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        keys.new_empty(keys.shape, dtype=torch.int64),
        keys.new_empty(keys.shape, dtype=torch.int64),
    )


@torch.library.register_fake("demb::bucketize_by_owner")  # type: ignore[untyped-decorator]
def _bucketize_by_owner_fake(
    lengths: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor | None,
    world_size: int,
    dist_type: str,
    block_sizes: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    return (
        lengths.new_empty((world_size * lengths.shape[0],)),
        torch.empty_like(values),
        None if weights is None else torch.empty_like(weights),
        values.new_empty(values.shape, dtype=torch.int64),
    )
