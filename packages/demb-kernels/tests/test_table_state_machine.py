"""The hash-table ops (CPU kernels) against the pure-Python model, driven by a state machine.

Every rule runs one op on a fused ``TableIndex`` of 1-3 small tables and on
:class:`demb_kernels.table_reference.TableModel`, and checks that the outputs agree. After every
step each table's export (keys, slots, scores) and the sizes agree, and the kernel side alone
keeps the promises of ``docs/hash_table.md``: no key disappears except by a reported eviction, an
erase or a clear; every eviction is reported once, with the victim's scores; every key that did
not fail sits at its returned slot. One machine per policy: table 0 has that policy, the other
tables draw theirs. Keys come from a small range so that buckets overflow and evict.
"""

from __future__ import annotations

import pytest
import torch
from demb_kernels.table import (
    InsertStatus,
    ScorePolicy,
    TableIndex,
    clear,
    erase,
    export,
    find,
    find_or_insert,
    insert_or_assign,
    rehash,
)
from demb_kernels.table_reference import (
    CUSTOMIZED,
    EVICTED,
    FAILED,
    POLICIES,
    SCORE_MAX,
    TIMESTAMP_LFU,
    TableModel,
)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

INT64_MIN = -(2**63)
MAX_TABLES = 3
MAX_REHASH_CAPACITY = 64
SHAPES = [(16, 16), (32, 16), (48, 16), (64, 16), (32, 32), (64, 32)]  # (capacity, width)

# Keys in [-50, 200) without -1; -1 itself stands for the largest key and -50 for the smallest.
# Half of them come from [0, 48) so that batches hit and buckets overflow often.
KEYS = st.integers(0, 47) | st.integers(-50, 199).map(
    lambda k: {-1: SCORE_MAX, -50: INT64_MIN}.get(k, k)
)
COUNTS = st.integers(0, 40).map(lambda c: 2**62 if c == 40 else c % 4)
WORDS = st.integers(-10, 30).map(lambda s: {30: SCORE_MAX, -10: INT64_MIN}.get(s, s))
ITEM = st.tuples(KEYS, st.integers(0, MAX_TABLES - 1), COUNTS, WORDS, WORDS)
BATCH = st.lists(ITEM, max_size=40)
CUSTOM_ARGS = st.lists(st.integers(-20, 20), min_size=MAX_TABLES, max_size=MAX_TABLES)
ERRORS = (ValueError, RuntimeError, IndexError, TypeError)

State = dict[tuple[int, int], tuple[int, tuple[int, ...]]]


def i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).reshape(len(values))


