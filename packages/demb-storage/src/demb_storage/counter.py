"""Frequency counters of the admission layer: a key -> accumulated count table per table.

:class:`Counter` is the spec's interface of a counter; :class:`KVCounter` sizes one table's
share of a counter (configuration only); :class:`MultiTableKVCounter` is the counter a module
runs: ``T`` fused bucketed tables in one :class:`demb_kernels.table.TableIndex` with the LFU
policy, so a slot's score word *is* the key's accumulated count and a full bucket evicts its
smallest count (the kernels' victim rule, docs/hash_table.md). Tables are module-local ids
``0 .. T-1``.

Counter files (:meth:`Counter.dump` / :meth:`Counter.load`) are two raw arrays of
little-endian int64 of one table: the keys, and the counts in the same order.
"""

from __future__ import annotations

import abc
import enum
import operator
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeAlias

import torch
from demb_kernels import table as ops
from demb_kernels.table import InsertStatus, ScorePolicy, TableIndex
from demb_planner import BUCKET_ALIGNMENT

from demb_storage._errors import AdmissionConfigError, CounterDataError
from demb_storage.table_counts import per_table_counts

__all__ = [
    "Counter",
    "CounterFile",
    "KVCounter",
    "MemoryType",
    "MultiTableKVCounter",
]

CounterFile: TypeAlias = str | os.PathLike[str] | BinaryIO
"""A counter file: a path, or a binary file object (read to its end / written at its position)."""

_KEY_TYPES = (torch.int64, torch.int32)
_MAX_BUCKET = 2**31 - 1


class MemoryType(enum.Enum):
    """A kind of memory a counter reports with :meth:`Counter.memory_usage`."""

    DEVICE = "device"
    """Accelerator memory (a CUDA device)."""
    HOST = "host"
    """Host (CPU) memory."""


class Counter(abc.ABC):
    """Interface of a counter table which maps a key to a counter (the spec's ``Counter``).

    Keys live per module-local table id (``table_ids``); the same key in two tables is two
    entries.
    """

    @abc.abstractmethod
    def add(
        self, keys: torch.Tensor, table_ids: torch.Tensor, frequencies: torch.Tensor
    ) -> torch.Tensor:
        """Add frequencies to these keys and return their accumulated counts.

        Args:
            keys: ``(N,)`` int64 (or int32) keys.
            table_ids: ``(N,)`` int64 table of each key.
            frequencies: ``(N,)`` int64 increment of each key (>= 0).

        Returns:
            ``(N,)`` int64 each key's count after the whole call.
        """

    @abc.abstractmethod
    def erase(self, keys: torch.Tensor, table_ids: torch.Tensor) -> None:
        """Erase these keys (``(N,)`` keys and table ids); absent keys are ignored."""

    @abc.abstractmethod
    def memory_usage(self, mem_type: MemoryType = MemoryType.DEVICE) -> int:
        """Bytes of one kind of memory the counter holds."""

    @abc.abstractmethod
    def load(self, key_file: CounterFile, counter_file: CounterFile, table_id: int) -> None:
        """Load one table's keys and counts from these files."""

    @abc.abstractmethod
    def dump(self, key_file: CounterFile, counter_file: CounterFile, table_id: int) -> None:
        """Dump one table's keys and counts to these files."""


