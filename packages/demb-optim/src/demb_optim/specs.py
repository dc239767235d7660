"""One spec per optimizer: hyper-parameters with defaults and validation, the per-row state and
its layout after the embedding, and the state a newly inserted key starts with.

A row of a dynamic table is ``[embedding (dim) | state (state_dim(dim, dtype))]`` in the table's
embedding dtype; updates compute in float32. Defaults follow FBGEMM's TBE (``learning_rate``
0.01, ``eps`` 1e-8, ``beta1`` 0.9, ``beta2`` 0.999) and, for FTRL, the spec's table.

Every optimizer takes ``gradient_clipping`` / ``max_gradient``: when on, the gradient of each
occurrence of a key in the batch is clamped elementwise to ``[-max_gradient, max_gradient]``
before the occurrences are summed and the update runs -- FBGEMM's semantics (measured against
its CPU TBE), for every optimizer, FTRL included.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields
from typing import ClassVar

import torch

from demb_optim._errors import OptimizerConfigError

__all__ = [
    "FTRL",
    "ROWWISE_ADAGRAD_STATE_BYTES",
    "SGD",
    "SPEC_TYPES",
    "Adagrad",
    "Adam",
    "OptimizerKind",
    "OptimizerSpec",
    "RowWiseAdagrad",
    "optimizer_state_bytes",
]

ROWWISE_ADAGRAD_STATE_BYTES = 16
"""Bytes row-wise Adagrad reserves per row (one scalar accumulator used)."""


class OptimizerKind(enum.StrEnum):
    """The optimizers dynamic tables implement."""

    SGD = "sgd"
    ADAM = "adam"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    FTRL = "ftrl"

    @classmethod
    def parse(cls, optimizer: object) -> OptimizerKind:
        """Accept a member, its value, or FBGEMM's ``EmbOptimType`` / the spec's
        ``DynamicEmbOptimType`` (by their ``value``)."""
        name = getattr(optimizer, "value", optimizer)
        if isinstance(name, str):
            found = _ALIASES.get(name.lower())
            if found is not None:
                return found
        known = ", ".join(sorted(_ALIASES))
        raise OptimizerConfigError("optimizer", optimizer, f"unknown; expected one of {known}")


_ALIASES: dict[str, OptimizerKind] = {
    "sgd": OptimizerKind.SGD,
    "exact_sgd": OptimizerKind.SGD,
    "adam": OptimizerKind.ADAM,
    "adagrad": OptimizerKind.ADAGRAD,
    "exact_adagrad": OptimizerKind.ADAGRAD,
    "rowwise_adagrad": OptimizerKind.ROWWISE_ADAGRAD,
    "row_wise_adagrad": OptimizerKind.ROWWISE_ADAGRAD,
    "exact_row_wise_adagrad": OptimizerKind.ROWWISE_ADAGRAD,
    "ftrl": OptimizerKind.FTRL,
}


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise OptimizerConfigError(name, value, "must be a finite number")
    return float(value)


def _positive(name: str, value: float) -> None:
    if _finite(name, value) <= 0:
        raise OptimizerConfigError(name, value, "must be > 0")


def _non_negative(name: str, value: float) -> None:
    if _finite(name, value) < 0:
        raise OptimizerConfigError(name, value, "must be >= 0")


def _unit_interval(name: str, value: float) -> None:
    if not 0 <= _finite(name, value) < 1:
        raise OptimizerConfigError(name, value, "must be in [0, 1)")


@dataclass(frozen=True)
class OptimizerSpec:
    """What every optimizer has. Subclasses add their hyper-parameters and state."""

    kind: ClassVar[OptimizerKind]
    learning_rate: float = 0.01
    """Step size, > 0."""
    gradient_clipping: bool = False
    """Clamp each gradient element to ``[-max_gradient, max_gradient]`` first."""
    max_gradient: float = 1.0
    """The clamp bound, > 0."""

    def __post_init__(self) -> None:
        _positive("learning_rate", self.learning_rate)
        if not isinstance(self.gradient_clipping, bool):
            raise OptimizerConfigError(
                "gradient_clipping", self.gradient_clipping, "must be a bool"
            )
        _positive("max_gradient", self.max_gradient)

    def state_dim(self, dim: int, dtype: torch.dtype = torch.float32) -> int:
        """Elements of ``dtype`` the state takes after an embedding of ``dim`` elements."""
        return 0

    def initial_state(self, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``(state_dim,)`` the state of a key when it is first written."""
        return torch.zeros(self.state_dim(dim, dtype), dtype=dtype)

    def hyper_parameters(self) -> dict[str, float | bool]:
        """Every hyper-parameter by name (for logs and checkpoints)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class SGD(OptimizerSpec):
    """``w -= lr * g``. No state."""

    kind: ClassVar[OptimizerKind] = OptimizerKind.SGD


@dataclass(frozen=True)
class Adam(OptimizerSpec):
    """Adam as FBGEMM's TBE runs it; state ``[m (dim) | v (dim)]``, both starting at 0.

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``w -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w)``.
    The step ``t`` is counted **per table** (one counter per table, +1 per update call), as in
    FBGEMM, so demb and a TorchRec static twin agree; a row first written at step ``t0 > 1``
    thus gets the table's bias correction, not one for its own first step.
    """

    kind: ClassVar[OptimizerKind] = OptimizerKind.ADAM
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1.0e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _unit_interval("beta1", self.beta1)
        _unit_interval("beta2", self.beta2)
        _positive("eps", self.eps)
        _non_negative("weight_decay", self.weight_decay)

    def state_dim(self, dim: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * dim


@dataclass(frozen=True)
class _AdagradBase(OptimizerSpec):
    """The hyper-parameters both Adagrads have: ``eps`` and the accumulator's seed."""

    eps: float = 1.0e-8
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive("eps", self.eps)
        _non_negative("initial_accumulator_value", self.initial_accumulator_value)


