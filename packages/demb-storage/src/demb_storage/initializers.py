"""Initial values of new rows: the initializer options of a table and the call that applies them.

A new row's embedding is a pure function of ``(table seed, key, column)`` (the counter-based
generator of :func:`demb_kernels.init_rows.init_rows`): the same key gets the same initial row
on the CPU or a GPU, on any number of ranks, in any batch order. :class:`InitializerArgs` is the
spec's ``DynamicEmbInitializerArgs``; :func:`table_seed` derives each table's seed from one
global seed.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass

import torch
from demb_kernels.init_rows import NewRowsSpec, init_rows

from demb_storage._errors import TableConfigError

__all__ = [
    "InitializerArgs",
    "InitializerMode",
    "initialize_rows",
    "new_rows_spec",
    "table_seed",
]

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


class InitializerMode(enum.Enum):
    """How new rows are initialized (the spec's ``DynamicEmbInitializerMode``)."""

    NORMAL = "normal"
    """Normal ``(mean, std_dev)``."""
    TRUNCATED_NORMAL = "truncated_normal"
    """Normal ``(mean, std_dev)`` restricted to ``[lower, upper]``."""
    UNIFORM = "uniform"
    """Uniform on ``[lower, upper)``."""
    CONSTANT = "constant"
    """Every element ``value``."""
    DEBUG = "debug"
    """Element ``j`` of key ``k`` is ``k mod 65536 + j / 256`` (readable in tests)."""


_BOUNDED = (InitializerMode.UNIFORM, InitializerMode.TRUNCATED_NORMAL)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass
class InitializerArgs:
    """Initializer options of a table (the spec's ``DynamicEmbInitializerArgs``).

    ``lower`` / ``upper`` bound UNIFORM and TRUNCATED_NORMAL; left ``None`` they default to
    ``-1/sqrt(N)`` / ``+1/sqrt(N)`` for a table of ``N = num_embeddings`` rows, filled in by
    :meth:`complete`. A string ``mode`` (``"normal"``, ...) is converted to
    :class:`InitializerMode`.

    Raises:
        TableConfigError: a field is invalid; the message names it
            (``initializer_args.<field>``).
    """

    mode: InitializerMode = InitializerMode.UNIFORM
    mean: float = 0.0
    std_dev: float = 1.0
    lower: float | None = None
    upper: float | None = None
    value: float = 0.0

    def __post_init__(self) -> None:
        try:
            self.mode = InitializerMode(self.mode)
        except ValueError:
            valid = ", ".join(m.name for m in InitializerMode)
            raise TableConfigError(
                "initializer_args.mode", self.mode, f"expected an InitializerMode ({valid})"
            ) from None
        for name in ("mean", "std_dev", "lower", "upper", "value"):
            x = getattr(self, name)
            if x is None and name in ("lower", "upper"):
                continue
            if not _is_number(x) or not math.isfinite(x):
                raise TableConfigError(f"initializer_args.{name}", x, "must be a finite number")
            setattr(self, name, float(x))
        normal = (InitializerMode.NORMAL, InitializerMode.TRUNCATED_NORMAL)
        if self.mode in normal and self.std_dev <= 0:
            raise TableConfigError(
                "initializer_args.std_dev", self.std_dev, f"must be > 0 for {self.mode.name}"
            )
        if self.lower is not None and self.upper is not None and not self.lower < self.upper:
            raise TableConfigError(
                "initializer_args.lower", self.lower, f"must be < upper={self.upper}"
            )

    def complete(self, num_embeddings: int) -> InitializerArgs:
        """A copy with the bounds of UNIFORM / TRUNCATED_NORMAL that are ``None`` set to
        ``-1/sqrt(num_embeddings)`` / ``+1/sqrt(num_embeddings)``; other modes unchanged.

        Raises:
            TableConfigError: ``num_embeddings`` is not a positive int, or a given bound is on
                the wrong side of the default one.
        """
        if (
            isinstance(num_embeddings, bool)
            or not isinstance(num_embeddings, int)
            or num_embeddings < 1
        ):
            raise TableConfigError("num_embeddings", num_embeddings, "must be a positive integer")
        if self.mode not in _BOUNDED:
            return dataclasses.replace(self)
        bound = 1.0 / math.sqrt(num_embeddings)
        return dataclasses.replace(
            self,
            lower=-bound if self.lower is None else self.lower,
            upper=bound if self.upper is None else self.upper,
        )


def table_seed(seed: int, table_index: int) -> int:
    """The initializer seed of table ``table_index`` under the global ``seed``.

    SplitMix64's output function (Steele, Lea, Flood 2014; a bijection of 64-bit words with
    full avalanche) of ``seed ^ (table_index * 0x9E3779B97F4A7C15)`` mod 2**64, plus the golden
    gamma, so nearby seeds and tables give unrelated streams. ``seed`` is taken mod 2**64.

    Returns:
        The seed as a signed int64 value (the op's ``int`` argument).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TableConfigError("seed", seed, "must be an integer")
    if isinstance(table_index, bool) or not isinstance(table_index, int) or table_index < 0:
        raise TableConfigError("table_index", table_index, "must be a non-negative integer")
    z = ((seed & _MASK64) ^ ((table_index * _GOLDEN_GAMMA) & _MASK64)) + _GOLDEN_GAMMA
    z &= _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return z - (1 << 64) if z >= 1 << 63 else z


def initialize_rows(
    values: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    dim: int,
    args: InitializerArgs,
    seed: int,
    state: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> None:
    """Write the initial rows of ``keys`` into ``values`` at ``slots``, in place.

    Args:
        values: ``(R, W)`` contiguous float32, float16 or bfloat16 value buffer (mutated).
        slots: ``(n,)`` int64 target rows in ``[-1, R)``; ``-1`` skips the entry.
        keys: ``(n,)`` int64 keys.
        dim: embedding columns, ``1 <= dim <= W``.
        args: the table's initializer options, completed (:meth:`InitializerArgs.complete`).
        seed: the table's seed (:func:`table_seed`), an int64.
        state: ``None`` (columns ``[dim, W)`` untouched) or a ``(W - dim,)`` float32 tensor on
            ``values``' device written there (the initial optimizer state).
        check: check the slot range on CUDA (one sync).

    Raises:
        TableConfigError: UNIFORM / TRUNCATED_NORMAL bounds not completed.
    """
    spec = new_rows_spec(args, seed)._asdict()  # init_rows' keyword arguments
    init_rows(values, slots, keys, dim, **spec, state=state, check=check)


def new_rows_spec(args: InitializerArgs, seed: int) -> NewRowsSpec:
    """A table's initializer options and seed as the row initializers take them
    (:func:`demb_kernels.init_rows.init_new_rows` takes one per table).

    Args:
        args: the table's initializer options, completed (:meth:`InitializerArgs.complete`).
        seed: the table's seed (:func:`table_seed`).

    Raises:
        TableConfigError: UNIFORM / TRUNCATED_NORMAL bounds not completed.
    """
    if args.mode in _BOUNDED:
        for name in ("lower", "upper"):
            if getattr(args, name) is None:
                raise TableConfigError(
                    f"initializer_args.{name}",
                    None,
                    f"{args.mode.name} needs both bounds; call complete(num_embeddings) first",
                )
    return NewRowsSpec(
        seed=seed,
        mode=args.mode.value,
        mean=args.mean,
        std_dev=args.std_dev,
        lower=0.0 if args.lower is None else args.lower,
        upper=1.0 if args.upper is None else args.upper,
        value=args.value,
    )
