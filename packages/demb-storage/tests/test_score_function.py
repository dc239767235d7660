"""Custom eviction scores (``TableConfig.score_function``): a table with one evicts exactly what
a Python model does (the unprotected key of a full bucket with the lowest ``f(scores, now)``,
NaN first, ties to the first slot in circular order), for the spec's example and a family of
functions, in both tuple orders; the options are checked at construction; CPU and CUDA tables
agree (marker ``cuda``)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from demb_kernels import table as ops
from demb_kernels.table_reference import TIMESTAMP_LFU, TableModel
from demb_storage import ScoredHashTable, TableConfig, TableConfigError
from demb_storage import ScoreStrategy as S
from demb_storage.score_function import float_rank
from hypothesis import given
from hypothesis import strategies as st

TS_LFU, LFU_TS = (S.TIMESTAMP, S.LFU), (S.LFU, S.TIMESTAMP)
CAPACITY, WIDTH = 64, 16
BASE, STEP = 10**12, 1_234_567_891  # ns: steps of about 1.23 s, never a round number of seconds


def lru_lfu_decay_score(scores, cur_timestamp):
    # The spec's example, for (TIMESTAMP, LFU): scores[0] timestamp, scores[1] frequency.
    age_seconds = (cur_timestamp - scores[0]) * 1e-9
    return math.log(max(scores[1], 1)) + age_seconds * math.log(0.9)


def lru_lfu_decay_score_swapped(scores, cur_timestamp):
    # The same for (LFU, TIMESTAMP): scores[0] frequency, scores[1] timestamp.
    age_seconds = (cur_timestamp - scores[1]) * 1e-9
    return math.log(max(scores[0], 1)) + age_seconds * math.log(0.9)


def decay(a, b, ts, fr):
    def score(scores, now):
        return a * math.log1p(scores[fr]) - b * ((now - scores[ts]) * 1e-9)

    return score


def integer(ts, fr):
    def score(scores, now):
        return scores[fr] * 1000 - (now - scores[ts]) // 1_000_000

    return score


def nan_some(ts, fr):
    def score(scores, now):
        if scores[fr] % 3 == 1:
            return math.nan
        return math.log1p(scores[fr]) - (now - scores[ts]) * 1e-9

    return score


def signed_zeros(ts, fr):
    def score(scores, now):  # -0.0 and 0.0 tie: circular order alone decides
        return -0.0 if scores[fr] % 2 else 0.0

    return score


_rng = random.Random(11)
FUNCTIONS = {"spec": {TS_LFU: lru_lfu_decay_score, LFU_TS: lru_lfu_decay_score_swapped}}
for name in ("decay_a", "decay_b"):  # a * log1p(frequency) - b * age, random a and b
    a, b = _rng.uniform(0.1, 3), _rng.uniform(0.01, 2)
    FUNCTIONS[name] = {TS_LFU: decay(a, b, 0, 1), LFU_TS: decay(a, b, 1, 0)}
for name, family in [("integer", integer), ("nan", nan_some), ("zeros", signed_zeros)]:
    FUNCTIONS[name] = {TS_LFU: family(0, 1), LFU_TS: family(1, 0)}


def config(order, function, **kw) -> TableConfig:
    return TableConfig(
        dim=2,
        max_capacity=CAPACITY,
        bucket_capacity=WIDTH,
        score_strategy=order,
        score_function=function,
        **kw,
    )


def i64(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def victim_order(function, order, now):
    """The model's victim order of a table with ``function``: f on the user's columns (the
    index words are [frequency, timestamp]), NaN lowest."""

    def key(slot, words):
        scores = (words[1], words[0]) if order == TS_LFU else (words[0], words[1])
        value = float(function(scores, now))
        return (0, 0.0) if math.isnan(value) else (1, value)

    return key


def index_state(table: ScoredHashTable) -> dict:
    out = {}
    for t in range(table.num_tables):
        ex = ops.export(table.index, t)
        for key, slot, words in zip(
            ex.keys.tolist(), ex.slots.tolist(), ex.scores.T.tolist(), strict=True
        ):
            out[t, key] = (slot, tuple(words))
    return out


def model_state(model: TableModel) -> dict:
    return {(t, k): v for t in range(model.num_tables) for k, v in model.snapshot(t).items()}


def run_against_model(order, function, seed, batches=14):
    """Table 0 has ``function``; table 1 the same compound strategy without one (the built-in
    order). Random batches of find_or_insert (and some insert_or_assign) on the table and the
    model; returns the number of evictions of table 0."""
    now = [BASE]
    table = ScoredHashTable(
        [config(order, function), config(order, None)], clock=lambda: i64([now[0]])
    )
    model = TableModel([CAPACITY] * 2, [WIDTH] * 2, [TIMESTAMP_LFU] * 2, 2)
    gen = random.Random(seed)
    evictions = 0
    for step in range(batches):
        now[0] = BASE + step * STEP + gen.randrange(1000)
        model.set_victim_order(0, victim_order(function, order, now[0]))
        n = gen.randrange(8, 40)
        keys = [gen.randrange(300) for _ in range(n)]
        tids = [gen.randrange(2) for _ in range(n)]
        if step % 5 == 4:  # a load: given index words [frequency, timestamp]
            rows = [[gen.randrange(6), now[0] - gen.randrange(5) * STEP] for _ in range(n)]
            out = table.insert_or_assign(i64(keys), i64(tids), torch.tensor(rows).T.contiguous())
            expected = model.insert_or_assign(keys, tids, rows)
        else:
            counts = [gen.randrange(4) for _ in range(n)]
            out = table.find_or_insert(
                i64(keys), i64(tids), counts=i64(counts), score_args=i64([now[0]] * 2)
            )
            expected = model.find_or_insert(keys, tids, [now[0]] * 2, counts)
        assert out.slots.tolist() == expected[0], f"step {step}: slots"
        assert out.status.tolist() == expected[1], f"step {step}: statuses"
        assert index_state(table) == model_state(model), f"step {step}: state"
        evictions += sum(1 for s, t in zip(expected[1], tids, strict=True) if s == 2 and t == 0)
    return evictions


# Each function compiles in about 0.25 s: the spec's example in both orders, the others in one.
CASES = [
    ("spec", TS_LFU),
    ("spec", LFU_TS),
    ("decay_a", TS_LFU),
    ("decay_b", LFU_TS),
    ("integer", LFU_TS),
    ("nan", TS_LFU),
    ("zeros", LFU_TS),
]


@pytest.mark.parametrize(("name", "order"), CASES)
def test_evicts_what_the_model_evicts(name, order):
    assert run_against_model(order, FUNCTIONS[name][order], seed=len(name)) > 20


def test_both_tuple_orders_evict_identically():
    states = []
    for order in (TS_LFU, LFU_TS):
        table = ScoredHashTable([config(order, FUNCTIONS["spec"][order])])
        gen = random.Random(5)
        for step in range(10):
            keys = i64(gen.randrange(200) for _ in range(30))
            args = i64([BASE + step * STEP])
            table.find_or_insert(keys, torch.zeros_like(keys), score_args=args)
        states.append(index_state(table))
    assert states[0] == states[1]


def test_ranks_are_the_float_order_of_the_scores():
    """Each slot's victim rank is float_rank of the function's value on its scores."""
    function = FUNCTIONS["nan"][TS_LFU]
    table = ScoredHashTable([config(TS_LFU, function)])
    keys = i64(range(40))
    table.find_or_insert(keys, torch.zeros_like(keys), counts=keys % 5, score_args=i64([BASE]))
    now = BASE + 3 * STEP
    table.rank_victims(i64([now]))
    ex = ops.export(table.index, 0)
    ranks = table.index.victim_rank[ex.slots].tolist()
    assert ranks == [float_rank(function((ts, f), now)) for f, ts in ex.scores.T.tolist()]


@given(st.floats(allow_nan=True), st.floats(allow_nan=True))
def test_float_rank_orders_like_floats_with_nan_first(a, b):
    ra, rb = float_rank(a), float_rank(b)
    if math.isnan(a):
        assert ra == -(2**63)
        assert ra <= rb
    elif not math.isnan(b):
        assert (ra < rb) == (a < b)
        assert (ra == rb) == (a == b)


def test_score_function_needs_the_compound_strategy():
    for strategy in (S.TIMESTAMP, S.LFU, S.STEP, S.CUSTOMIZED, S.NO_EVICTION, (S.LFU,)):
        with pytest.raises(TableConfigError, match=r"score_function=.*needs the compound"):
            config(strategy, lru_lfu_decay_score)
    with pytest.raises(ValueError, match="score_function"):  # a ValueError, as the spec says
        config(S.TIMESTAMP, lru_lfu_decay_score)


@pytest.mark.parametrize(
    "function",
    [lambda scores: 0.0, lambda scores, now, extra: 0.0, lambda *args: 0.0, "not a function"],
)
def test_score_function_needs_two_positional_parameters(function):
    with pytest.raises(TableConfigError, match="score_function=") as err:
        config(TS_LFU, function)
    assert err.value.option == "score_function"


_OPAQUE = object()
_WEIGHTS = {"a": 1.0}


def uses_global_dict(scores, now):
    return _WEIGHTS["a"] * scores[0]


def uses_object(scores, now):
    return float(_OPAQUE is None)


def uses_undefined(scores, now):
    return undefined_helper(scores[0])  # noqa: F821


@pytest.mark.parametrize("function", [uses_global_dict, uses_object, uses_undefined])
def test_a_function_numba_cannot_compile_fails_at_construction(function):
    good = config(TS_LFU, lru_lfu_decay_score)
    bad = config(TS_LFU, function)  # checked for its parameters only
    with pytest.raises(
        TableConfigError, match=rf"table 1: numba cannot compile {function.__name__}"
    ):
        ScoredHashTable([good, bad])


# --- CPU and CUDA ---------------------------------------------------------------------------


def devices_agree(order, function, batches=12):
    tables = {
        d: ScoredHashTable([config(order, function), config(order, None)], d)
        for d in ("cpu", "cuda")
    }
    gen = random.Random(3)
    for step in range(batches):
        n = gen.randrange(8, 40)
        keys = i64(gen.randrange(300) for _ in range(n))
        tids = i64(gen.randrange(2) for _ in range(n))
        counts = i64(gen.randrange(4) for _ in range(n))
        args = i64([BASE + step * STEP] * 2)
        outs = {
            d: t.find_or_insert(keys.to(d), tids.to(d), counts=counts.to(d), score_args=args.to(d))
            for d, t in tables.items()
        }
        assert torch.equal(outs["cpu"].slots, outs["cuda"].slots.cpu())
        assert torch.equal(outs["cpu"].status, outs["cuda"].status.cpu())
        assert index_state(tables["cpu"]) == index_state(tables["cuda"])
        assert torch.equal(tables["cpu"].index.sizes, tables["cuda"].index.sizes.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("order", [TS_LFU, LFU_TS], ids=["ts_lfu", "lfu_ts"])
@pytest.mark.parametrize("name", ["spec", "decay_a", "integer", "nan"])
def test_cpu_and_cuda_tables_end_identical(name, order):
    devices_agree(order, FUNCTIONS[name][order])


@pytest.mark.cuda
def test_launched_find_or_insert_ranks_victims_on_the_device():
    """The one-sync path (dedup_launch + find_or_insert_launched) of a CUDA table evicts what
    find_or_insert of the same unique keys does on a CPU table."""
    from demb_kernels.launched import dedup_launch
    from demb_storage import find_or_insert_launched

    function = FUNCTIONS["spec"][TS_LFU]
    gpu = ScoredHashTable([config(TS_LFU, function)], "cuda")
    cpu = ScoredHashTable([config(TS_LFU, function)], "cpu")
    gen = random.Random(9)
    for step in range(10):
        indices = i64(gen.randrange(200) for _ in range(40)).cuda()
        offsets = torch.arange(41, device="cuda")
        launched = dedup_launch(indices, offsets, i64([0]).cuda(), 1, 40)
        args = i64([BASE + step * STEP])
        outcome, _ = find_or_insert_launched(gpu, launched, args.cuda())
        assert outcome is not None
        u = outcome.slots.shape[0]
        want = cpu.find_or_insert(
            launched.keys[:u].cpu(),
            launched.tables[:u].cpu(),
            counts=launched.counts[:u].cpu(),
            score_args=args,
        )
        assert torch.equal(outcome.slots.cpu(), want.slots)
        assert index_state(gpu) == index_state(cpu)
