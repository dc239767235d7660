"""Argument checks shared by the planner's modules."""

from __future__ import annotations

import numbers

from demb_planner._errors import PlannerConfigError

__all__ = ["non_negative_int", "positive_int"]


def _as_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise PlannerConfigError(name, value, "must be an integer")
    return int(value)


def positive_int(name: str, value: object) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= 1, else raise naming ``name``."""
    result = _as_int(name, value)
    if result < 1:
        raise PlannerConfigError(name, value, "must be a positive integer")
    return result


def non_negative_int(name: str, value: object) -> int:
    """Return ``value`` as an ``int`` if it is an integer >= 0, else raise naming ``name``."""
    result = _as_int(name, value)
    if result < 0:
        raise PlannerConfigError(name, value, "must be a non-negative integer")
    return result