@dataclass(frozen=True)
class Adagrad(_AdagradBase):
    """Exact Adagrad: per-element ``acc += g^2``, ``w -= lr * g / (sqrt(acc) + eps)``.

    State ``[acc (dim)]``, seeded with ``initial_accumulator_value``.
    """

    kind: ClassVar[OptimizerKind] = OptimizerKind.ADAGRAD

    def state_dim(self, dim: int, dtype: torch.dtype = torch.float32) -> int:
        return dim

    def initial_state(self, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((dim,), self.initial_accumulator_value, dtype=dtype)


@dataclass(frozen=True)
class RowWiseAdagrad(_AdagradBase):
    """Exact row-wise Adagrad: ``acc += mean(g^2)``, ``w -= lr * g / (sqrt(acc) + eps)``.

    One scalar accumulator per row, seeded with ``initial_accumulator_value``, in a reserved
    16-byte slot (``16 / itemsize`` elements; the rest stays 0).
    """

    kind: ClassVar[OptimizerKind] = OptimizerKind.ROWWISE_ADAGRAD

    def state_dim(self, dim: int, dtype: torch.dtype = torch.float32) -> int:
        return ROWWISE_ADAGRAD_STATE_BYTES // dtype.itemsize

    def initial_state(self, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        state = torch.zeros(self.state_dim(dim, dtype), dtype=dtype)
        state[0] = self.initial_accumulator_value
        return state


@dataclass(frozen=True)
class FTRL(OptimizerSpec):
    """FTRL-Proximal (McMahan et al. 2013, Algorithm 1) with a general learning-rate power.

    Per coordinate, with ``p = learning_rate_power``:
    ``n' = n + g^2``; ``z += g - (n'^-p - n^-p) / lr * w``;
    ``w = 0`` if ``|z| <= l1_reg`` else
    ``(sign(z) l1_reg - z) / ((ftrl_beta + n'^-p) / lr + l2_reg)``; ``n = n'``.
    State ``[z (dim) | n (dim)]``: ``z`` starts at 0, ``n`` at ``initial_accumulator_value``.
    ``p = -0.5`` (the paper's square root) takes a fast path with the same result.
    """

    kind: ClassVar[OptimizerKind] = OptimizerKind.FTRL
    learning_rate_power: float = -0.5
    ftrl_beta: float = 0.0
    l1_reg: float = 0.0
    l2_reg: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if _finite("learning_rate_power", self.learning_rate_power) > 0:
            raise OptimizerConfigError(
                "learning_rate_power",
                self.learning_rate_power,
                "must be <= 0 (a positive power makes the learning rate grow without bound)",
            )
        _non_negative("ftrl_beta", self.ftrl_beta)
        _non_negative("l1_reg", self.l1_reg)
        _non_negative("l2_reg", self.l2_reg)
        _non_negative("initial_accumulator_value", self.initial_accumulator_value)

    def state_dim(self, dim: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * dim

    def initial_state(self, dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        state = torch.zeros(2 * dim, dtype=dtype)
        state[dim:] = self.initial_accumulator_value
        return state


SPEC_TYPES: dict[OptimizerKind, type[OptimizerSpec]] = {
    OptimizerKind.SGD: SGD,
    OptimizerKind.ADAM: Adam,
    OptimizerKind.ADAGRAD: Adagrad,
    OptimizerKind.ROWWISE_ADAGRAD: RowWiseAdagrad,
    OptimizerKind.FTRL: FTRL,
}
"""The spec class of each optimizer."""

_DTYPE_OF_BYTES = {4: torch.float32, 2: torch.float16}


def optimizer_state_bytes(
    optimizer: object, embedding_dim: int, embedding_dtype_bytes: int = 4
) -> int:
    """Per-row optimizer state in bytes, the size demb_planner's value bytes add per row.

    ==================  ===========================================
    optimizer           state per row
    ==================  ===========================================
    SGD                 0
    Adam                ``2 * dim`` elements (``m`` then ``v``)
    Adagrad             ``dim`` elements
    row-wise Adagrad    16 bytes (one scalar, padded)
    FTRL                ``2 * dim`` elements (``linear`` then ``accum``)
    ==================  ===========================================

    Args:
        optimizer: an :class:`OptimizerKind`, its value, or FBGEMM's ``EmbOptimType``.
        embedding_dim: row width ``dim``, >= 1.
        embedding_dtype_bytes: bytes per element of the embedding (and state) dtype: 4 or 2.
    """
    kind = OptimizerKind.parse(optimizer)
    if isinstance(embedding_dim, bool) or not isinstance(embedding_dim, int) or embedding_dim < 1:
        raise OptimizerConfigError("embedding_dim", embedding_dim, "must be a positive integer")
    dtype = _DTYPE_OF_BYTES.get(embedding_dtype_bytes)
    if dtype is None:
        raise OptimizerConfigError(
            "embedding_dtype_bytes", embedding_dtype_bytes, "must be 4 (float32) or 2 (16-bit)"
        )
    return SPEC_TYPES[kind]().state_dim(embedding_dim, dtype) * embedding_dtype_bytes
