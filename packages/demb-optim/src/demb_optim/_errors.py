"""Exceptions of demb-optim."""

from __future__ import annotations

from demb_planner import DembError

__all__ = ["OptimizerConfigError"]


class OptimizerConfigError(DembError, ValueError):
    """A hyper-parameter is invalid; the message names the field and its value."""

    def __init__(self, field: str, value: object, reason: str) -> None:
        super().__init__(f"{field}={value!r}: {reason}")
        self.field = field
        self.value = value