class TableMachine(RuleBasedStateMachine):
    """Kernel index and model side by side; table 0 has ``policy``."""

    def __init__(self, policy: int) -> None:
        super().__init__()
        self.policy = policy
        self.index: TableIndex | None = None
        self.model: TableModel | None = None
        self.clock: list[int] = []

    # ------------------------------------------------------------------ helpers

    @property
    def num_tables(self) -> int:
        return self.model.num_tables

    def split(self, items):
        keys = [k for k, _, _, _, _ in items]
        tids = [t % self.num_tables for _, t, _, _, _ in items]
        counts = [c for _, _, c, _, _ in items]
        return keys, tids, counts

    def score_args(self, custom) -> list[int]:
        return [
            custom[t] if p == CUSTOMIZED else self.clock[t]
            for t, p in enumerate(self.model.policies)
        ]

    def kernel_state(self) -> State:
        state: State = {}
        for t in range(self.num_tables):
            ex = export(self.index, t)
            for key, slot, words in zip(
                ex.keys.tolist(), ex.slots.tolist(), ex.scores.T.tolist(), strict=True
            ):
                assert (t, key) not in state, f"key {key} twice in table {t}"
                state[t, key] = (slot, tuple(words))
        return state

    def check_insert(self, res, expected, keys, tids, before: State, *, assign: bool) -> None:
        got = (
            res.slots.tolist(),
            res.status.tolist(),
            res.victim_keys.tolist(),
            res.victim_scores.T.tolist(),
        )
        names = ("slots", "status", "victim_keys", "victim_scores")
        for name, g, e in zip(names, got, expected, strict=True):
            assert g == e, f"{name}: kernel {g} != model {e} (keys {keys}, tables {tids})"
        slots, status, victim_keys, victim_scores = got
        after = self.kernel_state()
        victims = []
        for t, v, s, words in zip(tids, victim_keys, status, victim_scores, strict=True):
            if s != EVICTED:
                continue
            victims.append((t, v))
            assert (t, v) in before, f"victim {v} of table {t} was not in the table"
            assert tuple(words) == before[t, v][1], f"victim {v}: wrong scores"
        assert len(set(victims)) == len(victims), f"an eviction reported twice: {victims}"
        vanished = set(before) - set(after)
        assert vanished <= set(victims), f"keys vanished unreported: {vanished - set(victims)}"
        # A victim may only be back when insert_or_assign re-inserted it as a later batch key.
        back = set(victims) - vanished
        assert not back or assign, f"victims still there: {back}"
        assert back <= set(zip(tids, keys, strict=True)), f"victims still there: {back}"
        for key, t, slot, s in zip(keys, tids, slots, status, strict=True):
            if s != FAILED:
                assert after[t, key][0] == slot, f"key {key} is not at its slot {slot}"

    # ------------------------------------------------------------------ rules

    @initialize(
        first=st.sampled_from(SHAPES),
        others=st.lists(
            st.tuples(st.sampled_from(POLICIES), st.sampled_from(SHAPES)),
            max_size=MAX_TABLES - 1,
        ),
    )
    def create(self, first, others) -> None:
        shapes = [first] + [shape for _, shape in others]
        policies = [self.policy] + [p for p, _ in others]
        capacities = [c for c, _ in shapes]
        widths = [w for _, w in shapes]
        words = 2 if TIMESTAMP_LFU in policies else 1
        self.index = TableIndex.create(
            capacities=capacities,
            bucket_widths=widths,
            policies=[ScorePolicy(p) for p in policies],
            device="cpu",
        )
        self.model = TableModel(capacities, widths, policies, words)
        self.clock = [1] * len(policies)
        assert self.index.score_words == words
        assert self.index.num_tables == len(policies)

    @precondition(lambda self: self.model is not None)
    @rule(deltas=st.lists(st.integers(0, 3), min_size=MAX_TABLES, max_size=MAX_TABLES))
    def tick(self, deltas) -> None:
        """Timestamps and steps move on (by 0 too, so that scores tie)."""
        self.clock = [c + d for c, d in zip(self.clock, deltas, strict=False)]

    @precondition(lambda self: self.model is not None)
    @rule(items=BATCH, use_counts=st.booleans(), custom=CUSTOM_ARGS)
    def find_or_insert(self, items, use_counts, custom) -> None:
        keys, tids, counts = self.split(items)
        args = self.score_args(custom)
        cs = counts if use_counts else None
        before = self.kernel_state()
        res = find_or_insert(
            self.index, i64(keys), i64(tids), i64(args), None if cs is None else i64(cs)
        )
        expected = self.model.find_or_insert(keys, tids, args, cs)
        self.check_insert(res, expected, keys, tids, before, assign=False)

    @precondition(lambda self: self.model is not None)
    @rule(
        keys=st.lists(st.integers(-50, 199).filter(lambda k: k != -1), min_size=16, max_size=80),
        table=st.integers(0, MAX_TABLES - 1),
        custom=CUSTOM_ARGS,
    )
    def fill(self, keys, table, custom) -> None:
        """A large batch into one table: full buckets, evictions and failed inserts."""
        t = table % self.num_tables
        items = [(k, t, 1, 0, 0) for k in keys]
        self.find_or_insert(items, use_counts=False, custom=custom)

    @precondition(lambda self: self.model is not None)
    @rule(items=BATCH)
    def insert_or_assign(self, items) -> None:
        keys, tids, _ = self.split(items)
        w = self.model.score_words
        rows = []
        for (_, _, _, w0, w1), t in zip(items, tids, strict=True):
            # Word 1 of a single-word policy is left at 0 (see the model's docstring).
            second = w1 if self.model.policies[t] == TIMESTAMP_LFU else 0
            rows.append([w0, second][:w])
        scores = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), w).T.contiguous()
        before = self.kernel_state()
        res = insert_or_assign(self.index, i64(keys), i64(tids), scores)
        expected = self.model.insert_or_assign(keys, tids, rows)
        self.check_insert(res, expected, keys, tids, before, assign=True)

    @precondition(lambda self: self.model is not None)
    @rule(items=BATCH, update=st.booleans(), use_counts=st.booleans(), custom=CUSTOM_ARGS)
    def lookup(self, items, update, use_counts, custom) -> None:
        keys, tids, counts = self.split(items)
        args = self.score_args(custom) if update else None
        cs = counts if use_counts else None
        before = self.kernel_state()
        got = find(
            self.index,
            i64(keys),
            i64(tids),
            None if args is None else i64(args),
            None if cs is None else i64(cs),
        ).tolist()
        expected = self.model.lookup(keys, tids, args, cs)
        assert got == expected, f"lookup: kernel {got} != model {expected}"
        after = self.kernel_state()
        assert {k: s for k, (s, _) in before.items()} == {k: s for k, (s, _) in after.items()}
        if args is None:
            assert before == after

    @precondition(lambda self: self.model is not None)
    @rule(items=BATCH)
    def erase(self, items) -> None:
        keys, tids, _ = self.split(items)
        before = self.kernel_state()
        got = erase(self.index, i64(keys), i64(tids)).tolist()
        expected = self.model.erase(keys, tids)
        assert got == expected, f"erase: kernel {got} != model {expected}"
        after = self.kernel_state()
        erased = {(t, k) for k, t, s in zip(keys, tids, got, strict=True) if s >= 0}
        assert set(before) - set(after) == erased
        assert set(after) <= set(before)

    @precondition(lambda self: self.model is not None)
    @rule(
        table=st.integers(0, MAX_TABLES - 1),
        bounds=st.tuples(st.integers(0, 300), st.integers(0, 300)),
        min_score=st.none() | st.integers(-10, 30),
        score_word=st.integers(0, 1),
        full_end=st.booleans(),
    )
    def export_range(self, table, bounds, min_score, score_word, full_end) -> None:
        t = table % self.num_tables
        capacity = self.model.capacities[t]
        begin, end = sorted(min(b, capacity) for b in bounds)
        stop = None if full_end else end
        word = score_word % self.model.score_words
        ex = export(self.index, t, begin=begin, end=stop, min_score=min_score, score_word=word)
        got = (ex.keys.tolist(), ex.scores.T.tolist(), ex.slots.tolist())
        expected = self.model.export(t, begin, stop, min_score, word)
        assert got == expected, f"export: kernel {got} != model {expected}"

    @precondition(lambda self: self.model is not None)
    @rule(table=st.integers(0, MAX_TABLES - 1))
    def rehash_double(self, table) -> None:
        t = table % self.num_tables
        capacity = self.model.capacities[t]
        if capacity > MAX_REHASH_CAPACITY:
            return
        before = self.kernel_state()
        new_index, old_slots, new_slots = rehash(self.index, t, 2 * capacity)
        got = (old_slots.tolist(), new_slots.tolist())
        expected = self.model.rehash(t, 2 * capacity)
        assert got == expected, f"rehash: kernel {got} != model {expected}"
        assert all(s >= 0 for s in got[1])
        self.index = new_index
        assert tuple(self.index.capacities) == self.model.capacities
        after = self.kernel_state()
        assert {k: w for k, (_, w) in before.items()} == {k: w for k, (_, w) in after.items()}
        for key, (slot, _) in before.items():
            if key[0] != t:
                assert after[key][0] == slot

    @precondition(lambda self: self.model is not None)
    @rule(table=st.none() | st.integers(0, MAX_TABLES - 1))
    def clear_table(self, table) -> None:
        t = None if table is None else table % self.num_tables
        before = self.kernel_state()
        clear(self.index, t)
        self.model.clear(t)
        after = self.kernel_state()
        assert after == {k: v for k, v in before.items() if t is not None and k[0] != t}

    @precondition(lambda self: self.model is not None)
    @rule(
        items=st.lists(ITEM, min_size=1, max_size=10),
        where=st.integers(0, 9),
        kind=st.sampled_from(["empty_key", "table_id", "count"]),
    )
    def invalid_batch(self, items, where, kind) -> None:
        """An invalid batch raises; the tables must be left as they were (checked after)."""
        keys, tids, counts = self.split(items)
        i = where % len(keys)
        if kind == "empty_key":
            keys[i] = -1
        elif kind == "table_id":
            tids[i] = self.num_tables
        else:
            counts[i] = -1
        args = self.score_args([0] * MAX_TABLES)
        with pytest.raises(ERRORS):
            find_or_insert(self.index, i64(keys), i64(tids), i64(args), i64(counts))

    # ------------------------------------------------------------------ invariants

    @invariant()
    def tables_agree(self) -> None:
        if self.model is None:
            return
        sizes = self.index.sizes.tolist()
        assert sizes == self.model.sizes(), f"sizes: kernel {sizes} != model {self.model.sizes()}"
        for t in range(self.num_tables):
            ex = export(self.index, t)
            got = (ex.keys.tolist(), ex.scores.T.tolist(), ex.slots.tolist())
            expected = self.model.export(t)
            assert got == expected, f"table {t}: kernel {got} != model {expected}"
            assert len(got[0]) == sizes[t]


@pytest.mark.parametrize("policy", POLICIES)
def test_table_ops_match_the_model(policy):
    assert int(ScorePolicy(policy)) == policy
    assert int(InsertStatus.EVICTED) == EVICTED
    run_state_machine_as_test(
        lambda: TableMachine(policy),
        settings=settings(max_examples=40, stateful_step_count=30, deadline=None),
    )
