"""The key-ownership rule of row-wise sharding: the single definition in the project.

A key is an integer id (int64 at the API, int32 accepted and sign-extended). Every rule below
works on the key's **unsigned 64-bit bit pattern** ``u`` (so ``-1`` is ``2**64 - 1``); a key's
owner rank and rank-local position are:

==================  =============================================  ==========================
``dist_type``       owner rank                                     rank-local position
==================  =============================================  ==========================
``continuous``      ``u // B`` if ``u < B * W``, else ``u % W``    ``u % B``, else ``u // W``
``roundrobin``      ``u % W``                                      ``u // W``
``hash_roundrobin`` ``hash64(u) % W``                              ``hash64(u) // W``
==================  =============================================  ==========================

``W`` is the world size and ``B`` the continuous block size, ``ceil(num_embeddings / W)``
(:func:`continuous_block_size`). Keys outside ``[0, B * W)`` under ``continuous`` fall back to
round-robin, as FBGEMM's ``block_bucketize_sparse_features`` does; the two branches give
disjoint local positions (``< B`` vs ``>= B``), so ``(owner, local)`` identifies the key under
every rule. ``hash64`` is MurmurHash3's 64-bit finalizer ``fmix64``, a bijection on 64-bit
words with ``hash64(0) == 0``.

The kernels in demb-kernels implement the same rule and are tested bit for bit against this one.
"""

from __future__ import annotations

import enum

import numpy as np
import numpy.typing as npt

from demb_planner._errors import PlannerConfigError
from demb_planner._validate import positive_int

__all__ = [
    "FMIX64_C1",
    "FMIX64_C2",
    "DistType",
    "continuous_block_size",
    "hash64",
    "local_position",
    "owner_rank",
    "route_keys",
]

FMIX64_C1 = 0xFF51AFD7ED558CCD
"""First multiplier of MurmurHash3's ``fmix64``."""
FMIX64_C2 = 0xC4CEB9FE1A85EC53
"""Second multiplier of MurmurHash3's ``fmix64``."""


class DistType(enum.StrEnum):
    """How row-wise sharding assigns keys to ranks (the spec's ``dist_type``)."""

    CONTINUOUS = "continuous"
    ROUNDROBIN = "roundrobin"
    HASH_ROUNDROBIN = "hash_roundrobin"

    @classmethod
    def parse(cls, value: str) -> DistType:
        """Return the member named ``value``; raise :class:`PlannerConfigError` otherwise."""
        try:
            return cls(value)
        except ValueError:
            known = ", ".join(repr(m.value) for m in cls)
            raise PlannerConfigError(
                "dist_type", value, f"unknown; expected one of {known}"
            ) from None


def _key_bits(keys: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """The unsigned 64-bit pattern of integer ``keys`` (signed ones sign-extended first)."""
    array = np.asarray(keys)
    if array.dtype == np.bool_ or not np.issubdtype(array.dtype, np.integer):
        raise PlannerConfigError("keys", f"array of dtype {array.dtype}", "must be integer ids")
    if np.issubdtype(array.dtype, np.signedinteger):
        return array.astype(np.int64, copy=False).view(np.uint64)
    return array.astype(np.uint64, copy=False)


def _fmix64(bits: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    shift = np.uint64(33)
    h = bits ^ (bits >> shift)
    h = h * np.uint64(FMIX64_C1)
    h = h ^ (h >> shift)
    h = h * np.uint64(FMIX64_C2)
    mixed: npt.NDArray[np.uint64] = h ^ (h >> shift)
    return mixed


def hash64(keys: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """MurmurHash3 ``fmix64`` of each key's unsigned 64-bit pattern.

    Args:
        keys: integer ids, any shape (int64 expected; other integer dtypes are widened).

    Returns:
        ``uint64`` array of the same shape.
    """
    with np.errstate(over="ignore"):
        return _fmix64(_key_bits(keys))


def continuous_block_size(num_embeddings: int, world_size: int) -> int:
    """Rows per rank under ``continuous``: ``ceil(num_embeddings / world_size)``."""
    rows = positive_int("num_embeddings", num_embeddings)
    world = positive_int("world_size", world_size)
    return -(-rows // world)


def _check_block_size(dist: DistType, block_size: int | None) -> int:
    if dist is DistType.CONTINUOUS:
        if block_size is None:
            raise PlannerConfigError(
                "block_size", block_size, "dist_type='continuous' needs the per-rank block size"
            )
        return positive_int("block_size", block_size)
    if block_size is not None:
        raise PlannerConfigError(
            "block_size", block_size, f"only applies to dist_type='continuous', not {dist.value!r}"
        )
    return 0


def route_keys(
    keys: npt.ArrayLike,
    world_size: int,
    dist_type: str,
    block_size: int | None = None,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.uint64]]:
    """Owner rank and rank-local position of each key (the rule in the module docstring).

    Args:
        keys: integer ids, any shape.
        world_size: number of ranks ``W >= 1``.
        dist_type: ``"continuous"``, ``"roundrobin"`` or ``"hash_roundrobin"``.
        block_size: rows per rank ``B`` for ``continuous`` (required there, rejected elsewhere).

    Returns:
        ``(owner, local)``: ``int64`` ranks in ``[0, W)`` and ``uint64`` local positions, both of
        the keys' shape.

    Example:
        >>> owner, local = route_keys([0, 5, -1], 4, "roundrobin")
        >>> owner.tolist(), local.tolist()
        ([0, 1, 3], [0, 1, 4611686018427387903])
    """
    world = positive_int("world_size", world_size)
    dist = DistType.parse(dist_type)
    block = _check_block_size(dist, block_size)
    bits = _key_bits(keys)
    w = np.uint64(world)
    if block * world >= 2**64:
        raise PlannerConfigError(
            "block_size",
            block_size,
            f"block_size * world_size must be < 2**64 (world_size={world})",
        )
    with np.errstate(over="ignore"):
        if dist is DistType.HASH_ROUNDROBIN:
            bits = _fmix64(bits)
        owner = bits % w
        local = bits // w
        if dist is DistType.CONTINUOUS:
            b = np.uint64(block)
            in_range = bits < np.uint64(block * world)
            owner = np.where(in_range, bits // b, owner)
            local = np.where(in_range, bits % b, local)
    return owner.astype(np.int64), local.astype(np.uint64, copy=False)


def owner_rank(
    keys: npt.ArrayLike,
    world_size: int,
    dist_type: str,
    block_size: int | None = None,
) -> npt.NDArray[np.int64]:
    """Owner rank of each key: ``route_keys(...)[0]``. See :func:`route_keys`."""
    return route_keys(keys, world_size, dist_type, block_size)[0]


def local_position(
    keys: npt.ArrayLike,
    world_size: int,
    dist_type: str,
    block_size: int | None = None,
) -> npt.NDArray[np.uint64]:
    """Rank-local position of each key: ``route_keys(...)[1]``. See :func:`route_keys`."""
    return route_keys(keys, world_size, dist_type, block_size)[1]
