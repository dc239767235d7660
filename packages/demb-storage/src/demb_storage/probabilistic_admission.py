"""Probabilistic admission (the spec's ``ProbabilisticAdmissionStrategy``): a missing key is
admitted on a stateless coin toss per occurrence, reproducible on any device, sharding and batch
order (:mod:`demb_storage._toss`). The interfaces are :mod:`demb_storage.admission`'s."""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable

import torch

from demb_storage._errors import AdmissionConfigError
from demb_storage._toss import admit_by_toss, table_salts
from demb_storage.admission import (
    AdmissionStrategy,
    MultiTableAdmitter,
    _check_group,
    _initializer,
    _initializer_key,
)
from demb_storage.initializers import InitializerArgs

__all__ = ["MultiTableProbabilisticAdmitter", "ProbabilisticAdmissionStrategy"]


def _probability(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise AdmissionConfigError("probability", value, "must be a float in (0, 1]")
    p = float(value)
    if math.isnan(p) or not 0.0 < p <= 1.0:
        raise AdmissionConfigError(
            "probability",
            value,
            "must be in (0, 1]: a key is admitted with this chance each time it misses "
            "(0 would never admit a key)",
        )
    return p


def _seed(value: object) -> int:
    if isinstance(value, bool):
        raise AdmissionConfigError("seed", value, "must be an integer in [0, 2**64)")
    try:
        seed = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise AdmissionConfigError("seed", value, "must be an integer in [0, 2**64)") from None
    if not 0 <= seed < 1 << 64:
        raise AdmissionConfigError("seed", value, "must be an integer in [0, 2**64)")
    return seed


class MultiTableProbabilisticAdmitter(MultiTableAdmitter):
    """Admits each missing key by coin tosses; keeps no state (:meth:`state` is None).

    A key occurring ``k`` times in a call (summing the ``frequencies`` of its duplicates) gets
    ``k`` tosses and is admitted if any succeeds: probability ``1 - (1 - p)**k`` (0 for
    ``k = 0``). The tosses of call ``c`` are a pure function of ``(key, table id, c, seed)``
    (:func:`demb_storage._toss.admit_by_toss`): the same on the CPU and CUDA, on any sharding,
    in any batch order. ``c`` counts every :meth:`admit` call, empty ones too, so ranks that
    call it once per step agree; it restarts from 0 with a new admitter.

    Args:
        probability: ``p``, in ``(0, 1]``.
        num_tables: ``T``.
        device: where the per-table salts live (the keys' device).
        initializer_args: how rejected keys' rows are initialized (None: the table's).
        seed: an integer in ``[0, 2**64)`` mixed into every toss.
    """

    def __init__(
        self,
        probability: float,
        num_tables: int,
        device: torch.device | str,
        initializer_args: InitializerArgs | None = None,
        seed: int = 0,
    ) -> None:
        self._p = _probability(probability)
        if isinstance(num_tables, bool) or not isinstance(num_tables, int) or num_tables < 1:
            raise AdmissionConfigError("num_tables", num_tables, "must be an integer >= 1")
        self._seed = _seed(seed)
        self._salts = table_salts(num_tables).to(device)
        self._initializer_args = _initializer(initializer_args)
        self._calls = 0

    @property
    def probability(self) -> float:
        """``p``."""
        return self._p

    @property
    def calls(self) -> int:
        """How many :meth:`admit` calls were made (the next call's toss index)."""
        return self._calls

    @calls.setter
    def calls(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"calls={value!r}: must be an integer >= 0")
        self._calls = value

    def admit(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        frequencies: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Toss for each key (see the class); as :meth:`MultiTableAdmitter.admit`, the keys on
        the admitter's device.

        Raises:
            ValueError / TypeError: bad shapes, dtypes, table ids or negative frequencies.
        """
        call = self._calls
        self._calls += 1
        return admit_by_toss(keys, table_ids, frequencies, self._p, call, self._seed, self._salts)

    @property
    def non_admitted_initializer(self) -> InitializerArgs | None:
        """The strategy's ``initializer_args``, or None."""
        return self._initializer_args


class ProbabilisticAdmissionStrategy(AdmissionStrategy):
    """Admit a missing key with probability ``probability`` per occurrence (a key takes
    ``1 / probability`` appearances on average to get in).

    Args:
        probability: a float in ``(0, 1]``; 1 admits every key.
        initializer_args: how rejected keys' rows are initialized (None: the table's).
        seed: keyword-only, an integer in ``[0, 2**64)`` mixed into every toss (default 0).

    An invalid argument is kept and reported by :meth:`check` (see
    :meth:`AdmissionStrategy.check`), which a table module calls naming the table.
    """

    def __init__(
        self,
        probability: float,
        initializer_args: InitializerArgs | None = None,
        *,
        seed: int = 0,
    ) -> None:
        self._problem = None
        self._p = self._keep(_probability, probability)
        self._initializer_args = self._keep(_initializer, initializer_args)
        self._seed = self._keep(_seed, seed)

    @property
    def probability(self) -> float:
        """The chance of one toss."""
        return self._p

    @property
    def initializer_args(self) -> InitializerArgs | None:
        """How rejected keys' rows are initialized (None: the table's initializer)."""
        return self._initializer_args

    @property
    def seed(self) -> int:
        """Mixed into every toss."""
        return self._seed

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(probability={self._p!r}, "
            f"initializer_args={self._initializer_args!r}, seed={self._seed})"
        )

    def get_grouped_key(self) -> Hashable:
        """``(class, probability, initializer_args, seed)``."""
        return (type(self), self._p, _initializer_key(self._initializer_args), self._seed)

    @classmethod
    def create_admitter(
        cls, table_strategies: list[AdmissionStrategy], device: torch.device
    ) -> MultiTableProbabilisticAdmitter:
        """One :class:`MultiTableProbabilisticAdmitter` over these tables.

        Raises:
            AdmissionConfigError: the strategies are not all of this class, or do not share
                one grouped key.
        """
        strategies = _check_group(cls, table_strategies)
        first = cls.one_configuration(strategies)
        return MultiTableProbabilisticAdmitter(
            first.probability, len(strategies), device, first.initializer_args, first.seed
        )
