"""What a ``score_function`` must be (a table's config checks it; :mod:`.score_function`
compiles it)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from demb_storage._errors import TableConfigError

__all__ = ["ScoreFunction", "check_score_function"]

ScoreFunction = Callable[[Any, int], float]
"""``score_function(scores, cur_timestamp) -> float``: ``scores`` two int64 words in the
table's tuple order, ``cur_timestamp`` an int64; a numba-compilable Python function."""


def check_score_function(function: object) -> None:
    """Raise unless ``function`` is a Python function of exactly two positional parameters
    (``scores, cur_timestamp``), as numba compiles it.

    Raises:
        TableConfigError: naming ``score_function`` and what is wrong.
    """
    if not inspect.isfunction(function):
        raise TableConfigError(
            "score_function", function, "must be a Python function (scores, cur_timestamp)"
        )
    params = list(inspect.signature(function).parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != 2 or any(p.kind not in positional for p in params):
        names = ", ".join(str(p) for p in params)
        raise TableConfigError(
            "score_function",
            function,
            f"{function.__qualname__}({names}) must take exactly two positional parameters "
            "(scores, cur_timestamp)",
        )
