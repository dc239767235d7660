"""Pure-PyTorch references of the ``demb`` ops, for tests.

Written with plain tensor arithmetic, independent of the native kernels: unsigned 64-bit
arithmetic is emulated on int64 (logical shifts by masking, division by long division over
32-bit halves). The reference supports divisors (world size, block size) below ``2**31`` and
``block_size * world_size < 2**63``, which covers every test configuration.
"""

from __future__ import annotations

import torch

from demb_kernels.ops import BucketizedFeatures

__all__ = ["bucketize_by_owner_reference", "hash64_reference", "route_keys_reference"]

_C1 = 0xFF51AFD7ED558CCD
_C2 = 0xC4CEB9FE1A85EC53
_MASK32 = (1 << 32) - 1
_DIVISOR_LIMIT = 1 << 31


def _as_signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _udivmod(x: torch.Tensor, d: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsigned ``(x // d, x % d)`` of int64 bit patterns, ``0 < d < 2**31``."""
    hi = _shr(x, 32)
    lo = x & _MASK32
    q_hi = torch.div(hi, d, rounding_mode="floor")
    t = ((hi - q_hi * d) << 32) | lo
    q_lo = torch.div(t, d, rounding_mode="floor")
    return (q_hi << 32) + q_lo, t - q_lo * d


def hash64_reference(keys: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`demb_kernels.hash64`: ``(*)`` int32/int64 -> ``(*)`` int64."""
    x = keys.to(torch.int64)
    x = x ^ _shr(x, 33)
    x = x * _as_signed(_C1)
    x = x ^ _shr(x, 33)
    x = x * _as_signed(_C2)
    return x ^ _shr(x, 33)


def _route(
    x: torch.Tensor, world_size: int, dist_type: str, block: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if not 0 < world_size < _DIVISOR_LIMIT:
        raise ValueError(f"world_size={world_size}: the reference needs 0 < world_size < 2**31")
    if dist_type == "hash_roundrobin":
        x = hash64_reference(x)
    elif dist_type not in ("roundrobin", "continuous"):
        raise ValueError(f"dist_type={dist_type!r}: unknown")
    local, owner = _udivmod(x, world_size)  # owner u % W, local position u // W
    if dist_type == "continuous":
        if block is None:
            raise ValueError("dist_type='continuous' needs a block size")
        if bool((block <= 0).any()) or bool((block >= _DIVISOR_LIMIT).any()):
            raise ValueError("the reference needs 0 < block_size < 2**31")
        in_range = (x >= 0) & (x < block * world_size)
        safe_block = torch.where(in_range, block, 1)
        quotient = torch.div(x, safe_block, rounding_mode="floor")
        owner = torch.where(in_range, quotient, owner)
        local = torch.where(in_range, x - quotient * safe_block, local)
    return owner, local


def route_keys_reference(
    keys: torch.Tensor, world_size: int, dist_type: str, block_size: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`demb_kernels.route_keys`."""
    x = keys.to(torch.int64)
    block = None if block_size is None else torch.full_like(x, block_size)
    return _route(x, world_size, dist_type, block)


def bucketize_by_owner_reference(
    lengths: torch.Tensor,
    values: torch.Tensor,
    world_size: int,
    dist_type: str,
    weights: torch.Tensor | None = None,
    block_sizes: torch.Tensor | None = None,
) -> BucketizedFeatures:
    """Reference of :func:`demb_kernels.bucketize_by_owner` (stable sort by owner rank)."""
    segments = lengths.numel()
    n = values.numel()
    segment_of = torch.repeat_interleave(
        torch.arange(segments, device=values.device), lengths.to(torch.int64)
    )
    block = None
    if block_sizes is not None:
        batch = segments // block_sizes.numel()
        block = block_sizes.to(torch.int64)[segment_of // batch]
    owner, _ = _route(values.to(torch.int64), world_size, dist_type, block)
    new_lengths = torch.bincount(owner * segments + segment_of, minlength=world_size * segments)
    order = torch.sort(owner, stable=True).indices
    unbucketize = torch.empty(n, dtype=torch.int64, device=values.device)
    unbucketize[order] = torch.arange(n, device=values.device)
    return BucketizedFeatures(
        new_lengths.to(lengths.dtype),
        values[order],
        None if weights is None else weights[order],
        unbucketize,
    )
