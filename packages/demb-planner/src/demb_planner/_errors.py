"""Exception types of demb-planner."""

from __future__ import annotations

__all__ = ["PlannerConfigError"]


class PlannerConfigError(ValueError):
    """A sharding or capacity argument is invalid.

    A ``ValueError`` so callers written against the spec (which documents ``ValueError``) keep
    working; the message always names the offending argument and its value.
    """

    def __init__(self, argument: str, value: object, reason: str) -> None:
        self.argument = argument
        self.value = value
        self.reason = reason
        super().__init__(f"{argument}={value!r}: {reason}")
