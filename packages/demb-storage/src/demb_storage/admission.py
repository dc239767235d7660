"""Admission: which missing keys may enter their tables (the spec's admission classes).

An :class:`AdmissionStrategy` is a table's inert configuration; a fused module groups its tables
on :meth:`AdmissionStrategy.get_grouped_key` and turns each group's configurations into one
:class:`MultiTableAdmitter` with :meth:`AdmissionStrategy.create_admitter`; that admitter
decides, for module-local table ids ``0 .. T-1`` (the group's tables in the order given).

Two pairs are provided:

* :class:`FrequencyAdmissionStrategy` / :class:`MultiTableFrequencyAdmitter`: a key is admitted
  once its accumulated count (a :class:`~demb_storage.counter.MultiTableKVCounter`) reaches the
  threshold, and is then erased from the counter.
* :class:`~demb_storage.probabilistic_admission.ProbabilisticAdmissionStrategy` /
  :class:`~demb_storage.probabilistic_admission.MultiTableProbabilisticAdmitter` (their own
  module): a stateless coin toss per occurrence, reproducible on any device, sharding and batch
  order (see :mod:`demb_storage._toss`).
"""

from __future__ import annotations

import abc
import dataclasses
import operator
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import torch
from demb_kernels.table import EMPTY_KEY

from demb_storage._errors import AdmissionConfigError
from demb_storage.counter import Counter, KVCounter, MultiTableKVCounter
from demb_storage.initializers import InitializerArgs

__all__ = [
    "DEFAULT_COUNTER_CAPACITY",
    "AdmissionStrategy",
    "FrequencyAdmissionStrategy",
    "MultiTableAdmitter",
    "MultiTableFrequencyAdmitter",
]

DEFAULT_COUNTER_CAPACITY = 1 << 20
"""Keys per table of the counter of a :class:`FrequencyAdmissionStrategy` given none.

``create_admitter`` sees no table sizes, so the default cannot follow the table: 2**20 slots
(buckets of 1024) hold a million keys waiting for admission per table at 17 bytes a slot
(17 MiB per table). Pass ``counter=KVCounter(...)`` to size it for the keys' long tail."""

_S = TypeVar("_S", bound="AdmissionStrategy")
_T = TypeVar("_T")


