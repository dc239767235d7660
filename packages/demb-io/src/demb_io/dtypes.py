"""The value dtypes a checkpoint stores, by name, and their conversions (numpy only).

``bfloat16`` has no numpy dtype: its values are kept as raw 16-bit words (``uint16``, the top
half of a float32) and converted with round-to-nearest-even, as torch does.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["DTYPES", "from_float32", "itemsize", "storage_dtype", "to_float32"]

DTYPES = ("float32", "float16", "bfloat16")
"""The names of the value dtypes (the spec's ``embedding_dtype`` / ``optim_state_dtype``)."""

_STORAGE: dict[str, np.dtype[np.generic]] = {
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
}


def storage_dtype(name: str) -> np.dtype[np.generic]:
    """The little-endian numpy dtype that holds values of ``name`` in memory and on disk.

    Raises:
        ValueError: an unknown dtype name.
    """
    try:
        return _STORAGE[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}") from None


def itemsize(name: str) -> int:
    """Bytes per value of dtype ``name``."""
    return int(storage_dtype(name).itemsize)


def to_float32(values: npt.NDArray[np.generic], name: str) -> npt.NDArray[np.float32]:
    """``values`` stored as ``name`` (see :func:`storage_dtype`), as float32 (exact)."""
    if name == "bfloat16":
        words = np.ascontiguousarray(values, dtype=np.uint16).astype(np.uint32) << 16
        return words.view(np.float32)
    return np.asarray(values, dtype=storage_dtype(name)).astype(np.float32)


def from_float32(values: npt.ArrayLike, name: str) -> npt.NDArray[np.generic]:
    """float32 ``values`` rounded to nearest even into the storage of ``name``; a NaN stays a
    NaN."""
    x = np.ascontiguousarray(values, dtype=np.float32)
    if name != "bfloat16":
        return x.astype(storage_dtype(name))
    bits = x.view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
    words = (rounded >> 16).astype(np.uint16)
    nan = np.isnan(x)
    words[nan] = ((bits[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)  # keep it quiet NaN
    return words
