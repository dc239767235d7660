"""Admission in the table module: which missing keys of a training forward enter their tables.

Tables whose options set ``admit_strategy`` are grouped on the strategies'
``get_grouped_key()``; each group gets one admitter (``create_admitter``) over its tables, with
module-local table ids ``0..G-1`` in the group's order. A training forward finds its unique keys
first (no score touched), asks each group's admitter about its missing keys with their batch
frequencies, and inserts only the others: a rejected key keeps slot -1 (its gradient reaches no
row) and reads the row its strategy's ``initializer_args`` give it (None: the table's
initializer, the row the key would have got had it been admitted). Eval forwards never admit
(they insert nothing).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from demb_kernels.init_rows import init_new_rows, new_rows_args
from demb_kernels.table import InsertStatus
from demb_storage import (
    AdmissionConfigError,
    AdmissionStrategy,
    Counter,
    InitializerArgs,
    MultiTableAdmitter,
    MultiTableFrequencyAdmitter,
    MultiTableKVCounter,
    MultiTableProbabilisticAdmitter,
    new_rows_spec,
    per_table_counts,
)

from demb_torchrec.errors import ConfigError, NotSupportedError

__all__ = ["AdmissionGroup", "ModuleAdmission", "admission_of"]

_REWINDABLE = (MultiTableFrequencyAdmitter, MultiTableProbabilisticAdmitter)


@dataclass
class AdmissionGroup:
    """Tables that share one admitter."""

    admitter: MultiTableAdmitter
    tables: list[int]
    """The module's table ids of the group, in its local order (local id = position)."""
    local: torch.Tensor
    """``(T,)`` int64 on the module's device: each module table's local id (-1: not here)."""
    whole: bool
    """The group holds every table of the module in order (local id = table id)."""


