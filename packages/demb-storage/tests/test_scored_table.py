"""ScoredHashTable: score strategies, growth with values, NO_EVICTION, safe-check modes and
bad input, on the CPU (the CUDA twin is in tests/test_table_devices.py)."""

from __future__ import annotations

import warnings
from collections import Counter

import demb_planner
import pytest
import torch
from demb_kernels.table import InsertStatus, ScorePolicy
from demb_storage import (
    InsertFailedError,
    SafeCheckMode,
    ScoredHashTable,
    ScoreStrategy,
    TableConfig,
    TableConfigError,
    export_table,
    export_tables,
    resolve_score_strategy,
)
from hypothesis import given, settings
from hypothesis import strategies as st

S = ScoreStrategy


def one_table(strategy=S.TIMESTAMP, **kw):
    kw.setdefault("max_capacity", 256)
    kw.setdefault("bucket_capacity", 16)
    return ScoredHashTable([TableConfig(dim=4, score_strategy=strategy, **kw)], clock=Clock())


class Clock:
    """A fake device clock: 100, 200, 300, ... one tick per batch."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> torch.Tensor:
        self.now += 100
        return torch.tensor([self.now])


def colliding_keys(n: int, capacity: int, width: int, bucket: int = 0) -> list[int]:
    """``n`` keys whose home bucket is ``bucket`` in a table of ``capacity`` slots."""
    found: list[int] = []
    k = 0
    while len(found) < n:
        block = list(range(k, k + 4096))
        home = demb_planner.home_slots(block, capacity, width)
        found += [key for key, b in zip(block, home.bucket, strict=True) if b == bucket]
        k += 4096
    return found[:n]


def scores_of(table: ScoredHashTable, t: int = 0) -> dict[int, list[int]]:
    ex = table.export(t)
    return dict(zip(ex.keys.tolist(), ex.scores.tolist(), strict=True))


def ids(n: int, t: int = 0) -> torch.Tensor:
    return torch.full((n,), t, dtype=torch.int64)


# --------------------------------------------------------------------------- strategies
@settings(max_examples=30, deadline=None)
@given(batches=st.lists(st.lists(st.integers(0, 40), min_size=1, max_size=30), max_size=6))
def test_lfu_counts_are_exact(batches):
    table = one_table(S.LFU, max_capacity=1024, bucket_capacity=128)
    expected: Counter[int] = Counter()
    for batch in batches:
        keys = torch.tensor(batch)
        counts = torch.tensor([(k % 3) + 1 for k in batch])
        table.find_or_insert(keys, ids(len(batch)), counts=counts)
        for k in batch:
            expected[k] += (k % 3) + 1
    got = {k: s[0] for k, s in scores_of(table).items()}
    assert got == dict(expected)


def test_lfu_lookup_with_update_adds_counts_and_plain_lookup_does_not():
    table = one_table(S.LFU)
    keys = torch.tensor([3, 4, 3])
    table.find_or_insert(keys, ids(3))
    table.find(keys, ids(3))
    assert scores_of(table) == {3: [2], 4: [1]}
    table.find(keys, ids(3), update_scores=True, counts=torch.tensor([5, 1, 2]))
    assert scores_of(table) == {3: [9], 4: [2]}


def test_timestamp_scores_are_monotone_and_come_from_the_clock():
    table = one_table(S.TIMESTAMP)
    table.find_or_insert(torch.tensor([1, 2]), ids(2))
    table.find_or_insert(torch.tensor([2, 3]), ids(2))
    assert scores_of(table) == {1: [100], 2: [200], 3: [200]}


def test_timestamp_default_clock_is_monotone_on_cpu():
    table = ScoredHashTable([TableConfig(dim=2, max_capacity=64, bucket_capacity=16)])
    seen = []
    for k in range(5):
        table.find_or_insert(torch.tensor([k]), ids(1))
        seen.append(scores_of(table)[k][0])
    assert seen == sorted(seen)
    assert len(set(seen)) == 5


def test_step_advances_once_per_forward():
    table = one_table(S.STEP)
    table.find_or_insert(torch.tensor([1, 2]), ids(2))
    table.find_or_insert(torch.tensor([2]), ids(1))
    table.find(torch.tensor([1]), ids(1), update_scores=True)
    table.find(torch.tensor([2]), ids(1))  # no score update: not a forward
    assert scores_of(table) == {1: [3], 2: [2]}
    assert table.steps == [3]


def test_customized_scores_and_the_decrease_warning(monkeypatch):
    table = one_table(S.CUSTOMIZED)
    table.set_score(0, 50)
    table.find_or_insert(torch.tensor([1]), ids(1))
    with pytest.warns(UserWarning, match="lower than the previous 50"):
        table.set_score(0, 10)
    table.find_or_insert(torch.tensor([2]), ids(1))
    assert scores_of(table) == {1: [50], 2: [10]}
    monkeypatch.setenv("DYNAMICEMB_CSTM_SCORE_CHECK", "0")
    quiet = one_table(S.CUSTOMIZED)
    quiet.set_score(0, 50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        quiet.set_score(0, 10)
    with pytest.raises(TableConfigError, match="only CUSTOMIZED"):
        one_table(S.LFU).set_score(0, 3)


@pytest.mark.parametrize("order", [(S.TIMESTAMP, S.LFU), (S.LFU, S.TIMESTAMP)])
def test_compound_evicts_least_frequent_then_oldest_in_either_order(order):
    cap, width = 32, 16
    table = one_table(order, max_capacity=cap, bucket_capacity=width)
    keys = colliding_keys(17, cap, width)
    full, newcomer = keys[:16], keys[16]
    table.find_or_insert(torch.tensor(full[:8]), ids(8))  # t=100, freq 1
    table.find_or_insert(torch.tensor(full[8:]), ids(8))  # t=200, freq 1
    table.find_or_insert(torch.tensor(full[:8] + full[9:]), ids(15))  # t=300: all but full[8]
    # frequencies: full[8] has 1, the others 2; full[8] goes even though it is not the oldest
    out = table.find_or_insert(torch.tensor([newcomer]), ids(1), return_evicted=True)
    assert out.status.tolist() == [InsertStatus.EVICTED]
    assert out.evicted.keys.tolist() == [full[8]]
    got = scores_of(table)[full[0]]
    ts_col = order.index(S.TIMESTAMP)
    assert got[ts_col] == 300
    assert got[1 - ts_col] == 2


@pytest.mark.parametrize("order", [(S.TIMESTAMP, S.LFU), (S.LFU, S.TIMESTAMP)])
def test_compound_frequency_ties_go_to_the_older_timestamp(order):
    cap, width = 32, 16
    table = one_table(order, max_capacity=cap, bucket_capacity=width)
    keys = colliding_keys(18, cap, width)
    table.find_or_insert(torch.tensor(keys[8:16]), ids(8))  # t=100, freq 1
    table.find_or_insert(torch.tensor(keys[:8]), ids(8))  # t=200, freq 1
    for newcomer in keys[16:]:
        out = table.find_or_insert(torch.tensor([newcomer]), ids(1), return_evicted=True)
        assert out.evicted.keys.tolist()[0] in keys[8:16]


def test_one_element_tuple_is_that_strategy_and_bad_tuples_are_named():
    assert resolve_score_strategy((S.LFU,)).policy is ScorePolicy.LFU
    assert resolve_score_strategy((S.LFU, S.TIMESTAMP)).policy is ScorePolicy.TIMESTAMP_LFU
    for bad in [(S.STEP, S.LFU), (S.LFU, S.LFU), "lfu", (S.TIMESTAMP, S.LFU, S.STEP)]:
        with pytest.raises(TableConfigError, match="score_strategy"):
            TableConfig(dim=1, max_capacity=16, bucket_capacity=16, score_strategy=bad)


# --------------------------------------------------------------------------- growth
def test_launched_find_or_insert_refuses_tables_that_may_grow():
    """The one-sync find_or_insert cannot grow a table mid-batch: it raises, naming itself,
    before anything runs (a table at max_capacity may not grow, so may_grow is False)."""
    from demb_kernels.launched import LaunchedDedup
    from demb_storage import find_or_insert_launched

    table = one_table(S.LFU, init_capacity=32, max_capacity=1024)
    assert table.may_grow
    before = table.index.sizes.clone()
    launched = LaunchedDedup(*[torch.tensor([1, 2])] * 9)  # never read: the check comes first
    with pytest.raises(TableConfigError, match="find_or_insert_launched"):
        find_or_insert_launched(table, launched, table.next_score_args())
    assert torch.equal(table.index.sizes, before)
    assert table.steps == [0]
    assert not one_table(S.LFU, max_capacity=1024).may_grow


def test_launched_find_or_insert_needs_counts_where_asked_for_them():
    """A dedup launched without counts (counts=False: a (0,) tensor) cannot feed a find that
    reads them: find_or_insert_launched raises, naming the option, before anything runs; which
    tables read counts at all is ``counts_keys``."""
    from demb_kernels.launched import LaunchedDedup
    from demb_storage import find_or_insert_launched

    table = one_table(S.LFU, max_capacity=1024)
    assert not table.may_grow
    assert table.counts_keys
    assert not one_table(S.STEP).counts_keys
    assert not one_table(S.TIMESTAMP).counts_keys
    assert one_table((S.TIMESTAMP, S.LFU)).counts_keys
    keys = torch.tensor([1, 2])
    flag = torch.zeros((), dtype=torch.bool)
    parts = [keys, keys, keys, torch.zeros(0, dtype=torch.int64), keys, keys, keys, flag, keys[:0]]
    launched = LaunchedDedup(*parts)  # counts (0,): made with counts=False
    before = table.index.sizes.clone()
    with pytest.raises(TableConfigError, match="counts=True: the dedup was launched"):
        find_or_insert_launched(table, launched, table.next_score_args())
    assert torch.equal(table.index.sizes, before)
    assert table.steps == [0]


@pytest.mark.parametrize("move_rows", [1 << 20, 7])
def test_expansion_keeps_every_key_with_its_row_and_scores(monkeypatch, move_rows):
    """Also when the rows move a few at a time (7: many chunks, the last one short)."""
    import demb_storage._table_values as table_values

    monkeypatch.setattr(table_values, "_MOVE_ROWS", move_rows)
    table = one_table(S.LFU, init_capacity=32, max_capacity=1024)
    keys = torch.arange(0, 400)
    for chunk in keys.split(50):
        out = table.find_or_insert(chunk, ids(len(chunk)))
        rows = chunk.to(torch.float32).unsqueeze(1).repeat(1, 4)
        table.write(0, out.slots, rows)
        assert table.capacity(0) == table.values[0].shape[0]  # slots never exceed rows
    assert table.capacity(0) == 1024
    assert table.size(0) == 400
    ex = table.export(0)
    torch.testing.assert_close(ex.values[:, 0], ex.keys.to(torch.float32))
    assert ex.keys.sort().values.tolist() == list(range(400))
    table.find_or_insert(keys, ids(400))  # one more forward: all hits
    assert all(s == [2] for s in scores_of(table).values())


def test_growth_stops_at_max_capacity_then_evicts():
    table = one_table(S.STEP, init_capacity=32, max_capacity=64)
    for chunk in torch.arange(0, 300).split(30):
        table.find_or_insert(chunk, ids(len(chunk)))
    assert table.capacity(0) == 64
    assert table.size(0) <= 64


def test_no_eviction_never_evicts_and_never_loses_a_key():
    table = one_table(S.NO_EVICTION, init_capacity=32, max_capacity=32)
    seen = set()
    for chunk in torch.arange(0, 2000).split(100):
        out = table.find_or_insert(chunk, ids(len(chunk)))
        assert not (out.status == InsertStatus.EVICTED).any()
        assert not (out.status == InsertStatus.FAILED).any()
        seen |= set(chunk.tolist())
        assert set(table.export(0).keys.tolist()) == seen
        assert table.load_factor(0) <= 1.0
    assert table.capacity(0) >= 2048  # grew past max_capacity: memory is the only limit


def test_no_eviction_fills_its_rows_before_doubling():
    """The spec's example: 100 keys of a table of init_capacity=128 fit in 128 value rows
    (a table doubling at load factor 0.5 would hold them in 256)."""
    table = one_table(S.NO_EVICTION, init_capacity=128, max_capacity=128, bucket_capacity=128)
    for chunk in torch.arange(1000, 1100).split(25):
        out = table.find_or_insert(chunk, ids(len(chunk)))
        assert (out.status == InsertStatus.INSERTED).all()
    assert table.size(0) == 100
    assert table.capacity(0) == 128
    assert table.values[0].shape[0] == 128
    # Past its rows it doubles, keys and rows kept.
    rows = table.read(0, table.find(torch.arange(1000, 1100), ids(100)))
    table.find_or_insert(torch.arange(2000, 2040), ids(40))
    assert table.capacity(0) == 256
    assert table.size(0) == 140
    assert torch.equal(table.read(0, table.find(torch.arange(1000, 1100), ids(100))), rows)


def test_no_eviction_doubles_when_a_bucket_fills_below_its_row_count():
    table = one_table(S.NO_EVICTION, init_capacity=32, max_capacity=32)  # 2 buckets of 16
    keys = torch.tensor(colliding_keys(17, 32, 16))  # 17 keys of one bucket: 17 < 32 rows
    out = table.find_or_insert(keys, ids(17))
    assert (out.status == InsertStatus.INSERTED).all()
    assert table.capacity(0) == 64
    assert set(table.export(0).keys.tolist()) == set(keys.tolist())


def test_no_eviction_keeps_training_when_memory_runs_out(monkeypatch):
    import demb_storage.scored_table as scored_table

    table = one_table(S.NO_EVICTION, init_capacity=32, max_capacity=32)
    real = scored_table.allocate_values

    def allocate(rows, config, value_device, index_device):
        if rows > 64:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(rows, config, value_device, index_device)

    monkeypatch.setattr(scored_table, "allocate_values", allocate)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for chunk in torch.arange(0, 200).split(20):
            table.find_or_insert(chunk, ids(len(chunk)))
    assert any("could not grow" in str(w.message) for w in caught)
    assert table.capacity(0) == 64
    keys = table.export(0).keys.tolist()
    assert len(keys) == table.size(0) <= 64
    assert int(table.failed_inserts[0]) == 200 - len(keys)


# --------------------------------------------------------------------------- safe check
def overflow(table: ScoredHashTable) -> torch.Tensor:
    """17 new keys into one 16-slot bucket in one batch: one cannot be inserted."""
    keys = colliding_keys(17, table.capacity(0), 16)
    return torch.tensor(keys)


def test_safe_check_error_raises_with_counts():
    table = one_table(S.STEP, max_capacity=32, safe_check_mode=SafeCheckMode.ERROR)
    with pytest.raises(
        InsertFailedError, match=r"1 of 17 keys could not be inserted \(table 0: 1\)"
    ):
        table.find_or_insert(overflow(table), ids(17))


def test_safe_check_warning_warns_and_rows_read_as_zero():
    table = one_table(S.STEP, max_capacity=32, safe_check_mode=SafeCheckMode.WARNING)
    keys = overflow(table)
    with pytest.warns(UserWarning, match="1 of 17 keys could not be inserted"):
        out = table.find_or_insert(keys, ids(17))
    table.write(0, out.slots, torch.ones(17, 4))
    rows = table.read(0, out.slots)
    failed = out.status == InsertStatus.FAILED
    assert int(failed.sum()) == 1
    assert rows[failed].abs().sum() == 0
    assert rows[~failed].min() == 1
    assert table.failed_inserts.tolist() == [1]


def test_safe_check_ignore_is_silent_but_counted():
    table = one_table(S.STEP, max_capacity=32, safe_check_mode=SafeCheckMode.IGNORE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = table.find_or_insert(overflow(table), ids(17))
        table.find_or_insert(overflow(table)[:1], ids(1))
    assert int((out.status == InsertStatus.FAILED).sum()) == 1
    assert table.failed_inserts.tolist() == [1]


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"max_capacity": 100}, "max_capacity"),
        ({"init_capacity": 24}, "init_capacity"),
        ({"init_capacity": 512}, "init_capacity"),
        ({"bucket_capacity": 24}, "bucket_capacity"),
        ({"dtype": torch.float64}, "dtype"),
        ({"max_load_factor": 0.0}, "max_load_factor"),
        ({"dim": 0}, "dim"),
        ({"state_dim": -1}, "state_dim"),
        ({"safe_check_mode": 7}, "safe_check_mode"),
    ],
)
def test_bad_options_name_the_option(kwargs, option):
    args = {"dim": 4, "max_capacity": 256, "bucket_capacity": 16} | kwargs
    with pytest.raises(TableConfigError, match=option):
        TableConfig(**args)


@pytest.mark.parametrize(
    ("keys", "tids", "error", "match"),
    [
        (torch.tensor([1.0]), torch.tensor([0]), TypeError, "keys must be int64 or int32"),
        (torch.tensor([-1]), torch.tensor([0]), ValueError, "empty-key sentinel"),
        (torch.tensor([5]), torch.tensor([1]), ValueError, "table_ids"),
        (torch.tensor([5]), torch.tensor([-1]), ValueError, "table_ids"),
    ],
)
def test_bad_keys_raise_and_change_nothing(keys, tids, error, match):
    table = one_table(S.LFU)
    table.find_or_insert(torch.tensor([1, 2]), ids(2))
    before = table.export(0)
    with pytest.raises(error, match=match):
        table.find_or_insert(keys, tids)
    after = table.export(0)
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b)


def test_int32_keys_are_accepted():
    table = one_table(S.LFU)
    out = table.find_or_insert(torch.tensor([7, 8], dtype=torch.int32), ids(2).int())
    assert out.status.tolist() == [InsertStatus.INSERTED] * 2
    assert table.find(torch.tensor([7]), ids(1)).tolist() == out.slots[:1].tolist()


def test_write_checks_the_row_shape():
    table = one_table()
    out = table.find_or_insert(torch.tensor([1]), ids(1))
    with pytest.raises(TableConfigError, match="rows"):
        table.write(0, out.slots, torch.ones(1, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_value_dtypes_round_trip(dtype):
    table = ScoredHashTable(
        [TableConfig(dim=3, state_dim=2, max_capacity=64, bucket_capacity=16, dtype=dtype)]
    )
    out = table.find_or_insert(torch.tensor([1, 2, 3]), ids(3))
    rows = torch.arange(15, dtype=torch.float32).reshape(3, 5)
    table.write(0, out.slots, rows)
    assert table.values[0].dtype == dtype
    torch.testing.assert_close(table.read(0, out.slots), rows.to(dtype))


def test_fused_tables_are_independent():
    table = ScoredHashTable(
        [
            TableConfig(dim=2, max_capacity=64, bucket_capacity=16, score_strategy=S.LFU),
            TableConfig(dim=5, max_capacity=32, bucket_capacity=32, score_strategy=S.STEP),
        ],
        clock=Clock(),
    )
    keys = torch.tensor([1, 1, 2, 1])
    tids = torch.tensor([0, 1, 0, 0])
    table.find_or_insert(keys, tids)
    assert scores_of(table, 0) == {1: [2], 2: [1]}
    assert scores_of(table, 1) == {1: [1]}
    assert table.erase(torch.tensor([1]), torch.tensor([1])).tolist() != [-1]
    assert scores_of(table, 1) == {}
    assert scores_of(table, 0) == {1: [2], 2: [1]}


def test_deterministic_flag_reads_the_environment_once(monkeypatch):
    monkeypatch.delenv("DEMB_DETERMINISM_MODE", raising=False)
    assert one_table().deterministic is False
    monkeypatch.setenv("DEMB_DETERMINISM_MODE", "1")
    table = one_table()
    assert table.deterministic is True
    monkeypatch.delenv("DEMB_DETERMINISM_MODE")
    assert table.deterministic is True


@pytest.mark.parametrize("table_id", [1, -1, True, 0.0])
def test_table_ids_out_of_range_are_named(table_id):
    table = one_table()
    calls = [
        lambda: table.capacity(table_id),
        lambda: table.size(table_id),
        lambda: table.set_score(table_id, 1),
        lambda: table.read(table_id, torch.tensor([0])),
        lambda: table.write(table_id, torch.tensor([0]), torch.zeros(1, 4)),
        lambda: table.export(table_id),
        lambda: table.expand(table_id),
    ]
    for call in calls:
        with pytest.raises(TableConfigError, match="table_id="):
            call()
    assert table.capacity(0) == 256


def test_outcome_says_when_every_key_was_found():
    """all_hit only when no key is new and none failed; a failed key in a later all-present
    batch is counted once."""
    table = one_table(S.STEP, max_capacity=32, safe_check_mode=SafeCheckMode.IGNORE)
    keys = overflow(table)
    first = table.find_or_insert(keys, ids(17))
    assert not first.all_hit
    present = keys[first.status != InsertStatus.FAILED]
    again = table.find_or_insert(present.flip(0), ids(16))
    assert again.all_hit
    assert bool((again.status == InsertStatus.HIT).all())
    torch.testing.assert_close(
        again.slots.flip(0), first.slots[first.status != InsertStatus.FAILED]
    )
    assert not table.find_or_insert(keys, ids(17)).all_hit
    assert table.failed_inserts.tolist() == [2]


@pytest.mark.parametrize("strategy", [S.STEP, S.TIMESTAMP, S.CUSTOMIZED])
def test_scores_made_ahead_are_the_scores_find_or_insert_would_make(strategy):
    """next_score_args advances nothing; passed as score_args it gives the keys the scores
    (and STEP the step count) that find_or_insert makes itself. Bad ones are named."""
    made, ahead = one_table(strategy), one_table(strategy)
    for table in (made, ahead):
        if strategy is S.CUSTOMIZED:
            table.set_score(0, 40)
    for keys in ([1, 2], [2, 3], [3]):
        args = ahead.next_score_args()
        assert ahead.steps == made.steps  # nothing advanced yet
        if strategy is S.STEP:
            assert args.tolist() == [ahead.steps[0] + 1]
        ahead.find_or_insert(torch.tensor(keys), ids(len(keys)), score_args=args)
        made.find_or_insert(torch.tensor(keys), ids(len(keys)))
    assert scores_of(ahead) == scores_of(made)
    assert ahead.steps == made.steps == [3]
    with pytest.raises(ValueError, match=r"score_args must be \(1,\) int64"):
        ahead.find_or_insert(torch.tensor([4]), ids(1), score_args=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"score_args must be \(1,\) int64"):
        ahead.find_or_insert(torch.tensor([4]), ids(1), score_args=torch.tensor([1.0]))
    assert ahead.steps == [3]


@pytest.mark.parametrize(
    ("device", "strategies", "clock", "expected"),
    [
        ("cpu", (S.TIMESTAMP, S.TIMESTAMP), None, False),  # the CPU's clock is the host's
        pytest.param("cuda", (S.TIMESTAMP, S.TIMESTAMP), None, True, marks=pytest.mark.cuda),
        pytest.param("cuda", (S.TIMESTAMP, S.STEP), None, False, marks=pytest.mark.cuda),
        pytest.param("cuda", (S.TIMESTAMP,), Clock(), False, marks=pytest.mark.cuda),
    ],
)
def test_scores_from_gpu_clock_only_when_every_table_reads_the_gpu_timer(
    device, strategies, clock, expected
):
    """scores_from_gpu_clock: on CUDA, every table timed and no clock given (then a caller may
    pass a later reading of the GPU timer as the score args)."""
    configs = [
        TableConfig(dim=4, score_strategy=s, max_capacity=64, bucket_capacity=16)
        for s in strategies
    ]
    table = ScoredHashTable(configs, device, clock=clock)
    assert table.scores_from_gpu_clock is expected


def test_find_or_insert_reads_the_rows_of_a_batch_found_whole():
    """gather_rows: the outcome carries each occurrence's row when every key is found (the
    rows its slots hold), and None when a key is new."""
    table = one_table(S.STEP)
    table.find_or_insert(torch.tensor([4, 9]), ids(2))
    table.write(0, table.find(torch.tensor([4, 9]), ids(2)), torch.tensor([[1.0] * 4, [2.0] * 4]))
    inverse = torch.tensor([1, 0, 1])
    found = table.find_or_insert(torch.tensor([4, 9]), ids(2), gather_rows=(inverse, 3))
    assert found.all_hit
    assert found.rows is not None
    assert found.rows.tolist() == [[2.0] * 3, [1.0] * 3, [2.0] * 3]
    new = table.find_or_insert(torch.tensor([4, 5]), ids(2), gather_rows=(inverse[:2], 3))
    assert not new.all_hit
    assert new.rows is None
    assert table.find_or_insert(torch.tensor([4]), ids(1)).rows is None  # not asked for


@settings(max_examples=25, deadline=None)
@given(
    strategies=st.lists(
        st.sampled_from([S.TIMESTAMP, S.STEP, S.LFU, (S.TIMESTAMP, S.LFU), (S.LFU, S.TIMESTAMP)]),
        min_size=1,
        max_size=5,
    ),
    batches=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=60), max_size=5),
    picks=st.lists(st.tuples(st.integers(0, 4), st.integers(-1, 700)), min_size=1, max_size=6),
)
def test_export_many_equals_one_export_each(strategies, batches, picks):
    """Tables of several layouts scanned together return, per table and threshold (None:
    whole), what one export of it does: keys, scores, slots and rows, in slot order."""
    _check_export_many(strategies, batches, picks, "cpu")


@pytest.mark.cuda
@settings(max_examples=10, deadline=None)
@given(
    strategies=st.lists(
        st.sampled_from([S.TIMESTAMP, S.STEP, S.LFU, (S.TIMESTAMP, S.LFU)]), min_size=1, max_size=4
    ),
    batches=st.lists(st.lists(st.integers(0, 300), min_size=1, max_size=60), max_size=4),
    picks=st.lists(st.tuples(st.integers(0, 3), st.integers(-1, 700)), min_size=1, max_size=5),
)
def test_export_many_equals_one_export_each_on_cuda(strategies, batches, picks):
    """The same on a GPU (a CUDA index and value rows)."""
    _check_export_many(strategies, batches, picks, "cuda")


def _check_export_many(strategies, batches, picks, device):
    configs = [
        TableConfig(dim=3, score_strategy=s, max_capacity=128, bucket_capacity=16)
        for s in strategies
    ]
    table = ScoredHashTable(configs, device, clock=None if device == "cuda" else Clock())
    g = torch.Generator().manual_seed(len(batches))
    for batch in batches:
        keys = torch.tensor(batch, device=device)
        tids = torch.tensor([k % len(configs) for k in batch], device=device)
        out = table.find_or_insert(keys, tids)
        for t in range(len(configs)):
            mine = (tids == t) & (out.slots >= 0)
            slots = torch.unique(out.slots[mine])
            rows = torch.randn((slots.numel(), table.values[t].shape[1]), generator=g).to(device)
            table.write(t, slots, rows)
    chosen = [(t % len(configs), None if th < 0 else th) for t, th in picks]
    many = table.export_many([t for t, _ in chosen], [th for _, th in chosen])
    assert len(many) == len(chosen)
    for (t, th), got in zip(chosen, many, strict=True):
        want = table.export(t, min_score=th)
        for name in ("keys", "scores", "slots", "values"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=0, atol=0)


def test_export_tables_rejects_bad_arguments():
    """Lists of different lengths, value rows shorter than the table, or a split outside the
    rows' columns raise ValueError naming what is wrong; nothing is exported."""
    table = ScoredHashTable(
        [TableConfig(dim=3, score_strategy=S.LFU, max_capacity=128, bucket_capacity=16)] * 2
    )
    table.find_or_insert(torch.arange(10), ids(10))
    layouts = [c.score_layout for c in table.configs]
    with pytest.raises(ValueError, match="differ in length"):
        export_tables(table.index, layouts, table.values, [0], [None, None])
    short = [table.values[0][:5], table.values[1]]
    with pytest.raises(ValueError, match="export of table 0: values \\(5, 3\\) must have a row"):
        export_tables(table.index, layouts, short, [0, 1], [None, None])
    with pytest.raises(ValueError, match="split=3 columns"):
        export_table(table.index, layouts[0], table.values[0], 0, split=3)
