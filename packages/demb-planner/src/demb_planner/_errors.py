"""The root of demb's exceptions, and demb-planner's own.

Every exception demb raises on purpose derives from :class:`DembError`, defined here because
demb-planner is the lowest package of the stack. Each package derives its own errors from it,
also deriving from the built-in type the case fits (``ValueError`` for a bad value, ``TypeError``
for a bad type, ``RuntimeError`` for a failed operation), so ``except ValueError`` written
against the specification keeps working and ``except DembError`` catches all of demb's.
"""

from __future__ import annotations

__all__ = ["DembError", "PlannerConfigError"]


class DembError(Exception):
    """Base of every error demb raises on purpose."""


class PlannerConfigError(DembError, ValueError):
    """A sharding or capacity argument is invalid.

    A ``ValueError`` so callers written against the spec (which documents ``ValueError``) keep
    working; the message always names the offending argument and its value.
    """

    def __init__(self, argument: str, value: object, reason: str) -> None:
        self.argument = argument
        self.value = value
        self.reason = reason
        super().__init__(f"{argument}={value!r}: {reason}")