def _int_option(option: str, value: object, low: int) -> int:
    if isinstance(value, bool):
        raise AdmissionConfigError(option, value, f"must be an integer >= {low}, not a bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise AdmissionConfigError(option, value, f"must be an integer >= {low}") from None
    if number < low:
        raise AdmissionConfigError(option, value, f"must be an integer >= {low}")
    return number


@dataclass(frozen=True)
class KVCounter:
    """One table's share of a counter (the spec's ``KVCounter``): configuration only.

    The counter is bucketed and a full bucket evicts its smallest count, so size ``capacity``
    for the keys still waiting to be admitted, not for the embedding table. Equal settings
    compare and hash equal.

    Args:
        capacity: keys the table's counter holds, ``>= 1``; rounded up to a multiple of
            ``bucket_capacity`` (see :attr:`slots`), never grown.
        bucket_capacity: slots per bucket, a positive multiple of 16 (below ``2**31``).
        key_type: dtype of the keys counted, ``torch.int64`` or ``torch.int32`` (the counter
            stores every key as int64).

    An argument that is not as above is kept and reported by :meth:`check`.
    """

    capacity: int
    bucket_capacity: int = 1024
    key_type: torch.dtype = torch.int64

    def __post_init__(self) -> None:
        try:
            capacity = _int_option("counter.capacity", self.capacity, 1)
            width = _int_option("counter.bucket_capacity", self.bucket_capacity, 1)
            if width % BUCKET_ALIGNMENT or width > _MAX_BUCKET:
                raise AdmissionConfigError(
                    "counter.bucket_capacity",
                    self.bucket_capacity,
                    f"must be a positive multiple of {BUCKET_ALIGNMENT} below 2**31",
                )
            if self.key_type not in _KEY_TYPES:
                raise AdmissionConfigError(
                    "counter.key_type", self.key_type, "must be torch.int64 or torch.int32"
                )
        except AdmissionConfigError as err:  # kept for check(): the table module names it
            object.__setattr__(self, "_problem", err)
            return
        object.__setattr__(self, "_problem", None)
        object.__setattr__(self, "capacity", capacity)
        object.__setattr__(self, "bucket_capacity", width)

    def check(self) -> None:
        """Raise :class:`AdmissionConfigError` for the first invalid argument; nothing when
        they are valid (a counter is checked where it is used, so the error can name the
        table: see ``AdmissionStrategy.check``)."""
        problem: AdmissionConfigError | None = getattr(self, "_problem", None)
        if problem is not None:
            raise problem

    @property
    def slots(self) -> int:
        """The table's slots: ``capacity`` rounded up to a multiple of ``bucket_capacity``."""
        width = self.bucket_capacity
        return -(-self.capacity // width) * width


def _file_name(file: CounterFile) -> str:
    if isinstance(file, str | os.PathLike):
        return os.fspath(file)
    return str(getattr(file, "name", repr(file)))


def _write(file: CounterFile, values: torch.Tensor) -> None:
    data = values.to("cpu", torch.int64).contiguous().numpy().astype("<i8", copy=False).tobytes()
    if isinstance(file, str | os.PathLike):
        Path(file).write_bytes(data)
    else:
        file.write(data)


def _read(file: CounterFile) -> torch.Tensor:
    """The file's int64 array (``(n,)`` on the CPU), read to its end."""
    data = Path(file).read_bytes() if isinstance(file, str | os.PathLike) else file.read()
    if len(data) % 8:
        raise CounterDataError(
            _file_name(file),
            f"{len(data)} bytes is not a whole number of int64 values (truncated?)",
        )
    if not data:
        return torch.empty(0, dtype=torch.int64)
    values = torch.frombuffer(bytearray(data), dtype=torch.int64)
    if sys.byteorder == "big":
        values = values.view(torch.uint8).view(-1, 8).flip(1).reshape(-1).view(torch.int64)
    return values


class MultiTableKVCounter(Counter):
    """``T`` fused bucketed key -> count tables on one device (the counter a module runs).

    Table ``t`` has ``counters[t].slots`` slots in buckets of ``counters[t].bucket_capacity``.
    :meth:`add` inserts or updates keys with the LFU policy: a key's count is the sum of every
    frequency added since it was inserted (saturating at ``2**63 - 1``), and a new key in a
    full bucket evicts the bucket's smallest count, never a key of the same call (counted by
    :meth:`evicted_since_last_read`). When every slot of a key's bucket holds a key of the same
    call the key cannot be placed (status FAILED): :meth:`add` then reports the sum of its
    frequencies in this call alone and the key is not stored.

    Memory (:meth:`memory_usage`): the bytes of every tensor the counter holds (its index and
    per-table bookkeeping), reported under ``DEVICE`` for a counter on a CUDA device and under
    ``HOST`` for a counter on the CPU; the other kind is 0.

    Args:
        counters: one :class:`KVCounter` per table (``T >= 1``).
        device: where the counter lives.

    Raises:
        AdmissionConfigError: ``counters`` is empty, holds something other than KVCounter, or
            an invalid one (:meth:`KVCounter.check`).
    """

    def __init__(self, counters: Sequence[KVCounter], device: torch.device | str = "cpu") -> None:
        configs = list(counters)
        if not configs:
            raise AdmissionConfigError("counters", configs, "needs one KVCounter per table")
        for t, config in enumerate(configs):
            if not isinstance(config, KVCounter):
                raise AdmissionConfigError(f"counters[{t}]", config, "must be a KVCounter")
            try:
                config.check()
            except AdmissionConfigError as err:
                option = f"counters[{t}].{err.option}"
                raise AdmissionConfigError(option, err.value, err.reason) from None
        self._configs = tuple(configs)
        self._index = TableIndex.create(
            [c.slots for c in configs],
            [c.bucket_capacity for c in configs],
            [ScorePolicy.LFU] * len(configs),
            device,
        )
        dev = self._index.device
        self._score_args = torch.zeros(len(configs), dtype=torch.int64, device=dev)
        self._evicted = torch.zeros(len(configs), dtype=torch.int64, device=dev)

    # ------------------------------------------------------------------ properties

    @property
    def num_tables(self) -> int:
        """``T``."""
        return len(self._configs)

    @property
    def device(self) -> torch.device:
        """Where the counter lives."""
        return self._index.device

    @property
    def configs(self) -> tuple[KVCounter, ...]:
        """The :class:`KVCounter` of each table."""
        return self._configs

    @property
    def capacities(self) -> tuple[int, ...]:
        """Slots of each table (``KVCounter.slots``)."""
        return self._index.capacities

    def size(self, table_id: int) -> int:
        """Keys table ``table_id`` holds (one sync on CUDA)."""
        self._index.slot_range(table_id)
        return int(self._index.sizes[table_id])

    # ------------------------------------------------------------------ counting

    def _frequencies(self, keys: torch.Tensor, frequencies: torch.Tensor | None) -> torch.Tensor:
        if frequencies is None:
            return torch.ones(keys.shape, dtype=torch.int64, device=self.device)
        if frequencies.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"frequencies must be int64 or int32, got {frequencies.dtype}")
        if frequencies.shape != keys.shape:
            raise ValueError(
                f"frequencies: shape {tuple(frequencies.shape)}, keys {tuple(keys.shape)}"
            )
        return frequencies.to(self.device, torch.int64)

    def add(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        frequencies: torch.Tensor | None = None,
        *,
        distinct: bool = False,
        check: bool = True,
        skips: bool = False,
    ) -> torch.Tensor:
        """Add frequencies to these keys, inserting the new ones, and return their counts.

        Args:
            keys: ``(N,)`` int64 or int32 keys on the counter's device (never -1).
            table_ids: ``(N,)`` int64 or int32 table of each key, in ``[0, T)``.
            frequencies: ``(N,)`` int64 or int32 increments (>= 0); None adds 1 per entry.
            distinct: the caller promises no ``(key, table)`` pair repeats (a key that could
                not be placed then counts its own frequency, with no search for repeats: no
                sync).
            check: check the keys, table ids and frequencies on CUDA (one sync); a caller
                that checked them passes False.
            skips: with ``distinct`` and ``check=False``: entries of key -1 stand for no key
                (nothing is counted for them; their count reads as their frequency), and on CUDA
                the call does not sync at all (the batch is expected to hold new keys).

        Returns:
            ``(N,)`` int64 on the counter's device: each key's count after the whole call
            (every duplicate sees the total); for a key that could not be placed, the sum of
            its frequencies in this call.

        Raises:
            ValueError / TypeError: bad keys, table ids or frequencies (naming them).
        """
        keys, table_ids = ops.as_batch(self._index, keys, table_ids)
        freq = self._frequencies(keys, frequencies)
        if keys.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if skips and (check or not distinct):
            raise ValueError(
                "skips: needs distinct=True and check=False (checked keys are never -1)"
            )
        result, all_hit, _ = ops.find_or_insert_rows(
            self._index, keys, table_ids, self._score_args, freq, check=check, wait=not skips
        )
        offsets = self._index.slot_offsets[table_ids]
        if all_hit:  # every key was counted before: no eviction, none failed
            return self._index.scores[0, offsets + result.slots]
        placed = result.slots >= 0
        counts = self._index.scores[0, offsets + result.slots.clamp_min(0)]
        counts = torch.where(placed, counts, freq)
        self._count_evictions(table_ids, result.status)
        if distinct:
            return counts
        failed = (~placed).nonzero().squeeze(1)
        if failed.numel():
            pairs = torch.stack([table_ids[failed], keys[failed]], dim=1)
            _, inverse = torch.unique(pairs, dim=0, return_inverse=True)
            sums = torch.zeros(failed.numel(), dtype=torch.int64, device=self.device)
            sums.index_add_(0, inverse, freq[failed])
            counts[failed] = sums[inverse]
        return counts

    def _count_evictions(self, table_ids: torch.Tensor, status: torch.Tensor) -> None:
        evicted = status == InsertStatus.EVICTED
        self._evicted += per_table_counts(table_ids, self.num_tables, evicted)

    def evicted_since_last_read(self) -> torch.Tensor:
        """``(T,)`` int64 keys the counter evicted per table since the previous call.

        On the counter's device; reading resets the tally.
        """
        out = self._evicted.clone()
        self._evicted.zero_()
        return out

    def erase(self, keys: torch.Tensor, table_ids: torch.Tensor, *, check: bool = True) -> None:
        """Remove these keys: ``(N,)`` keys and table ids; absent keys are ignored. ``check``:
        check them on CUDA (one sync), as :meth:`add`."""
        keys, table_ids = ops.as_batch(self._index, keys, table_ids)
        if keys.numel():
            ops.erase(self._index, keys, table_ids, check=check)

    def clear(self, table_id: int | None = None) -> None:
        """Empty one table, or all of them (evictions not counted)."""
        if table_id is not None:
            self._index.slot_range(table_id)
        ops.clear(self._index, table_id)

    # ------------------------------------------------------------------ memory

    def _tensors(self) -> tuple[torch.Tensor, ...]:
        index = self._index
        return (
            index.keys,
            index.digests,
            index.scores,
            index.slot_offsets,
            index.bucket_widths,
            index.policies,
            index.sizes,
            self._score_args,
            self._evicted,
        )

    def memory_usage(self, mem_type: MemoryType = MemoryType.DEVICE) -> int:
        """Bytes of ``mem_type`` the counter holds: all of its tensors' bytes under the kind of
        memory it lives in (``DEVICE`` on CUDA, ``HOST`` on the CPU), 0 under the other."""
        kind = MemoryType(mem_type)
        lives_in = MemoryType.HOST if self.device.type == "cpu" else MemoryType.DEVICE
        if kind is not lives_in:
            return 0
        return sum(t.numel() * t.element_size() for t in self._tensors())

    # ------------------------------------------------------------------ export / import

    def export(self, table_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every key of table ``table_id`` and its count, in ascending slot order.

        Returns:
            ``(keys, counts)``: ``(n,)`` int64 each, on the CPU.
        """
        out = ops.export(self._index, table_id)
        return out.keys.cpu(), out.scores[0].cpu()

    def import_(self, table_id: int, keys: torch.Tensor, counts: torch.Tensor) -> int:
        """Insert keys into table ``table_id`` with these counts.

        A key already present gets its count replaced; keys not in ``keys`` stay (an import into
        a non-empty table adds to it). Keys are inserted by descending count, so where a bucket
        overflows (e.g. a smaller capacity than the dump's) the largest counts stay: a new key
        may evict a smaller count present before (counted by :meth:`evicted_since_last_read`),
        and a key finding its bucket full of imported keys is dropped. ``keys`` should be unique
        (as :meth:`export` gives them); of duplicates, the smallest count is kept.

        Args:
            table_id: the table, in ``[0, T)``.
            keys: ``(n,)`` int64 or int32 keys (any device).
            counts: ``(n,)`` int64 or int32 counts, ``>= 0`` (any device).

        Returns:
            How many keys could not be placed.

        Raises:
            CounterDataError: ``keys`` and ``counts`` differ in length or shape, or a count is
                negative.
            TypeError: a dtype other than int64 / int32.
        """
        self._index.slot_range(table_id)
        for name, t in (("keys", keys), ("counts", counts)):
            if t.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"{name} must be int64 or int32, got {t.dtype}")
            if t.dim() != 1:
                raise CounterDataError(name, f"must be 1-D, got shape {tuple(t.shape)}")
        if keys.numel() != counts.numel():
            raise CounterDataError(
                "counts", f"{counts.numel()} counts for {keys.numel()} keys: lengths differ"
            )
        if keys.numel() == 0:
            return 0
        keys = keys.to(self.device, torch.int64)
        counts = counts.to(self.device, torch.int64)
        if bool((counts < 0).any()):
            raise CounterDataError("counts", "contains a negative count")
        order = torch.argsort(counts, descending=True, stable=True)
        table_ids = torch.full_like(keys, table_id)
        result = ops.insert_or_assign(
            self._index, keys[order], table_ids, counts[order].unsqueeze(0)
        )
        self._count_evictions(table_ids, result.status)
        return int((result.status == InsertStatus.FAILED).sum())

    def dump(self, key_file: CounterFile, counter_file: CounterFile, table_id: int) -> None:
        """Write table ``table_id``'s keys and counts (:meth:`export`) as raw little-endian
        int64 arrays: keys to ``key_file``, counts to ``counter_file`` (paths are created or
        truncated; file objects are written at their position and left open)."""
        keys, counts = self.export(table_id)
        _write(key_file, keys)
        _write(counter_file, counts)

    def load(self, key_file: CounterFile, counter_file: CounterFile, table_id: int) -> None:
        """Read keys and counts written by :meth:`dump` (file objects are read to their end)
        and :meth:`import_` them into table ``table_id`` (adding to what it holds). Warns when
        some keys could not be placed (a capacity smaller than the dump's).

        Raises:
            CounterDataError: a file's size is not a multiple of 8 bytes, or the two files hold
                different numbers of values (the message names the files).
        """
        self._index.slot_range(table_id)
        keys = _read(key_file)
        counts = _read(counter_file)
        if keys.numel() != counts.numel():
            raise CounterDataError(
                f"{_file_name(key_file)}, {_file_name(counter_file)}",
                f"{keys.numel()} keys but {counts.numel()} counts: the files disagree in length",
            )
        dropped = self.import_(table_id, keys, counts)
        if dropped:
            warnings.warn(
                f"{_file_name(key_file)}: {dropped} of {keys.numel()} keys did not fit table "
                f"{table_id} of the counter ({self.capacities[table_id]} slots); the largest "
                "counts were kept",
                RuntimeWarning,
                stacklevel=2,
            )
