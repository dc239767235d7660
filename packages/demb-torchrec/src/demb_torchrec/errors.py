"""Every exception demb raises on purpose, in one hierarchy rooted at :class:`DembError`.

``DembError`` and the errors of the lower packages are re-exported here, beside the table
module's own. Each also derives from the built-in type its case fits, so code written against
the specification (``except ValueError``) keeps working::

    DembError
    ├── PlannerConfigError (ValueError)      a sharding or capacity argument
    ├── IoError                              demb-io
    │   ├── FormatError (ValueError)         a file that does not hold what its format says
    │   └── LayoutError (ValueError)         two layouts that must agree do not
    ├── OptimizerConfigError (ValueError)    an optimizer hyper-parameter
    ├── StorageError                         demb-storage
    │   ├── TableConfigError (ValueError)    a table option
    │   │   └── AdmissionConfigError         an admission strategy or counter option
    │   ├── InsertFailedError (RuntimeError) keys that found no slot (safe-check ERROR)
    │   ├── CounterDataError (ValueError)    counter keys and counts that do not fit together
    │   ├── StorageBatchError (ValueError)   a malformed batch for an external Storage
    │   └── StorageClosedError (RuntimeError) a Storage used after close()
    ├── InputError (ValueError)              a bad value given to a module or model API
    ├── ConfigError (ValueError)             a model, plan, sharding or checkpoint setting
    ├── CheckpointError (RuntimeError)       a dump that failed on some rank (nothing committed)
    ├── InputTypeError (TypeError)           an argument of the wrong type or dtype
    ├── TrainingStateError (RuntimeError)    a step the tables' state does not allow
    └── NotSupportedError (NotImplementedError)  an option whose feature demb does not have

Every message names the table (where there is one) and the argument.
"""

from __future__ import annotations

from demb_io import FormatError, IoError, LayoutError
from demb_optim import OptimizerConfigError
from demb_planner import DembError, PlannerConfigError
from demb_storage import InsertFailedError, StorageError, TableConfigError

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DembError",
    "FormatError",
    "InputError",
    "InputTypeError",
    "InsertFailedError",
    "IoError",
    "LayoutError",
    "NotSupportedError",
    "OptimizerConfigError",
    "PlannerConfigError",
    "StorageError",
    "TableConfigError",
    "TrainingStateError",
]


def _where(table: str | None, argument: str) -> str:
    return f"table {table!r}: {argument}" if table is not None else argument


class InputError(DembError, ValueError):
    """A value given to a module or a model-level API is invalid.

    Attributes:
        argument: the offending argument (``"offsets"``, ``"pooling_weights"``, ...).
        table: the table it concerns, or ``None`` when it concerns the whole call.
    """

    def __init__(self, argument: str, reason: str, table: str | None = None) -> None:
        self.argument = argument
        self.table = table
        super().__init__(f"{_where(table, argument)}: {reason}")


class CheckpointError(DembError, RuntimeError):
    """A dump failed on some rank; the previous checkpoint is left as it was. The message names
    the target and every rank's error."""


class ConfigError(DembError, ValueError):
    """A model, plan, sharding or checkpoint setting that cannot work (constraints that rule
    out row-wise sharding, an optimizer dynamic tables lack, a checkpoint of another layout);
    the message names the table and the setting."""


class InputTypeError(DembError, TypeError):
    """An argument has the wrong type or dtype; the message names it (and the table)."""

    def __init__(self, argument: str, reason: str, table: str | None = None) -> None:
        self.argument = argument
        self.table = table
        super().__init__(f"{_where(table, argument)}: {reason}")


class NotSupportedError(DembError, NotImplementedError):
    """An option or a setting asks for a feature demb does not have; names the table and option."""

    def __init__(self, option: str, reason: str, table: str | None = None) -> None:
        self.option = option
        self.table = table
        super().__init__(f"{_where(table, option)}: {reason}")


class TrainingStateError(DembError, RuntimeError):
    """A training step the tables cannot take in their state (built with ``training=False``, or
    sharded without an optimizer); the message names the tables and what to do instead.

    Attributes:
        tables: the tables concerned.
    """

    def __init__(self, tables: list[str], reason: str) -> None:
        self.tables = tables
        super().__init__(f"tables {tables}: {reason}")
