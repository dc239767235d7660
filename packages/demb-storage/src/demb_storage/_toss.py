"""The coin tosses of probabilistic admission: counter-based, so reproducible anywhere.

A toss is a pure function of ``(key, module-local table id t, call index c, seed)``, computed
with ``fmix64`` (MurmurHash3's finalizer, :func:`demb_kernels.hash64` on the device) on unsigned
64-bit patterns, all arithmetic modulo ``2**64``:

* ``call_salt = fmix64(seed ^ fmix64((c + 1) * 0x9E3779B97F4A7C15))`` (on the host),
* ``table_salt[t] = fmix64((t + 1) * 0xD1B54A32D192ED03)`` (on the host, once),
* ``h = fmix64(fmix64(key ^ call_salt) ^ table_salt[t])``,
* ``u = (h >> 11) / 2**53``, uniform in ``[0, 1)`` on the 53-bit grid (exact in float64).

A key with ``k`` tosses of chance ``p`` is admitted when ``u < P_k``, ``P_1 = p``,
``P_k = 1 - (1 - p)**k`` (``P_0 = 0``): one uniform decides "any of ``k`` tosses succeeds"
exactly as ``k`` independent tosses would. ``(1 - p)**k`` is taken by binary exponentiation in
float64 (correctly rounded multiplies, in a fixed order), never by ``pow``, whose last bit
differs between CPU and CUDA math libraries: every device decides the same.
"""

from __future__ import annotations

import torch
from demb_kernels import hash64

__all__ = ["CALL_GAMMA", "TABLE_GAMMA", "admit_by_toss", "call_salt", "fmix64", "table_salts"]

CALL_GAMMA = 0x9E3779B97F4A7C15
"""Odd constant spreading call indices (the 64-bit golden ratio)."""
TABLE_GAMMA = 0xD1B54A32D192ED03
"""Odd constant spreading table ids."""

_MASK64 = (1 << 64) - 1
_MASK53 = (1 << 53) - 1


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer of ``x mod 2**64`` (a Python int in ``[0, 2**64)``)."""
    x &= _MASK64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & _MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & _MASK64
    return x ^ (x >> 33)


def _signed(word: int) -> int:
    return word - (1 << 64) if word >= 1 << 63 else word


def call_salt(seed: int, call: int) -> int:
    """The salt of call ``call`` under ``seed``, as a signed int64 value."""
    return _signed(fmix64(seed ^ fmix64((call + 1) * CALL_GAMMA)))


def table_salts(num_tables: int) -> torch.Tensor:
    """``(num_tables,)`` int64 (CPU) salt of each module-local table id."""
    return torch.tensor(
        [_signed(fmix64((t + 1) * TABLE_GAMMA)) for t in range(num_tables)], dtype=torch.int64
    )


def _int_tensor(name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be int64 or int32, got {t.dtype}")
    if t.shape != like.shape:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, keys {tuple(like.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, keys on {like.device}")
    return t.to(torch.int64)


def _power(q: float, k: torch.Tensor, bits: int) -> torch.Tensor:
    """``(N,)`` float64 ``q**k`` by binary exponentiation (same roundings on every device)."""
    power = torch.ones(k.shape, dtype=torch.float64, device=k.device)
    base = q
    for i in range(bits):
        power = torch.where(((k >> i) & 1) == 1, power * base, power)
        base *= base
    return power


def admit_by_toss(
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    frequencies: torch.Tensor | None,
    probability: float,
    call: int,
    seed: int,
    salts: torch.Tensor,
) -> torch.Tensor:
    """Toss for each key (see the module docstring); duplicates of ``(table, key)`` sum their
    frequencies into one ``k`` and share one decision.

    Args:
        keys: ``(N,)`` int64 or int32 keys on ``salts``' device.
        table_ids: ``(N,)`` int64 or int32 module-local table ids, in ``[0, T)``.
        frequencies: ``(N,)`` int64 or int32 occurrences (>= 0), or None (1 each).
        probability: ``p`` in ``(0, 1]``.
        call: the call index ``c``.
        seed: in ``[0, 2**64)``.
        salts: ``(T,)`` int64 :func:`table_salts`.

    Returns:
        ``(N,)`` bool.

    Raises:
        TypeError / ValueError: bad dtypes, shapes or devices, a table id out of range, or a
            negative frequency (the message names the argument).
    """
    if keys.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"keys must be int64 or int32, got {keys.dtype}")
    if keys.dim() != 1:
        raise ValueError(f"keys must be 1-D, got shape {tuple(keys.shape)}")
    if keys.device != salts.device:
        raise ValueError(f"keys is on {keys.device}, the admitter on {salts.device}")
    keys = keys.to(torch.int64)
    tables = _int_tensor("table_ids", table_ids, keys)
    if frequencies is None:
        freq = torch.ones_like(keys)
    else:
        freq = _int_tensor("frequencies", frequencies, keys)
    if keys.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=keys.device)
    num_tables = salts.numel()
    pairs = torch.stack([tables, keys], dim=1)
    _, inverse = torch.unique(pairs, dim=0, return_inverse=True)
    totals = torch.zeros(keys.numel(), dtype=torch.int64, device=keys.device)
    totals.index_add_(0, inverse, freq)
    k = totals[inverse]
    bad_table, bad_freq, k_max = torch.stack(
        [
            ((tables < 0) | (tables >= num_tables)).any().to(torch.int64),
            (freq < 0).any().to(torch.int64),
            k.max(),
        ]
    ).tolist()
    if bad_table:
        raise ValueError(f"table_ids: out of range for an admitter of {num_tables} tables")
    if bad_freq:
        raise ValueError("frequencies: contains a negative frequency")
    h = hash64(keys ^ call_salt(seed, call))
    h = hash64(h ^ salts[tables])
    u = ((h >> 11) & _MASK53).to(torch.float64) * 2.0**-53
    if k_max <= 1:
        never = torch.zeros(k.shape, dtype=torch.float64, device=k.device)
        chance = torch.where(k == 1, probability, never)
    else:
        power = _power(1.0 - probability, k, int(k_max).bit_length())
        chance = torch.where(k == 1, probability, 1.0 - power)
    admitted: torch.Tensor = u < chance
    return admitted
