"""Per-table options of a scored hash table: score strategy, safe-check mode, capacities."""

from __future__ import annotations

import enum
import functools
import math
from dataclasses import dataclass

import torch
from demb_kernels.table import ScorePolicy
from demb_planner import BUCKET_ALIGNMENT

from demb_storage._errors import TableConfigError
from demb_storage._score_check import ScoreFunction, check_score_function

__all__ = [
    "VALUE_DTYPES",
    "SafeCheckMode",
    "ScoreLayout",
    "ScoreStrategy",
    "TableConfig",
    "resolve_score_strategy",
]

VALUE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""dtypes a table's value rows may have."""


class ScoreStrategy(enum.IntEnum):
    """How a table scores its keys (the spec's ``DynamicEmbScoreStrategy``)."""

    TIMESTAMP = 0
    """The device's nanosecond timer at the batch (a monotonic clock on the CPU)."""
    STEP = 1
    """The table's step, +1 per forward."""
    CUSTOMIZED = 2
    """The caller's score, set with ``set_score`` before a forward."""
    LFU = 3
    """Accumulated access frequency."""
    NO_EVICTION = 4
    """Never evicts: the table doubles instead (until memory runs out)."""


class SafeCheckMode(enum.IntEnum):
    """What happens to keys that cannot be inserted (the spec's ``DynamicEmbCheckMode``)."""

    ERROR = 0
    """Raise :class:`~demb_storage.InsertFailedError` with the counts."""
    WARNING = 1
    """Warn with the counts; their rows read as zeros."""
    IGNORE = 2
    """Their rows read as zeros; only the table's failed-insert statistic counts them."""


@dataclass(frozen=True)
class ScoreLayout:
    """A resolved score strategy: the kernel policy and the score columns users see."""

    policy: ScorePolicy
    columns: tuple[ScoreStrategy, ...]
    """Score columns in the user's order (dumps, ``score_function``)."""

    @property
    def index_words(self) -> tuple[int, ...]:
        """For each user column, the index score word that holds it (TIMESTAMP_LFU stores
        ``[frequency, timestamp]``)."""
        if self.policy is ScorePolicy.TIMESTAMP_LFU:
            return tuple(0 if c is ScoreStrategy.LFU else 1 for c in self.columns)
        return (0,)

    @property
    def threshold_column(self) -> int:
        """The user column an incremental dump's ``min_score`` filters on: the timestamp of a
        compound strategy (what was touched since), else the only one."""
        if self.policy is ScorePolicy.TIMESTAMP_LFU:
            return self.columns.index(ScoreStrategy.TIMESTAMP)
        return 0


_SINGLE = {
    ScoreStrategy.TIMESTAMP: ScorePolicy.TIMESTAMP,
    ScoreStrategy.STEP: ScorePolicy.STEP,
    ScoreStrategy.CUSTOMIZED: ScorePolicy.CUSTOMIZED,
    ScoreStrategy.LFU: ScorePolicy.LFU,
    ScoreStrategy.NO_EVICTION: ScorePolicy.NO_EVICTION,
}


def resolve_score_strategy(value: object) -> ScoreLayout:
    """The layout of a ``score_strategy``: one strategy, a one-element tuple (that strategy), or
    ``(TIMESTAMP, LFU)`` in either order (two score words).

    Raises:
        TableConfigError: any other value.
    """
    items = value if isinstance(value, tuple) else (value,)
    try:
        parsed = tuple(ScoreStrategy(int(v)) for v in items)
    except (TypeError, ValueError):
        raise TableConfigError(
            "score_strategy", value, "expected a ScoreStrategy or a tuple of them"
        ) from None
    if len(parsed) == 1:
        return ScoreLayout(_SINGLE[parsed[0]], parsed)
    if sorted(parsed) == [ScoreStrategy.TIMESTAMP, ScoreStrategy.LFU]:
        return ScoreLayout(ScorePolicy.TIMESTAMP_LFU, parsed)
    raise TableConfigError(
        "score_strategy", value, "the only compound strategy is (TIMESTAMP, LFU), in either order"
    )


