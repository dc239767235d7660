"""What a :class:`~demb_storage.Storage` holds per table (:class:`RowLayout`) and what its
methods return: small frozen dataclasses of tensors with documented shapes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from demb_storage._errors import TableConfigError
from demb_storage.options import VALUE_DTYPES, TableConfig

__all__ = [
    "EvictedEntries",
    "FoundEntries",
    "InsertedEntries",
    "MemoryUsage",
    "RowLayout",
    "StorageExport",
]


@dataclass(frozen=True)
class RowLayout:
    """The value row of one table in a storage: ``dim`` embedding columns then ``state_dim``
    optimizer-state columns, ``dim + state_dim`` elements of ``dtype``.

    A storage checks its layouts when it is built (:meth:`check`), naming the table.
    """

    dim: int
    """Embedding columns."""
    state_dim: int = 0
    """Optimizer-state columns after the embedding."""
    dtype: torch.dtype = torch.float32
    """float32, float16 or bfloat16."""

    @classmethod
    def of(cls, config: TableConfig) -> RowLayout:
        """The layout of a :class:`~demb_storage.TableConfig`'s rows."""
        return cls(config.dim, config.state_dim, config.dtype)

    @property
    def width(self) -> int:
        """Elements per row, ``dim + state_dim``."""
        return self.dim + self.state_dim

    @property
    def row_bytes(self) -> int:
        """Bytes per row."""
        return self.width * self.dtype.itemsize

    def describe(self) -> str:
        """``"<width> x <dtype>"`` (``dim + state_dim``), for messages."""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.width} x {dtype} ({self.dim} + {self.state_dim})"

    def check(self, table: str) -> None:
        """Raise :class:`~demb_storage.TableConfigError` (option ``<table>.dim``,
        ``<table>.state_dim`` or ``<table>.dtype``) unless ``dim`` is a positive integer,
        ``state_dim`` a non-negative one and ``dtype`` a value dtype."""
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise TableConfigError(f"{table}.dim", self.dim, "must be a positive integer")
        state = self.state_dim
        if isinstance(state, bool) or not isinstance(state, int) or state < 0:
            raise TableConfigError(f"{table}.state_dim", state, "must be a non-negative integer")
        if self.dtype not in VALUE_DTYPES:
            raise TableConfigError(
                f"{table}.dtype", self.dtype, "must be float32, float16 or bfloat16"
            )


@dataclass(frozen=True)
class FoundEntries:
    """What :meth:`Storage.find` returns for ``N`` keys."""

    found: torch.Tensor
    """``(N,)`` bool, True where the key is stored."""
    values: torch.Tensor
    """``(N, width)`` rows in the tables' dtype; zeros where not found."""
    scores: torch.Tensor
    """``(W, N)`` int64 score words; zeros where not found."""


@dataclass(frozen=True)
class EvictedEntries:
    """Entries a storage dropped to make room for an insert, each reported once, with what
    they held (only entries of the call's tables, never a key of the call)."""

    keys: torch.Tensor
    """``(M,)`` int64."""
    table_ids: torch.Tensor
    """``(M,)`` int64."""
    values: torch.Tensor
    """``(M, width)`` their rows, in the call's row layout."""
    scores: torch.Tensor
    """``(W, M)`` int64 their score words."""

    def __len__(self) -> int:
        return int(self.keys.shape[0])


@dataclass(frozen=True)
class InsertedEntries:
    """What :meth:`Storage.insert` did with each of its ``N`` entries."""

    inserted: torch.Tensor
    """``(N,)`` bool, True where the key was new to the storage and is now stored."""
    stored: torch.Tensor
    """``(N,)`` bool, True where the row and scores are stored now (new or overwritten);
    False where the storage had no room for a new key (a bounded storage)."""
    evicted: EvictedEntries
    """Entries evicted to make room (none for a storage without a capacity limit)."""

    @property
    def overwritten(self) -> torch.Tensor:
        """``(N,)`` bool, True where a present key's row and scores were replaced."""
        return self.stored & ~self.inserted


@dataclass(frozen=True)
class StorageExport:
    """Entries of one table (:meth:`Storage.export`, one chunk of
    :meth:`Storage.export_chunks`)."""

    keys: torch.Tensor
    """``(n,)`` int64."""
    values: torch.Tensor
    """``(n, width)`` rows in the table's dtype."""
    scores: torch.Tensor
    """``(W, n)`` int64 score words."""

    def __len__(self) -> int:
        return int(self.keys.shape[0])


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes a storage holds, per kind of memory."""

    device: int = 0
    """Accelerator memory (HBM)."""
    host: int = 0
    """Host memory (pinned or not; for RocksDB its memtables and block cache)."""
    external: int = 0
    """Outside the process's memory: files on disk (SSD), a remote server."""

    @property
    def total(self) -> int:
        """All of it."""
        return self.device + self.host + self.external

    def __add__(self, other: MemoryUsage) -> MemoryUsage:
        return MemoryUsage(
            self.device + other.device, self.host + other.host, self.external + other.external
        )

    @classmethod
    def of_tensors(cls, tensors: Sequence[torch.Tensor]) -> MemoryUsage:
        """The bytes of ``tensors``: device memory for those on an accelerator, host memory
        for the others."""
        device = sum(x.nbytes for x in tensors if x.device.type != "cpu")
        return cls(device=device, host=sum(x.nbytes for x in tensors) - device)

    @classmethod
    def of_values(cls, values: torch.Tensor, device_rows: int | None) -> MemoryUsage:
        """The bytes of a table's ``(rows, width)`` value buffer: a hybrid buffer's rows past
        ``device_rows`` (:attr:`TableConfig.device_rows`) are in host memory, though the
        tensor is a CUDA one."""
        if device_rows is None or not values.is_cuda:
            return cls.of_tensors([values])
        row = values.shape[1] * values.element_size()
        device = min(values.shape[0], device_rows) * row
        return cls(device=device, host=values.nbytes - device)
