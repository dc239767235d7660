"""Where a key lives inside a rank's hash table: the single definition in the project.

A table of ``capacity`` slots is cut into buckets of ``bucket_width`` slots (``capacity`` is a
multiple of ``bucket_width``). For a key with unsigned 64-bit pattern ``u``:

* ``h = fmix64(u ^ TABLE_HASH_SEED)``, the *table hash*. It is seeded so that it is not the
  hash that ``hash_roundrobin`` routes keys by: with the same hash, the keys of one rank would
  all share ``h % world_size`` and fill only part of every bucket's start positions.
* ``p = h % capacity``; the key's **home bucket** is ``p // bucket_width`` and its **start
  position** inside that bucket is ``p % bucket_width`` (probing and victim ties go in circular
  order from there).
* its **digest** is ``1 + (h >> 56) % 127``, in ``[1, 127]``: a one-byte fingerprint checked
  before the key itself. Digest ``0`` marks an empty slot; bit 7 is free for the kernels.

Doubling ``capacity`` sends every key of bucket ``b`` to bucket ``b`` or ``b + capacity //
bucket_width`` of the doubled table, so a rehash into a doubled table can never overflow a
bucket. The kernels of demb-kernels implement this bit for bit, tested against this module.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from demb_planner._errors import PlannerConfigError
from demb_planner._validate import positive_int
from demb_planner.ownership import _fmix64, _key_bits

__all__ = ["DIGEST_MODULUS", "TABLE_HASH_SEED", "HomeSlots", "home_slots", "table_hash64"]

TABLE_HASH_SEED = 0x9E3779B97F4A7C15
"""XORed into a key's bits before ``fmix64`` to give the table hash (the 64-bit golden ratio)."""

DIGEST_MODULUS = 127
"""Digests are ``1 + (h >> 56) % DIGEST_MODULUS``: never 0 (empty) and below 128 (bit 7 free)."""


def table_hash64(keys: npt.ArrayLike) -> npt.NDArray[np.uint64]:
    """The table hash ``fmix64(u ^ TABLE_HASH_SEED)`` of each key's unsigned 64-bit pattern.

    Args:
        keys: integer ids, any shape.

    Returns:
        ``uint64`` array of the same shape.
    """
    with np.errstate(over="ignore"):
        return _fmix64(_key_bits(keys) ^ np.uint64(TABLE_HASH_SEED))


class HomeSlots(NamedTuple):
    """Where keys live in a table (see :func:`home_slots`); arrays of the keys' shape."""

    bucket: npt.NDArray[np.int64]
    """Home bucket in ``[0, capacity // bucket_width)``."""
    start: npt.NDArray[np.int64]
    """Start position inside the home bucket, in ``[0, bucket_width)``."""
    digest: npt.NDArray[np.uint8]
    """One-byte fingerprint in ``[1, 127]``."""


def home_slots(keys: npt.ArrayLike, capacity: int, bucket_width: int) -> HomeSlots:
    """Home bucket, start position and digest of ``keys`` in a table of ``capacity`` slots.

    Args:
        keys: integer ids, any shape.
        capacity: slots of the table, a positive multiple of ``bucket_width``.
        bucket_width: slots per bucket, ``>= 1``.

    Raises:
        PlannerConfigError: ``capacity`` or ``bucket_width`` is not as above.
    """
    capacity = positive_int("capacity", capacity)
    bucket_width = positive_int("bucket_width", bucket_width)
    if capacity % bucket_width:
        raise PlannerConfigError(
            "capacity", capacity, f"must be a multiple of bucket_width={bucket_width}"
        )
    h = table_hash64(keys)
    position = h % np.uint64(capacity)
    width = np.uint64(bucket_width)
    digest = np.uint64(1) + (h >> np.uint64(56)) % np.uint64(DIGEST_MODULUS)
    return HomeSlots(
        bucket=(position // width).astype(np.int64),
        start=(position % width).astype(np.int64),
        digest=digest.astype(np.uint8),
    )
