"""Pure-Python reference of the row initializer ``demb::init_rows`` (csrc/init_rule.h).

An independent implementation that the tests compare the CPU kernel against: Philox4x32-10
on Python ints, the element rule in Python floats (doubles), and the truncated normal through
``math.erfc`` and :meth:`statistics.NormalDist.inv_cdf` (Wichura's AS241, not the kernels'
Acklam + Halley).

Element ``j`` of the row of ``key`` under ``seed`` (both taken as uint64 bit patterns):
``x0..x3 = philox4x32((low32(key), high32(key), j, 0), (low32(seed), high32(seed)))``, then
with ``u(x) = ((x >> 8) + 0.5) / 2**24``:

- ``uniform``: ``lower + (upper - lower) * u(x0)``
- ``normal``: ``mean + std_dev * sqrt(-2 log u(x0)) * cos(2 pi u(x1))``
- ``truncated_normal``: ``p = Phi(a) + (Phi(b) - Phi(a)) * u(x0)`` with ``a, b`` the bounds
  standardized; ``clamp(mean + std_dev * Phi^-1(p), lower, upper)``
- ``constant``: ``value``
- ``debug``: ``key mod 65536 + j / 256``
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import numpy.typing as npt

__all__ = ["MODES", "philox4x32", "reference_rows", "unit_double"]

MODES = ("uniform", "normal", "truncated_normal", "constant", "debug")
"""The initializer modes of ``demb::init_rows``."""

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
_M0 = 0xD2511F53
_M1 = 0xCD9E8D57
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
_ROUNDS = 10
_STANDARD_NORMAL = statistics.NormalDist()


def philox4x32(
    counter: tuple[int, int, int, int], key: tuple[int, int]
) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al., SC'11) of a counter of four uint32 words under a key of
    two uint32 words; returns four uint32 words."""
    c0, c1, c2, c3 = (c & _MASK32 for c in counter)
    k0, k1 = (k & _MASK32 for k in key)
    for _ in range(_ROUNDS):
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = (
            (p1 >> 32) ^ c1 ^ k0,
            p1 & _MASK32,
            (p0 >> 32) ^ c3 ^ k1,
            p0 & _MASK32,
        )
        k0 = (k0 + _W0) & _MASK32
        k1 = (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def unit_double(x: int) -> float:
    """The top 24 bits of uint32 ``x`` as a double in (0, 1): ``((x >> 8) + 0.5) / 2**24``."""
    return ((x >> 8) + 0.5) / 16777216.0


def _phi(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2.0))


def _inverse_phi(p: float) -> float:
    if p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return math.inf
    return _STANDARD_NORMAL.inv_cdf(p)


def reference_rows(
    keys: list[int],
    dim: int,
    seed: int,
    mode: str,
    mean: float,
    std_dev: float,
    lower: float,
    upper: float,
    value: float,
) -> npt.NDArray[np.float64]:
    """The ``(len(keys), dim)`` float64 rows ``demb::init_rows`` computes for ``keys`` (before
    the kernels round them to float32 and the row dtype)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(MODES)}")
    out = np.empty((len(keys), dim), dtype=np.float64)
    seed_bits = seed & _MASK64
    philox_key = (seed_bits & _MASK32, seed_bits >> 32)
    pa = pb = 0.0
    if mode == "truncated_normal":
        pa = _phi((lower - mean) / std_dev)
        pb = _phi((upper - mean) / std_dev)
    for i, key in enumerate(keys):
        bits = key & _MASK64
        for j in range(dim):
            if mode == "constant":
                out[i, j] = value
                continue
            if mode == "debug":
                out[i, j] = (bits % 65536) + j / 256.0
                continue
            x = philox4x32((bits & _MASK32, bits >> 32, j, 0), philox_key)
            u0 = unit_double(x[0])
            if mode == "uniform":
                out[i, j] = lower + (upper - lower) * u0
            elif mode == "normal":
                radius = math.sqrt(-2.0 * math.log(u0))
                out[i, j] = mean + std_dev * radius * math.cos(2.0 * math.pi * unit_double(x[1]))
            else:
                z = _inverse_phi(pa + (pb - pa) * u0)
                out[i, j] = min(max(mean + std_dev * z, lower), upper)
    return out
