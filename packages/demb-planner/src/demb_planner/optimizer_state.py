"""Per-row optimizer-state size of each optimizer: the one table of it until demb-optim owns it.

==================  ===========================================
optimizer           state per row
==================  ===========================================
SGD                 0
Adam                ``2 * dim`` elements (``m`` then ``v``)
Adagrad             ``dim`` elements
row-wise Adagrad    16 bytes (one scalar, padded)
FTRL                ``2 * dim`` elements (``linear`` then ``accum``)
==================  ===========================================

State elements share the embedding dtype.
"""

from __future__ import annotations

import enum

from demb_planner._errors import PlannerConfigError
from demb_planner._validate import positive_int

__all__ = ["ROWWISE_ADAGRAD_STATE_BYTES", "OptimizerKind", "dtype_bytes", "optimizer_state_bytes"]

ROWWISE_ADAGRAD_STATE_BYTES = 16
"""Row-wise Adagrad reserves 16 bytes per row for its one accumulator."""


class OptimizerKind(enum.StrEnum):
    """The optimizers a dynamic table can hold state for."""

    SGD = "sgd"
    ADAM = "adam"
    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    FTRL = "ftrl"

    @classmethod
    def parse(cls, optimizer: object) -> OptimizerKind:
        """Accept a member, its value, or a FBGEMM ``EmbOptimType`` (by its ``value``)."""
        name = getattr(optimizer, "value", optimizer)
        if isinstance(name, str):
            found = _ALIASES.get(name.lower())
            if found is not None:
                return found
        known = ", ".join(sorted(_ALIASES))
        raise PlannerConfigError("optimizer", optimizer, f"unknown; expected one of {known}")


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

_STATE_ELEMENTS_PER_DIM = {
    OptimizerKind.SGD: 0,
    OptimizerKind.ADAM: 2,
    OptimizerKind.ADAGRAD: 1,
    OptimizerKind.FTRL: 2,
}

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


def optimizer_state_bytes(
    optimizer: object, embedding_dim: int, embedding_dtype_bytes: int = 4
) -> int:
    """Per-row optimizer state in bytes (the table in this module's docstring).

    Args:
        optimizer: an :class:`OptimizerKind`, its value, or FBGEMM ``EmbOptimType``.
        embedding_dim: row width ``dim``.
        embedding_dtype_bytes: bytes per element of the embedding (and state) dtype.
    """
    kind = OptimizerKind.parse(optimizer)
    dim = positive_int("embedding_dim", embedding_dim)
    elem = positive_int("embedding_dtype_bytes", embedding_dtype_bytes)
    if kind is OptimizerKind.ROWWISE_ADAGRAD:
        return ROWWISE_ADAGRAD_STATE_BYTES
    return _STATE_ELEMENTS_PER_DIM[kind] * dim * elem