@dataclass(frozen=True)
class TableConfig:
    """One logical table of a :class:`~demb_storage.ScoredHashTable`.

    A value row is ``[embedding | optimizer state]``: ``dim + state_dim`` elements of ``dtype``.
    The table starts with ``init_capacity`` slots and doubles (at most to ``max_capacity``)
    whenever a batch would take its load factor above ``max_load_factor``. NO_EVICTION tables
    fill their slots (a value row each) before they double, when a batch's new keys outnumber
    the free slots or a key finds its bucket full, and keep doubling past ``max_capacity``
    until memory runs out.
    """

    dim: int
    """Embedding columns of a row."""
    max_capacity: int
    """Most slots the table grows to (a multiple of ``bucket_capacity``)."""
    init_capacity: int | None = None
    """Slots at creation (a multiple of ``bucket_capacity``); default ``max_capacity``."""
    state_dim: int = 0
    """Optimizer-state columns after the embedding."""
    dtype: torch.dtype = torch.float32
    """dtype of the value rows: float32, float16 or bfloat16."""
    bucket_capacity: int = 128
    """Slots per bucket, a multiple of 16."""
    max_load_factor: float = 0.5
    """Load factor above which the table doubles, in ``(0, 1]``."""
    score_strategy: ScoreStrategy | tuple[ScoreStrategy, ...] = ScoreStrategy.TIMESTAMP
    """How keys are scored (see :class:`ScoreStrategy`)."""
    safe_check_mode: SafeCheckMode = SafeCheckMode.IGNORE
    """What failed inserts do (see :class:`SafeCheckMode`)."""
    retain_evicted: bool = False
    """Record the keys this table's inserts evict (``ScoredHashTable.evicted_keys``)."""
    score_function: ScoreFunction | None = None
    """Custom eviction score of a compound ``(TIMESTAMP, LFU)`` table (either order), or None
    (evict the least frequent, then the oldest): ``score_function(scores, cur_timestamp) ->
    float``, ``scores`` the key's timestamp and frequency in the tuple's order,
    ``cur_timestamp`` the batch's timestamp; a full bucket evicts the key with the lowest score
    (NaN first). A numba-compilable Python function of two positional parameters
    (:mod:`demb_storage.score_function`), compiled when the table is built."""
    device_rows: int | None = None
    """A hybrid table: only the first ``device_rows`` value rows live in the CUDA device's
    memory, the others in host memory the device reads over the bus, under one index (a row's
    place follows its slot; :mod:`demb_kernels.hybrid`). None: every row on the values'
    device. Ignored on the CPU, where both are the host's memory."""

    def __post_init__(self) -> None:
        for name in ("dim", "max_capacity", "bucket_capacity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TableConfigError(name, value, "must be a positive integer")
        if isinstance(self.state_dim, bool) or not isinstance(self.state_dim, int):
            raise TableConfigError("state_dim", self.state_dim, "must be a non-negative integer")
        if self.state_dim < 0:
            raise TableConfigError("state_dim", self.state_dim, "must be a non-negative integer")
        if self.bucket_capacity % BUCKET_ALIGNMENT:
            raise TableConfigError(
                "bucket_capacity",
                self.bucket_capacity,
                f"must be a multiple of {BUCKET_ALIGNMENT}",
            )
        for name in ("max_capacity", "init_capacity"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise TableConfigError(name, value, "must be a positive integer")
            if value % self.bucket_capacity:
                raise TableConfigError(
                    name, value, f"must be a multiple of bucket_capacity={self.bucket_capacity}"
                )
        if self.init_capacity is not None and self.init_capacity > self.max_capacity:
            raise TableConfigError(
                "init_capacity", self.init_capacity, f"exceeds max_capacity={self.max_capacity}"
            )
        rows = self.device_rows
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise TableConfigError("device_rows", rows, "must be None or an integer >= 0")
        if self.dtype not in VALUE_DTYPES:
            raise TableConfigError("dtype", self.dtype, "must be float32, float16 or bfloat16")
        if not (isinstance(self.max_load_factor, float | int) and 0 < self.max_load_factor <= 1):
            raise TableConfigError("max_load_factor", self.max_load_factor, "must be in (0, 1]")
        if not math.isfinite(self.max_load_factor):
            raise TableConfigError("max_load_factor", self.max_load_factor, "must be finite")
        try:
            SafeCheckMode(self.safe_check_mode)
        except ValueError:
            raise TableConfigError(
                "safe_check_mode", self.safe_check_mode, "not a SafeCheckMode"
            ) from None
        layout = resolve_score_strategy(self.score_strategy)
        if self.score_function is not None:
            if layout.policy is not ScorePolicy.TIMESTAMP_LFU:
                raise TableConfigError(
                    "score_function",
                    self.score_function,
                    f"needs the compound score_strategy (TIMESTAMP, LFU) in either order, got "
                    f"score_strategy={self.score_strategy!r}",
                )
            check_score_function(self.score_function)

    @property
    def width(self) -> int:
        """Elements per value row, ``dim + state_dim``."""
        return self.dim + self.state_dim

    @property
    def initial_capacity(self) -> int:
        """Slots at creation."""
        return self.max_capacity if self.init_capacity is None else self.init_capacity

    @functools.cached_property
    def score_layout(self) -> ScoreLayout:
        """The resolved score strategy (resolved once: the config is frozen)."""
        return resolve_score_strategy(self.score_strategy)

    @property
    def load_factor_limit(self) -> float:
        """The load factor that triggers doubling. NO_EVICTION ignores ``max_load_factor``: its
        tables double when a batch's new keys would outnumber the free rows, or when a key
        finds its bucket full (one value row a slot, filled before the table doubles; see
        docs/hash_table.md)."""
        if self.score_layout.policy is ScorePolicy.NO_EVICTION:
            return 1.0
        return float(self.max_load_factor)
