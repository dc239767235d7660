"""demb-io's exceptions: every error names the file (and the field) it is about."""

from __future__ import annotations

from pathlib import Path

from demb_planner import DembError

__all__ = ["FormatError", "IoError", "LayoutError"]


class IoError(DembError):
    """Base of demb-io's errors."""


class FormatError(IoError, ValueError):
    """A file or directory that does not hold what its format (or its meta) says.

    Attributes:
        path: the offending file or directory.
        field: the meta field or part of the format that disagrees (``""`` if none).
    """

    def __init__(self, path: str | Path, field: str, message: str) -> None:
        self.path = Path(path)
        self.field = field
        where = f"{self.path}" + (f" [{field}]" if field else "")
        super().__init__(f"{where}: {message}")


class LayoutError(IoError, ValueError):
    """Two things that must share a layout (deltas to merge, a delta and the checkpoint it
    applies to) do not; the message names the table and the field."""