class ModuleAdmission:
    """The admitters of one table module and what they decided since the last read.

    Args:
        strategies: per table, its ``admit_strategy`` or None (admits everything).
        names: the table names (for errors).
        init_args: per table, its completed ``initializer_args`` (for rejected keys whose
            strategy gives no initializer).
        max_capacities: per table, the ``num_embeddings`` a strategy's UNIFORM bounds complete
            from.
        dims: per table, its embedding dim; seeds: its initializer seed.
        device: the module's device.
    """

    def __init__(
        self,
        strategies: Sequence[AdmissionStrategy | None],
        names: Sequence[str],
        init_args: Sequence[InitializerArgs],
        max_capacities: Sequence[int],
        dims: Sequence[int],
        seeds: Sequence[int],
        device: torch.device,
    ) -> None:
        num_tables = len(strategies)
        grouped: dict[object, list[int]] = {}
        for t, s in enumerate(strategies):
            if s is None:
                continue
            if not isinstance(s, AdmissionStrategy):
                raise ConfigError(
                    f"table {names[t]!r}: DynamicEmbTableOptions.admit_strategy={s!r}: must be "
                    "an AdmissionStrategy (FrequencyAdmissionStrategy, "
                    "ProbabilisticAdmissionStrategy or a subclass)"
                )
            grouped.setdefault((type(s), s.get_grouped_key()), []).append(t)
        self.groups: list[AdmissionGroup] = []
        self.fill_args: list[InitializerArgs] = list(init_args)
        """Per table, what a rejected key's row reads."""
        for tables in grouped.values():
            configs = [s for s in (strategies[t] for t in tables) if s is not None]
            cls = type(configs[0])
            try:
                admitter = cls.create_admitter(configs, device)
            except ValueError as e:
                raise ConfigError(
                    f"tables {[names[t] for t in tables]}: admit_strategy: {e}"
                ) from e
            local = torch.full((num_tables,), -1, dtype=torch.int64)
            local[tables] = torch.arange(len(tables))
            whole = tables == list(range(num_tables))
            self.groups.append(AdmissionGroup(admitter, tables, local.to(device), whole))
            own = admitter.non_admitted_initializer
            if own is not None:
                if not isinstance(own, InitializerArgs):
                    raise NotSupportedError(
                        "non_admitted_initializer",
                        f"{own!r}: demb takes an InitializerArgs (DynamicEmbInitializerArgs)",
                        table=names[tables[0]],
                    )
                for t in tables:
                    self.fill_args[t] = own.complete(max_capacities[t])
        self.num_tables = num_tables
        self.device = device
        self._fill_rows = new_rows_args(
            list(dims),
            [new_rows_spec(a, seed) for a, seed in zip(self.fill_args, seeds, strict=True)],
            [None] * num_tables,
        )
        """What :meth:`fill_rejected` writes: per table its fill initializer, no state."""
        self._decisions = torch.zeros((num_tables, 2), dtype=torch.int64, device=device)
        """``(T, 2)`` keys admitted and rejected per table since the last read."""
        self._counter_evictions = torch.zeros(num_tables, dtype=torch.int64)
        self.rewindable = all(type(g.admitter) in _REWINDABLE for g in self.groups)
        """Every admitter is a built-in one that a call asking no key changes in nothing but
        its toss index, which :meth:`mark` and :meth:`rewind` restore: a forward may ask it
        before learning whether its batch is good (the one-sync CUDA path)."""
        self._tossers = [
            g.admitter
            for g in self.groups
            if isinstance(g.admitter, MultiTableProbabilisticAdmitter)
        ]
        """The probabilistic admitters, whose toss index :meth:`mark` reads."""

    def mark(self) -> list[int]:
        """The probabilistic admitters' toss indices, for :meth:`rewind`."""
        return [admitter.calls for admitter in self._tossers]

    def rewind(self, mark: list[int]) -> None:
        """Undo the toss indices' advance since :meth:`mark` (after a call that asked no key:
        nothing else changed)."""
        for admitter, calls in zip(self._tossers, mark, strict=True):
            admitter.calls = calls

    @property
    def counters(self) -> list[tuple[list[int], Counter]]:
        """Each group's persistent state (its tables, its counter), for groups that have one."""
        out = []
        for g in self.groups:
            state = g.admitter.state()
            if state is not None:
                out.append((g.tables, state))
        return out

    def admitter_of(self, table: int) -> MultiTableAdmitter | None:
        """The admitter deciding for table ``table``, or None (no strategy)."""
        for g in self.groups:
            if table in g.tables:
                return g.admitter
        return None

    def counter_of(self, table: int) -> tuple[Counter, int] | None:
        """The counter table ``table`` accumulates into and its id there, or None (no
        strategy, or one that keeps no state)."""
        for g in self.groups:
            if table in g.tables:
                state = g.admitter.state()
                return None if state is None else (state, g.tables.index(table))
        return None

    def rejected(
        self, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor, missing: torch.Tensor
    ) -> torch.Tensor:
        """``(U,)`` bool: the missing keys the admitters reject.

        Args:
            keys: ``(U,)`` int64 a batch's unique keys; tables: their ``(U,)`` int64 tables.
            counts: ``(U,)`` int64 each key's occurrences in the batch.
            missing: ``(U,)`` bool keys not in their tables.
        """
        rejected = torch.zeros_like(missing)
        for g in self.groups:
            if g.whole:  # (the usual case: one strategy for every table)
                asked, local = missing, tables
            else:  # another group's keys are not asked (and name table 0 here)
                local = g.local[tables]
                asked = missing & (local >= 0)
                local = local.clamp_min(0)
            admit = g.admitter.admit_masked(keys, local, counts, asked)
            if admit.dtype != torch.bool or admit.shape != asked.shape:
                raise TypeError(
                    f"{type(g.admitter).__name__}.admit_masked returned {admit.dtype} "
                    f"{tuple(admit.shape)}, expected a bool mask of {tuple(asked.shape)}"
                )
            admit = admit & asked
            out = asked & ~admit
            self._decisions[:, 0] += per_table_counts(tables, self.num_tables, admit)
            self._decisions[:, 1] += per_table_counts(tables, self.num_tables, out)
            rejected |= out
        return rejected

    def fill_rejected(
        self,
        rows: list[torch.Tensor],
        slots: torch.Tensor,
        keys: torch.Tensor,
        tables: torch.Tensor,
        rejected: torch.Tensor,
    ) -> None:
        """Write the rows of rejected keys from their tables' fill initializers, every table in
        one launch (no sync): entry ``i``, where ``rejected[i]``, gets the row of ``keys[i]``
        at ``rows[tables[i]][slots[i]]``.

        Args:
            rows: per table, a contiguous float32 buffer of rows ``(R_t, >= D_t)`` (mutated;
                the same tensor may serve several tables).
            slots: ``(N,)`` int64 each entry's row in its table's buffer.
            keys: ``(N,)`` int64; tables: each entry's ``(N,)`` int64 table.
            rejected: ``(N,)`` bool the entries whose key the admitters rejected.
        """
        status = rejected.to(torch.int64) * int(InsertStatus.INSERTED)  # others: HIT, skipped
        init_new_rows(rows, slots, keys, tables, status, self._fill_rows)

    def read_counts(self, reset: bool = True) -> dict[str, torch.Tensor]:
        """``(T,)`` int64 CPU tensors since the last reset: keys ``admitted`` and ``rejected``
        per table, and ``counter_evictions`` (keys the admission counters evicted); zeroed
        with ``reset``."""
        evicted = self._counter_evictions
        for g in self.groups:
            state = g.admitter.state()
            if isinstance(state, MultiTableKVCounter):
                evicted[g.tables] += state.evicted_since_last_read().cpu()
        decisions = self._decisions.cpu().clone()
        out = {
            "admitted": decisions[:, 0].clone(),
            "rejected": decisions[:, 1].clone(),
            "counter_evictions": evicted.clone(),
        }
        if reset:
            self._decisions.zero_()
            evicted.zero_()
        return out


def admission_of(
    strategies: Sequence[object],
    counters: Sequence[object],
    names: Sequence[str],
    init_args: Sequence[InitializerArgs],
    max_capacities: Sequence[int],
    dims: Sequence[int],
    seeds: Sequence[int],
    device: torch.device,
) -> ModuleAdmission | None:
    """The module's admission, or None when no table sets ``admit_strategy``. A table whose
    deprecated ``admission_counter`` is set warns (``DeprecationWarning``); the counter is not
    used (the strategy carries it)."""
    for name, counter in zip(names, counters, strict=True):
        if counter is not None:
            warnings.warn(
                f"table {name!r}: DynamicEmbTableOptions.admission_counter is deprecated and "
                "not used; pass the counter to the strategy "
                "(FrequencyAdmissionStrategy(threshold, counter=KVCounter(...)))",
                DeprecationWarning,
                stacklevel=3,
            )
    if all(s is None for s in strategies):
        return None
    for name, strategy in zip(names, strategies, strict=True):
        if isinstance(strategy, AdmissionStrategy):
            try:
                strategy.check()
            except AdmissionConfigError as err:  # named: the table and the option
                raise err.for_table(name) from None
    return ModuleAdmission(
        strategies,  # type: ignore[arg-type]
        names,
        init_args,
        max_capacities,
        dims,
        seeds,
        device,
    )
