"""Exceptions of demb-storage."""

from __future__ import annotations

from demb_planner import DembError

__all__ = [
    "AdmissionConfigError",
    "CounterDataError",
    "InsertFailedError",
    "StorageBatchError",
    "StorageClosedError",
    "StorageError",
    "TableConfigError",
]


class StorageError(DembError):
    """Base class of demb-storage's errors."""


class TableConfigError(StorageError, ValueError):
    """A table option is invalid; the message names the option and its value."""

    def __init__(self, option: str, value: object, reason: str) -> None:
        super().__init__(f"{option}={value!r}: {reason}")
        self.option = option
        self.value = value
        self.reason = reason


class InsertFailedError(StorageError, RuntimeError):
    """Keys could not be inserted and the table's safe-check mode is ERROR."""

    def __init__(self, failed: dict[int, int], batch: int) -> None:
        per_table = ", ".join(f"table {t}: {n}" for t, n in sorted(failed.items()))
        super().__init__(
            f"{sum(failed.values())} of {batch} keys could not be inserted ({per_table}): their "
            "buckets had no free or evictable slot. Raise the table's capacity, or set "
            "safe_check_mode to WARNING or IGNORE to read their rows as zeros."
        )
        self.failed = failed
        self.batch = batch


class AdmissionConfigError(TableConfigError):
    """An admission option (strategy or counter) is invalid; :meth:`for_table` names the
    table."""

    def for_table(self, table: str) -> AdmissionConfigError:
        """The same error with the option prefixed by the table's name (``<table>.<option>``)."""
        return AdmissionConfigError(f"{table}.{self.option}", self.value, self.reason)


class CounterDataError(StorageError, ValueError):
    """Keys and counts handed to a counter (files or tensors) are malformed.

    The message names the file or the argument; ``source`` holds it.
    """

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source


class StorageBatchError(StorageError, ValueError):
    """A batch handed to a :class:`Storage` is malformed (shape, dtype, table id, duplicate
    key, tables of different row layouts); the message names the argument and the table."""

    def __init__(self, argument: str, reason: str) -> None:
        super().__init__(f"{argument}: {reason}")
        self.argument = argument
        self.reason = reason


class StorageClosedError(StorageError, RuntimeError):
    """A :class:`Storage` was used after :meth:`Storage.close`."""