class MultiTableAdmitter(abc.ABC):
    """What a module runs to decide admission for the ``T`` tables of a group.

    Only :meth:`admit` has to be implemented; :meth:`state` and
    :attr:`non_admitted_initializer` have defaults.
    """

    @abc.abstractmethod
    def admit(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        frequencies: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Which of these missing keys may enter their tables.

        Args:
            keys: ``(N,)`` int64 (or int32) missing keys.
            table_ids: ``(N,)`` int64 module-local table of each key, in ``[0, T)``.
            frequencies: ``(N,)`` int64 occurrences of each key in *this batch* (an increment,
                not a running total); None counts each entry once.

        Returns:
            ``(N,)`` bool on the keys' device: True where the key is admitted.
        """

    def admit_distinct(
        self, keys: torch.Tensor, table_ids: torch.Tensor, frequencies: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`admit` of distinct ``(key, table)`` pairs whose data a caller has checked
        (the table module's missing keys: deduplicated and checked with their batch). The
        default calls :meth:`admit`; an admitter may skip the work only repeated or unchecked
        pairs need.

        Args / Returns: as :meth:`admit`, ``frequencies`` given.
        """
        return self.admit(keys, table_ids, frequencies)

    def admit_masked(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        frequencies: torch.Tensor,
        asked: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`admit_distinct` of the entries ``asked`` selects in a batch the caller does
        not compact (on CUDA compacting syncs): the table module's unique keys, of which only
        the missing ones are asked. The default compacts them (one sync on CUDA) and calls
        :meth:`admit_distinct`; an admitter that can decide on the whole batch overrides it.

        Args:
            keys: ``(U,)`` int64 distinct checked ``(key, table)`` pairs.
            table_ids: ``(U,)`` int64 each key's table, in ``[0, T)`` (an entry not asked
                still names a valid table).
            frequencies: ``(U,)`` int64 each key's occurrences in this batch.
            asked: ``(U,)`` bool the entries to decide.

        Returns:
            ``(U,)`` bool: True where an asked key is admitted (False where not asked).

        Raises:
            TypeError: :meth:`admit_distinct` returned no bool mask of its keys.
        """
        at = asked.nonzero().squeeze(1)
        admit = self.admit_distinct(keys[at], table_ids[at], frequencies[at])
        if admit.dtype != torch.bool or admit.shape != at.shape:
            raise TypeError(
                f"{type(self).__name__}.admit returned {admit.dtype} {tuple(admit.shape)}, "
                f"expected a bool mask of {tuple(at.shape)}"
            )
        return torch.zeros_like(asked).index_put_((at,), admit.to(asked.device))

    def state(self) -> Counter | None:
        """Persistent state the framework carries (memory accounting, checkpoints), or None."""
        return None

    @property
    def non_admitted_initializer(self) -> InitializerArgs | None:
        """How the rows of rejected keys are initialized, or None for the table's initializer."""
        return None


class AdmissionStrategy(abc.ABC):
    """A table's admission configuration: inert (allocates nothing, touches no device)."""

    _problem: AdmissionConfigError | None = None
    """The first invalid argument's error, kept for :meth:`check`."""

    @classmethod
    @abc.abstractmethod
    def create_admitter(
        cls, table_strategies: list[AdmissionStrategy], device: torch.device
    ) -> MultiTableAdmitter:
        """The admitter these tables share (table ``t`` configured by
        ``table_strategies[t]``), with its device state allocated on ``device``."""

    @classmethod
    def one_configuration(cls: type[_S], table_strategies: Sequence[_S]) -> _S:
        """The single configuration these tables agree on: the first (they were grouped on
        :meth:`get_grouped_key`, so they are interchangeable).

        Raises:
            AdmissionConfigError: ``table_strategies`` is empty.
        """
        if not table_strategies:
            raise AdmissionConfigError(
                "admit_strategy", list(table_strategies), "needs one strategy per table (>= 1)"
            )
        return table_strategies[0]

    def get_grouped_key(self) -> Hashable:
        """What has to match for two tables to share one admitter: the instance itself by
        default (only the same object groups)."""
        return self

    def check(self) -> None:
        """Raise :class:`AdmissionConfigError` for this configuration's first invalid
        argument; nothing when it is valid. A strategy (and its counter) is checked where it
        is used, so the error can name the table: when a table module is built (the option
        prefixed by the table's name) or an admitter created. The constructors keep what they
        are given."""
        if self._problem is not None:
            raise self._problem

    def _keep(self, check: Callable[[Any], _T], value: object) -> _T:
        """``check(value)``, or ``value`` as given with the error kept for :meth:`check`."""
        try:
            return check(value)
        except AdmissionConfigError as err:
            if self._problem is None:
                self._problem = err
            return value  # type: ignore[return-value]


def _check_group(cls: type[_S], table_strategies: Sequence[object]) -> list[_S]:
    """``table_strategies`` as instances of ``cls`` sharing one grouped key."""
    if not table_strategies:
        raise AdmissionConfigError(
            "admit_strategy", list(table_strategies), "needs one strategy per table (>= 1)"
        )
    out: list[_S] = []
    for t, s in enumerate(table_strategies):
        if not isinstance(s, cls):
            raise AdmissionConfigError(
                f"admit_strategy[{t}]", s, f"{cls.__name__}.create_admitter needs {cls.__name__}s"
            )
        try:
            s.check()
        except AdmissionConfigError as err:
            option = f"admit_strategy[{t}].{err.option}"
            raise AdmissionConfigError(option, err.value, err.reason) from None
        out.append(s)
    first = out[0].get_grouped_key()
    for t, s in enumerate(out[1:], start=1):
        if s.get_grouped_key() != first:
            raise AdmissionConfigError(
                f"admit_strategy[{t}]",
                s,
                f"tables sharing one admitter must agree with admit_strategy[0]={out[0]!r}",
            )
    return out


def _counter(value: object) -> KVCounter:
    if not isinstance(value, KVCounter):
        raise AdmissionConfigError("counter", value, "must be a KVCounter or None")
    return value


def _initializer(value: object) -> InitializerArgs | None:
    if value is not None and not isinstance(value, InitializerArgs):
        raise AdmissionConfigError(
            "initializer_args", value, "must be an InitializerArgs (DynamicEmbInitializerArgs)"
        )
    return value


def _initializer_key(args: InitializerArgs | None) -> Hashable:
    return None if args is None else dataclasses.astuple(args)


# ---------------------------------------------------------------------------- frequency


class MultiTableFrequencyAdmitter(MultiTableAdmitter):
    """Admits a key once its accumulated count reaches ``threshold``; admitted keys leave the
    counter.

    Args:
        threshold: count at which a key is admitted, ``>= 1``.
        counters: one :class:`KVCounter` per table (its capacity and bucket size).
        device: where the counter lives.
        initializer_args: how rejected keys' rows are initialized (None: the table's).
    """

    def __init__(
        self,
        threshold: int,
        counters: Sequence[KVCounter],
        device: torch.device | str,
        initializer_args: InitializerArgs | None = None,
    ) -> None:
        self._threshold = _threshold(threshold)
        self._counter = MultiTableKVCounter(counters, device)
        self._initializer_args = _initializer(initializer_args)

    @property
    def threshold(self) -> int:
        """The count at which a key is admitted."""
        return self._threshold

    def admit(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        frequencies: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Add ``frequencies`` (None: 1 per entry) to the counter and admit the keys whose count
        is now ``>= threshold``, erasing them from the counter. Duplicates of a key share its
        total and its decision. A key the counter could not place (its bucket full of keys of
        this call) is judged on its frequency in this call alone.

        Args / Returns: as :meth:`MultiTableAdmitter.admit`; the keys on the counter's device.
        """
        return self._decide(self._counter.add(keys, table_ids, frequencies), keys, table_ids)

    def admit_distinct(
        self, keys: torch.Tensor, table_ids: torch.Tensor, frequencies: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`admit` of distinct checked pairs (:meth:`MultiTableAdmitter.admit_distinct`):
        the counter neither checks them again nor sums the frequencies of unplaced keys over
        their repeats (each key is one entry)."""
        counts = self._counter.add(keys, table_ids, frequencies, distinct=True, check=False)
        return self._decide(counts, keys, table_ids)

    def admit_masked(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        frequencies: torch.Tensor,
        asked: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`MultiTableAdmitter.admit_masked` without compacting: the entries not asked
        go to the counter as the empty key, which its kernels skip, and the admitted keys
        are erased the same way (on CUDA no sync at all)."""
        asked_keys = torch.where(asked, keys, EMPTY_KEY)
        counts = self._counter.add(
            asked_keys, table_ids, frequencies, distinct=True, check=False, skips=True
        )
        return self._decide(counts, keys, table_ids, asked)

    def _decide(
        self,
        counts: torch.Tensor,
        keys: torch.Tensor,
        ids: torch.Tensor,
        asked: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Admit the (``asked``) keys whose count reached the threshold and erase them from the
        counter (the others as empty-key entries, which the erase skips: no sync)."""
        admitted = counts >= self._threshold
        if asked is not None:
            admitted &= asked
        self._counter.erase(torch.where(admitted, keys, EMPTY_KEY), ids, check=False)
        return admitted

    def state(self) -> MultiTableKVCounter:
        """The counter of the keys waiting for admission."""
        return self._counter

    @property
    def non_admitted_initializer(self) -> InitializerArgs | None:
        """The strategy's ``initializer_args``, or None."""
        return self._initializer_args


def _threshold(value: object) -> int:
    if isinstance(value, bool):
        raise AdmissionConfigError("threshold", value, "must be an integer >= 1, not a bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise AdmissionConfigError("threshold", value, "must be an integer >= 1") from None
    if number < 1:
        raise AdmissionConfigError(
            "threshold", value, "must be an integer >= 1 (every key reaches a count of 1)"
        )
    return number


class FrequencyAdmissionStrategy(AdmissionStrategy):
    """Admit a key once it has been seen ``threshold`` times (counting from its first miss).

    Args:
        threshold: count at which a key is admitted, an integer ``>= 1`` (1 admits every key).
        counter: this table's share of the counter; None takes
            ``KVCounter(DEFAULT_COUNTER_CAPACITY)`` (see :data:`DEFAULT_COUNTER_CAPACITY`).
        initializer_args: how rejected keys' rows are initialized (None: the table's).

    An invalid argument is kept and reported by :meth:`check` (see
    :meth:`AdmissionStrategy.check`), which a table module calls naming the table.
    """

    def __init__(
        self,
        threshold: int,
        counter: KVCounter | None = None,
        initializer_args: InitializerArgs | None = None,
    ) -> None:
        self._problem = None
        self._threshold = self._keep(_threshold, threshold)
        if counter is None:
            counter = KVCounter(DEFAULT_COUNTER_CAPACITY)
        self._counter = self._keep(_counter, counter)
        self._initializer_args = self._keep(_initializer, initializer_args)

    def check(self) -> None:
        """See :meth:`AdmissionStrategy.check`; the counter's settings too."""
        super().check()
        self._counter.check()

    @property
    def threshold(self) -> int:
        """The count at which a key is admitted."""
        return self._threshold

    @property
    def counter(self) -> KVCounter:
        """This table's share of the counter."""
        return self._counter

    @property
    def initializer_args(self) -> InitializerArgs | None:
        """How rejected keys' rows are initialized (None: the table's initializer)."""
        return self._initializer_args

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(threshold={self._threshold}, counter={self._counter!r}, "
            f"initializer_args={self._initializer_args!r})"
        )

    def get_grouped_key(self) -> Hashable:
        """``(class, threshold, counter bucket size, counter key type, initializer_args)``:
        what changes decisions and what the tables must agree on; the per-table counter
        capacity is left out (each table keeps its own)."""
        return (
            type(self),
            self._threshold,
            self._counter.bucket_capacity,
            self._counter.key_type,
            _initializer_key(self._initializer_args),
        )

    @classmethod
    def create_admitter(
        cls, table_strategies: list[AdmissionStrategy], device: torch.device
    ) -> MultiTableFrequencyAdmitter:
        """One :class:`MultiTableFrequencyAdmitter`: the group's threshold and initializer,
        each table's own counter capacity.

        Raises:
            AdmissionConfigError: the strategies are not all of this class, or do not share
                one grouped key.
        """
        strategies = _check_group(cls, table_strategies)
        first = cls.one_configuration(strategies)
        return MultiTableFrequencyAdmitter(
            first.threshold, [s.counter for s in strategies], device, first.initializer_args
        )
