"""``ScoredHashTable``: fused scored hash tables with their value rows, growth and safe checks.

The index (keys, digests, scores) is a :class:`demb_kernels.table.TableIndex`; each table also
has a value buffer of ``capacity`` rows ``[embedding | optimizer state]`` addressed by slot, so
the number of slots never exceeds the value rows. Tables double (up to ``max_capacity``; without
limit for NO_EVICTION) before a batch would take them above their load factor; values move with
their keys.

Environment: ``DEMB_DETERMINISM_MODE`` and ``DYNAMICEMB_CSTM_SCORE_CHECK`` are read once, when a
table is built (constructor arguments override them), never in a hot path.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence

import torch
from demb_kernels import table as ops
from demb_kernels.rows import gather_rows, scatter_rows
from demb_kernels.table import EMPTY_KEY, InsertStatus, ScorePolicy, TableIndex

from demb_storage._errors import TableConfigError
from demb_storage._export import export_table, export_tables
from demb_storage._failures import count_failed, raise_or_warn
from demb_storage._no_eviction import retry_no_eviction
from demb_storage._outcome_counts import OutcomeCounts
from demb_storage._outcomes import EvictedRows, InsertOutcome, TableExport
from demb_storage._retained import KeyBuffer
from demb_storage._scores import TIME_POLICIES, batch_scores, checked_scores, settled_clock
from demb_storage._table_values import (
    allocate_values,
    evicted_rows,
    move_rows,
    zero_inserted_rows,
)
from demb_storage.options import SafeCheckMode, TableConfig
from demb_storage.score_function import VictimRanker
from demb_storage.table_counts import per_table_counts

__all__ = ["EvictedRows", "InsertOutcome", "ScoredHashTable", "TableExport"]


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return raw.strip().lower() not in ("0", "false", "no", "off", "")


class ScoredHashTable:
    """``T`` fused scored hash tables with value rows, on one device.

    Args:
        tables: one :class:`TableConfig` per table.
        device: where the index lives.
        value_device: where the value rows live (default ``device``); host rows of a CUDA index
            are pinned.
        deterministic: equal-score victims and concurrent inserts resolved deterministically.
            Default: whether ``DEMB_DETERMINISM_MODE`` is set. demb's table ops resolve both
            deterministically in every mode (phase B handles a bucket's keys in batch order and
            ranks victims by score then position), so the flag only records the request.
        score_check: warn when a CUSTOMIZED score decreases; default: unless
            ``DYNAMICEMB_CSTM_SCORE_CHECK=0``.
        clock: returns the batch timestamp as a ``(1,)`` int64 tensor on ``device``; default
            :func:`demb_kernels.table.timestamp` (device timer on CUDA, monotonic ns on CPU).
        names: the tables' names, for errors (default: their numbers).

    Raises:
        TableConfigError: no table, or a table's ``score_function`` that numba cannot compile
            (for the CPU, and for the GPU on CUDA), naming the table.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        device: torch.device | str = "cpu",
        *,
        value_device: torch.device | str | None = None,
        deterministic: bool | None = None,
        score_check: bool | None = None,
        clock: Callable[[], torch.Tensor] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        if not tables:
            raise TableConfigError("tables", tables, "needs at least one table")
        self.configs = tuple(tables)
        self.device = torch.device(device)
        self.value_device = self.device if value_device is None else torch.device(value_device)
        self.deterministic = (
            "DEMB_DETERMINISM_MODE" in os.environ if deterministic is None else deterministic
        )
        self.score_check = (
            _env_flag("DYNAMICEMB_CSTM_SCORE_CHECK", True) if score_check is None else score_check
        )
        self._clock = clock
        layouts = [c.score_layout for c in self.configs]
        ranked = VictimRanker.ranked(self.configs)
        self._ranker = None if ranked is None else VictimRanker(self.configs, self.device, names)
        """The tables' compiled score functions, or None when no table has one."""
        self.index = TableIndex.create(
            [c.initial_capacity for c in self.configs],
            [c.bucket_capacity for c in self.configs],
            [layout.policy for layout in layouts],
            self.device,
            ranked=ranked,
        )
        self.values = [
            allocate_values(c.initial_capacity, c, self.value_device, self.device)
            for c in self.configs
        ]
        self.steps = [0] * self.num_tables
        self.custom_scores = [0] * self.num_tables
        self.failed_inserts = torch.zeros(self.num_tables, dtype=torch.int64, device=self.device)
        """``(T,)`` int64 running count of keys that could not be inserted, per table."""
        self._can_grow = [True] * self.num_tables
        self._like = torch.empty(0, dtype=torch.int64, device=self.device)
        """An empty tensor on the index device (where :func:`demb_kernels.table.timestamp`
        reads the clock)."""
        self._any_growable = True
        """Whether some table can still grow: only :meth:`expand` changes it."""
        self._refresh_growth()
        self._checks_failures = any(
            c.safe_check_mode is not SafeCheckMode.IGNORE for c in self.configs
        )
        retains = [c.retain_evicted for c in self.configs]
        self._retains = torch.tensor(retains, device=self.device) if any(retains) else None
        """``(T,)`` bool tables that record their evictions, or None when none does (then
        inserts record nothing: no work at all)."""
        self.evicted_keys = KeyBuffer(self.num_tables)
        """Keys evicted by the inserts of tables with ``retain_evicted``."""
        self.erased_keys = KeyBuffer(self.num_tables)
        """Keys removed by :meth:`erase` calls that asked to record them, with their slots."""
        self.outcomes = OutcomeCounts(self.num_tables, self.device)
        """What inserts did per table (counted once enabled)."""
        self.counts_keys = any(
            layout.policy in (ScorePolicy.LFU, ScorePolicy.TIMESTAMP_LFU) for layout in layouts
        )
        """Whether some table's scores count its keys' occurrences (LFU, TIMESTAMP_LFU): only
        then does a find_or_insert read the batch's counts."""
        self.scores_from_gpu_clock = (
            self.device.type == "cuda"
            and clock is None
            and all(layout.policy in TIME_POLICIES for layout in layouts)
        )
        """Whether :meth:`next_score_args` is the GPU's global timer for every table (CUDA, all
        policies timed, no ``clock``): a caller may pass a later reading as ``score_args``
        (:attr:`demb_kernels.launched.LaunchedDedup.clock`)."""

    # ----------------------------------------------------------------------------- state
    @property
    def num_tables(self) -> int:
        """``T``."""
        return len(self.configs)

    @property
    def may_grow(self) -> bool:
        """Whether some table can still grow (a find_or_insert may then expand it first)."""
        return self._any_growable

    def _table(self, table_id: int) -> int:
        """``table_id`` itself, checked: an integer in ``[0, num_tables)``."""
        if isinstance(table_id, bool) or not isinstance(table_id, int):
            raise TableConfigError("table_id", table_id, "must be an integer")
        if not 0 <= table_id < self.num_tables:
            raise TableConfigError(
                "table_id", table_id, f"out of range for {self.num_tables} tables"
            )
        return table_id

    def capacity(self, table_id: int) -> int:
        """Slots (= value rows) of table ``table_id`` now."""
        return self.index.capacities[self._table(table_id)]

    def size(self, table_id: int) -> int:
        """Keys in table ``table_id`` (one sync)."""
        return int(self.index.sizes[self._table(table_id)])

    def load_factor(self, table_id: int) -> float:
        """``size / capacity`` of table ``table_id``."""
        return self.size(table_id) / self.capacity(table_id)

    def set_score(self, table_id: int, score: int) -> None:
        """The score a CUSTOMIZED table gives the keys of the next batches.

        Warns when it is lower than the previous one (unless score checks are off).
        """
        if self.index.policy_list[self._table(table_id)] is not ScorePolicy.CUSTOMIZED:
            raise TableConfigError(
                "score_strategy",
                self.configs[table_id].score_strategy,
                f"table {table_id} does not take scores from set_score (only CUSTOMIZED does)",
            )
        if self.score_check and score < self.custom_scores[table_id]:
            warnings.warn(
                f"table {table_id}: the new score {score} is lower than the previous "
                f"{self.custom_scores[table_id]} (set DYNAMICEMB_CSTM_SCORE_CHECK=0 to silence)",
                stacklevel=2,
            )
        self.custom_scores[table_id] = int(score)

    # ----------------------------------------------------------------------------- ops
    def find(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        *,
        update_scores: bool = False,
        counts: torch.Tensor | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """``(N,)`` int64 slot of each key or -1; with ``update_scores``, found keys are touched
        (a forward: STEP tables advance one step). ``check=False`` skips the data checks of a
        CUDA batch (:func:`demb_kernels.table.find`) for callers that made them."""
        args = self._score_args() if update_scores else None
        counts = counts if update_scores else None
        return ops.find(self.index, keys, table_ids, args, counts, check=check)

    def find_rows(
        self, keys: torch.Tensor, table_ids: torch.Tensor, dim: int, *, check: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(N, dim)`` float32 first ``dim`` value columns of ``(N,)`` int64 ``keys`` of
        tables ``table_ids`` (zeros for a missing key), and their ``(N,)`` int64 slots (-1 for
        a missing key): :meth:`find` (no score touched) and the read in one pass
        (:func:`demb_kernels.table.find_rows`); ``check`` as :meth:`find`."""
        return ops.find_rows(self.index, self.values, keys, table_ids, dim, check=check)

    def find_batch_rows(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        feature_tables: torch.Tensor,
        batch_size: int,
        dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`find_rows` of a TBE-layout batch, each index's table its feature's, after
        the batch's checks (:func:`demb_kernels.table.find_batch_rows`: on CUDA the host
        waits for the checks only, not for the lookup)."""
        return ops.find_batch_rows(
            self.index, self.values, indices, offsets, feature_tables, batch_size, dim
        )

    def find_or_insert(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        *,
        counts: torch.Tensor | None = None,
        return_evicted: bool = False,
        zero_new_rows: bool = True,
        check: bool = True,
        count_failures: bool = True,
        score_args: torch.Tensor | None = None,
        gather_rows: tuple[torch.Tensor, int] | None = None,
        skips: bool = False,
    ) -> InsertOutcome:
        """Find each key or insert it (a forward: STEP tables advance one step).

        Tables grow first if the batch could take them above their load factor. New rows
        (INSERTED or EVICTED slots) are zeroed unless ``zero_new_rows=False`` (a caller that
        writes every column of them itself). Keys that cannot be inserted get slot -1 and are
        handled per the table's safe-check mode.

        Args:
            keys: ``(N,)`` int64 keys.
            table_ids: ``(N,)`` int64 table of each key.
            counts: ``(N,)`` int64 per-key frequencies for LFU scores (default 1 each).
            return_evicted: also return the evicted keys, scores and rows.
            zero_new_rows: zero the rows of new keys.
            check: check a CUDA batch's data (table ids in range, no empty key, counts >= 0;
                one sync); callers that checked it pass False.
            count_failures: count FAILED keys per table into :attr:`failed_inserts` and apply
                the safe-check modes; a caller that counts them itself passes False and
                reports them with :meth:`record_failures`.
            score_args: ``(T,)`` int64 the batch scores from :meth:`next_score_args`, made
                ahead (default: made here). STEP tables advance one step either way.
            gather_rows: ``(inverse, dim)``: when every key is found, also read the first
                ``dim`` columns of each occurrence's row into :attr:`InsertOutcome.rows`
                (``inverse``: ``(N_occ,)`` int64 position in ``keys`` of each occurrence; values
                on the index's device). On CUDA the read is queued before the host learns that
                every key was found.
            skips: the batch (unchecked, ``check=False``) has entries of the empty key, -1,
                that stand for no key: each is left alone (slot -1, status HIT: nothing to
                initialize, no failure), and on CUDA the op does not wait to learn whether every
                key was found (no sync: a batch with entries left out is expected to miss).

        Raises:
            InsertFailedError: keys failed in a table whose safe-check mode is ERROR.
        """
        keys, table_ids = ops.as_batch(self.index, keys, table_ids)
        self.grow_for(keys, table_ids)
        if score_args is None:
            args = self._score_args()
        else:
            args = checked_scores(score_args, self.num_tables, self.device)
            self.steps = [s + 1 for s in self.steps]
        gather = None if gather_rows is None else ops.RowGather(self.values, *gather_rows)
        self.rank_victims(args)
        result, all_hit, rows = ops.find_or_insert_rows(
            self.index, keys, table_ids, args, counts, gather=gather, check=check, wait=not skips
        )
        slots, status = result.slots, result.status
        if skips:  # the kernels leave an empty-key entry FAILED: here it is no key at all
            status = torch.where(keys == EMPTY_KEY, int(InsertStatus.HIT), status)
        evicted = evicted_rows(self.values, result, table_ids) if return_evicted else None
        if all_hit:  # no row is new, none failed: nothing below has work
            return InsertOutcome(slots, status, evicted, all_hit=True, rows=rows)
        self.record_evictions(table_ids, status, result.victim_keys)
        slots, status = retry_no_eviction(self, keys, table_ids, counts, args, slots, status)
        self.outcomes.add(table_ids, status)
        if zero_new_rows:
            zero_inserted_rows(self.values, table_ids, slots, status)
        if count_failures:
            self._safe_check(table_ids, status)
        return InsertOutcome(slots, status, evicted)

    def rank_victims(self, score_args: torch.Tensor) -> None:
        """Before an op that may evict: the victim ranks of the tables with a
        ``score_function`` (:class:`~demb_storage.score_function.VictimRanker`), each slot's
        score given ``cur_timestamp = score_args[t]`` (``(T,)`` int64 on the index device; on
        CUDA no sync). Nothing when no table has one. This table's inserts call it; a caller
        running the :mod:`demb_kernels.table` inserts on :attr:`index` itself calls it first."""
        if self._ranker is not None:
            self._ranker.refresh(self.index, score_args)

    def next_score_args(self) -> torch.Tensor:
        """``(T,)`` int64 on the index device: the batch score per table that the next
        :meth:`find_or_insert` gives its keys (STEP: the next step; clock policies: the clock
        now; CUSTOMIZED: the set score), advancing nothing. A caller makes it ahead of work it
        waits for and passes it as that call's ``score_args``."""
        return self._score_args_at([s + 1 for s in self.steps])

    def insert_or_assign(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        scores: torch.Tensor,
        values: Sequence[torch.Tensor | None] | None = None,
    ) -> InsertOutcome:
        """Insert keys or overwrite them, with given scores and optionally rows (loading).
        A table with a ``score_function`` ranks its victims at the clock's reading now.

        Args:
            keys: ``(N,)`` int64 keys.
            table_ids: ``(N,)`` int64 table of each key.
            scores: ``(W, N)`` int64 index score words.
            values: per table, ``(N_t, width_t)`` rows of that table's keys in batch order, or
                None.
        """
        keys, table_ids = ops.as_batch(self.index, keys, table_ids)
        self.grow_for(keys, table_ids)
        if self._ranker is not None:
            self.rank_victims(self.next_score_args())
        result = ops.insert_or_assign(self.index, keys, table_ids, scores)
        self.record_evictions(table_ids, result.status, result.victim_keys)
        self.outcomes.add(table_ids, result.status)
        self._safe_check(table_ids, result.status)
        for t, rows in enumerate(values or []):
            if rows is None:
                continue
            mine = (table_ids == t).nonzero().squeeze(1)
            self.write(t, result.slots[mine], rows)
        return InsertOutcome(result.slots, result.status, None)

    def erase(
        self,
        keys: torch.Tensor,
        table_ids: torch.Tensor,
        *,
        record: bool = False,
        check: bool = True,
    ) -> torch.Tensor:
        """Remove keys; ``(N,)`` int64 the freed slot of each erased key, else -1. With
        ``record``, the keys removed are kept in :attr:`erased_keys`. ``check``: as
        :meth:`find`."""
        freed = ops.erase(self.index, keys, table_ids, check=check)
        if record:
            keys, table_ids = ops.as_batch(self.index, keys, table_ids)
            self.erased_keys.add(torch.where(freed >= 0, keys, -1), table_ids, freed)
        return freed

    def record_evictions(
        self, table_ids: torch.Tensor, status: torch.Tensor, victims: torch.Tensor
    ) -> None:
        """Keep the keys an insert evicted (``victims[i]`` where ``status[i]`` is EVICTED) of
        the tables that retain evictions; nothing when none does. No sync."""
        if self._retains is None:
            return
        kept = (status == InsertStatus.EVICTED) & self._retains[table_ids]
        self.evicted_keys.add(torch.where(kept, victims, -1), table_ids)

    def current_scores(self) -> list[int]:
        """Per table, the score the next batch gives its keys, for incremental dumps (STEP: the
        next step; CUSTOMIZED: the set score; clock policies: a reading later than every key
        scored so far and not later than the next batch's, the clock having moved past every
        earlier reading first; LFU: 0, it has no batch score). One sync."""
        policies = self.index.policy_list
        clock = 0
        if any(p in TIME_POLICIES for p in policies):
            clock = settled_clock(self._now, self._clock is None)
        out = []
        for t, p in enumerate(policies):
            if p in TIME_POLICIES:
                out.append(clock)
            elif p is ScorePolicy.STEP:
                out.append(self.steps[t] + 1)
            elif p is ScorePolicy.CUSTOMIZED:
                out.append(self.custom_scores[t])
            else:
                out.append(0)
        return out

    def read(self, table_id: int, slots: torch.Tensor) -> torch.Tensor:
        """``(n, width)`` rows of table ``table_id`` at ``slots``; rows of slot -1 are zeros."""
        buf = self.values[self._table(table_id)]
        return gather_rows(buf, slots.to(buf.device))

    def write(self, table_id: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``rows`` ``(n, width)`` at ``slots`` of table ``table_id``; slot -1 is skipped.
        Rows are converted to the table's dtype."""
        buf = self.values[self._table(table_id)]
        if rows.shape != (slots.shape[0], buf.shape[1]):
            raise TableConfigError(
                "rows", tuple(rows.shape), f"expected ({slots.shape[0]}, {buf.shape[1]})"
            )
        scatter_rows(buf, slots.to(buf.device), rows.to(buf.device, buf.dtype).contiguous())

    def export(
        self,
        table_id: int,
        begin: int = 0,
        end: int | None = None,
        min_score: int | None = None,
        *,
        split: int | None = None,
    ) -> TableExport:
        """Keys, scores (user column order), slots and rows of table ``table_id`` in the slot
        range ``[begin, end)``; ``min_score`` filters on the first score column (for a compound
        strategy, its timestamp: what was touched since); ``split``: the rows as two
        contiguous column ranges (see :func:`export_table`)."""
        layout = self.configs[self._table(table_id)].score_layout
        values = self.values[table_id]
        return export_table(
            self.index, layout, values, table_id, begin, end, min_score, split=split
        )

    def export_many(
        self, table_ids: Sequence[int], min_scores: Sequence[int | None]
    ) -> list[TableExport]:
        """:meth:`export` of whole tables ``table_ids`` (``min_scores[i]`` for table
        ``table_ids[i]``), scanned together (:func:`export_tables`): per table, its export."""
        ids = [self._table(t) for t in table_ids]
        layouts = [self.configs[t].score_layout for t in ids]
        values = [self.values[t] for t in ids]
        return export_tables(self.index, layouts, values, ids, min_scores)

    def clear(self, table_id: int | None = None) -> None:
        """Empty one table or all; rows are zeroed (recorded evicted / erased keys stay)."""
        ops.clear(self.index, table_id)
        for t in range(self.num_tables) if table_id is None else [table_id]:
            self.values[t].zero_()

    def expand(self, table_id: int, new_capacity: int | None = None) -> bool:
        """Grow table ``table_id`` (default: double it); values move with their keys.

        Returns:
            False (with a warning) when the new rows cannot be allocated or the keys do not fit;
            the table is then unchanged.
        """
        old_cap = self.capacity(table_id)  # checks table_id
        cap = 2 * old_cap if new_capacity is None else new_capacity
        config = self.configs[table_id]
        try:
            buf = allocate_values(cap, config, self.value_device, self.device)
            new_index, old_slots, new_slots = ops.rehash(self.index, table_id, cap)
        except (torch.OutOfMemoryError, RuntimeError, ValueError) as err:
            warnings.warn(
                f"table {table_id}: could not grow from {old_cap} to {cap} slots ({err}); "
                "it keeps its capacity",
                stacklevel=2,
            )
            self._can_grow[table_id] = False
            self._refresh_growth()
            return False
        move_rows(self.values[table_id], buf, old_slots, new_slots)
        self.index = new_index
        self._refresh_growth()
        self.values[table_id] = buf
        return True

    # ----------------------------------------------------------------------------- internals
    def _score_args(self) -> torch.Tensor:
        """``(T,)`` int64 batch score per table; advances the steps (one forward)."""
        self.steps = [s + 1 for s in self.steps]
        return self._score_args_at(self.steps)

    def _score_args_at(self, steps: list[int]) -> torch.Tensor:
        """``(T,)`` int64 batch score per table at ``steps``."""
        return batch_scores(
            self.index.policy_list, steps, self.custom_scores, self._now, self.device
        )

    def _now(self, count: int) -> torch.Tensor:
        """``(count,)`` int64 contiguous copies of the clock's reading, on the index device."""
        if self._clock is None:
            return ops.timestamp(self._like, count)
        return self._clock().to(self.device).expand(count).contiguous()

    def _refresh_growth(self) -> None:
        self._any_growable = any(self._growable(t) for t in range(self.num_tables))

    def _growable(self, t: int) -> bool:
        if not self._can_grow[t]:
            return False
        no_eviction = self.index.policy_list[t] is ScorePolicy.NO_EVICTION
        return no_eviction or self.index.capacities[t] < self.configs[t].max_capacity

    def grow_for(self, keys: torch.Tensor, table_ids: torch.Tensor, *, check: bool = True) -> None:
        """Double the tables the ``(N,)`` int64 ``keys`` of ``table_ids``, where missing, could
        take above their load factor (what find_or_insert and insert_or_assign do first; a
        caller inserting through the index itself calls it before). One sync while a table
        can grow (``check``: as :meth:`find`, one more on CUDA)."""
        if not self._any_growable:
            return
        growable = [t for t in range(self.num_tables) if self._growable(t)]
        if not growable or keys.numel() == 0:
            return
        missing = (ops.find(self.index, keys, table_ids, check=check) < 0) & (keys != EMPTY_KEY)
        per_table = per_table_counts(table_ids, self.num_tables, missing)
        needed = (per_table.to(self.index.sizes.device) + self.index.sizes).tolist()
        for t in growable:
            limit = self.configs[t].load_factor_limit
            while needed[t] > limit * self.capacity(t) and self._growable(t):
                target = 2 * self.capacity(t)
                if self.index.policy_list[t] is not ScorePolicy.NO_EVICTION:
                    target = min(target, self.configs[t].max_capacity)
                if not self.expand(t, target):
                    break

    def _safe_check(self, table_ids: torch.Tensor, status: torch.Tensor) -> None:
        self.record_failures(count_failed(table_ids, status, self.num_tables), int(status.numel()))

    def record_failures(self, per_table: torch.Tensor, batch_size: int) -> None:
        """Account the failed inserts of a ``find_or_insert(count_failures=False)`` batch that
        the caller counted per table, as that call would have: ``(T,)`` int64 counts on the
        index device, added to :attr:`failed_inserts` there (no sync: IGNORE tables pay nothing
        more), then read back to raise / warn per the tables' safe-check modes."""
        self.failed_inserts += per_table
        if self._checks_failures:
            raise_or_warn(self.configs, per_table.tolist(), batch_size)
