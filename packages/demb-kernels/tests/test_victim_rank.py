"""Tables that rank their victims (``TableIndex.victim_rank``): the victim of a full bucket is
the unprotected slot with the lowest rank, ties to the first in the key's circular order; the
kernels agree with the pure-Python model (``TableModel.set_victim_order``) on random batches
with many equal ranks, and the ranks must have one entry per slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from demb_kernels import table as ops
from demb_kernels.table import InsertStatus, ScorePolicy, TableIndex
from demb_kernels.table_reference import TIMESTAMP_LFU, TableModel
from demb_planner import home_slots
from hypothesis import given, settings
from hypothesis import strategies as st

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
WIDTH = 16
EVICTING = (ScorePolicy.TIMESTAMP, ScorePolicy.LFU, ScorePolicy.CUSTOMIZED, TIMESTAMP_LFU)


def i64(values) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def key_at(capacity: int, bucket: int, start: int, exclude=()) -> int:
    """A key whose home in a table of ``capacity`` slots is ``(bucket, start)``."""
    candidates = np.arange(0, 50_000, dtype=np.int64)
    where = home_slots(candidates, capacity, WIDTH)
    hits = (where.bucket == bucket) & (where.start == start)
    return next(int(k) for k in candidates[hits] if int(k) not in exclude)


def test_victim_is_the_lowest_rank_with_ties_in_circular_order():
    index = TableIndex.create([32], [WIDTH], [ScorePolicy.TIMESTAMP_LFU], ranked=[True])
    assert index.victim_rank.shape == (32,)
    assert index.ranked.tolist() == [1]
    assert index.ranked_list == (True,)
    keys = [key_at(32, 0, j) for j in range(WIDTH)]
    res = ops.find_or_insert(index, i64(keys), i64([0] * WIDTH), i64([1]))
    assert res.slots.tolist() == list(range(WIDTH))
    # Scores alone would evict slot 0 (every frequency 1, every timestamp 1). Ranks: slots 3 and
    # 12 tie lowest at -5.
    ranks = [7] * 32
    ranks[3] = ranks[12] = -5
    index.victim_rank.copy_(i64(ranks))
    new = key_at(32, 0, 10, exclude=keys)  # circular order from 10: 12 comes before 3
    res = ops.find_or_insert(index, i64([new]), i64([0]), i64([2]))
    assert res.status.tolist() == [InsertStatus.EVICTED]
    assert res.slots.tolist() == [12]
    assert res.victim_keys.tolist() == [keys[12]]
    newer = key_at(32, 0, 2, exclude=[*keys, new])  # from 2: slot 3 first; 12 is taken now
    ranks[12] = 7
    index.victim_rank.copy_(i64(ranks))
    res = ops.find_or_insert(index, i64([newer]), i64([0]), i64([3]))
    assert res.slots.tolist() == [3]
    assert res.victim_keys.tolist() == [keys[3]]


def test_protected_slots_are_never_victims_whatever_their_rank():
    index = TableIndex.create([16], [WIDTH], [ScorePolicy.LFU], ranked=[True])
    keys = [key_at(16, 0, j) for j in range(WIDTH)]
    ops.find_or_insert(index, i64(keys), i64([0] * WIDTH), i64([0]))
    index.victim_rank.copy_(i64(range(WIDTH)))  # slot 0 ranks lowest
    new = key_at(16, 0, 5, exclude=keys)
    res = ops.find_or_insert(index, i64([keys[0], new]), i64([0, 0]), i64([0]))
    assert res.status.tolist() == [InsertStatus.HIT, InsertStatus.EVICTED]
    assert res.slots.tolist() == [0, 1]  # slot 0 was hit, so protected: rank 1 next


def test_unranked_tables_of_the_index_keep_score_order():
    index = TableIndex.create(
        [16, 16], [WIDTH, WIDTH], [ScorePolicy.CUSTOMIZED] * 2, ranked=[False, True]
    )
    keys = [key_at(16, 0, j) for j in range(WIDTH)]
    for t in (0, 1):
        scores = i64(range(100, 100 + WIDTH))
        ops.insert_or_assign(index, i64(keys), i64([t] * WIDTH), scores.reshape(1, -1))
    index.victim_rank.copy_(i64([0] * 16 + list(range(16, 0, -1))))
    new = key_at(16, 0, 0, exclude=keys)
    res = ops.find_or_insert(index, i64([new, new]), i64([0, 1]), i64([500, 500]))
    assert res.slots.tolist() == [0, 15]  # table 0: lowest score; table 1: lowest rank


def test_ranks_must_cover_every_slot():
    index = TableIndex.create([32, 16], [WIDTH, WIDTH], [ScorePolicy.LFU] * 2, ranked=[False, True])
    index.victim_rank = torch.zeros(32, dtype=torch.int64)
    keys, tids = i64([1, 2]), i64([1, 1])
    with pytest.raises(ValueError, match=r"victim_rank: tables \[1\] rank their victims.*\(48,\)"):
        ops.find_or_insert(index, keys, tids, i64([0, 0]))
    with pytest.raises(ValueError, match="victim_rank"):
        ops.insert_or_assign(index, keys, tids, torch.zeros(1, 2, dtype=torch.int64))
    # The op itself (below the wrapper) refuses ranks of another size, and empty ranks for a
    # flagged table.
    args = (*index._tensors(), index.sizes, keys, tids, i64([0, 0]), None)
    with pytest.raises(ValueError, match=r"victim_rank must be \(S,\) = \(48,\)"):
        torch.ops.demb.table_find_or_insert(*args, index.victim_rank, index.ranked)
    with pytest.raises(ValueError, match=r"table 1 ranks its victims"):
        torch.ops.demb.table_find_or_insert(*args, torch.empty(0, dtype=torch.int64), index.ranked)
    assert index.sizes.tolist() == [0, 0]


def test_create_checks_the_flags_and_rehash_keeps_them():
    with pytest.raises(ValueError, match=r"ranked=\[True\]: must be 2 bools"):
        TableIndex.create([16, 16], [WIDTH, WIDTH], [ScorePolicy.LFU] * 2, ranked=[True])
    plain = TableIndex.create([16], [WIDTH], [ScorePolicy.LFU])
    assert plain.victim_rank.shape == (0,)
    assert plain.ranked.shape == (0,)
    assert plain.ranked_list == ()
    index = TableIndex.create([16, 32], [WIDTH, WIDTH], [ScorePolicy.LFU] * 2, ranked=[True, False])
    index.victim_rank.copy_(i64(range(48)))
    grown, _, _ = ops.rehash(index, 1, 64)
    assert grown.ranked_list == (True, False)
    assert grown.victim_rank.tolist() == list(range(16)) + [0] * 64
    grown, _, _ = ops.rehash(grown, 0, 32)
    assert grown.victim_rank.shape == (96,)


# --- against the model ---------------------------------------------------------------------

RANK = st.integers(-2, 2) | st.sampled_from([INT64_MIN, INT64_MAX])
TABLE = st.tuples(st.sampled_from([16, 32, 48]), st.sampled_from(EVICTING), st.booleans())
BATCH = st.tuples(
    st.sampled_from(["find_or_insert", "find_or_insert", "insert_or_assign"]),
    st.lists(
        st.tuples(st.integers(0, 150), st.integers(0, 1), st.integers(0, 3)),
        min_size=8,
        max_size=60,
    ),
    st.data(),
)


def state(index: TableIndex) -> dict:
    out = {}
    for t in range(index.num_tables):
        ex = ops.export(index, t)
        for key, slot, words in zip(
            ex.keys.tolist(), ex.slots.tolist(), ex.scores.T.tolist(), strict=True
        ):
            out[t, key] = (slot, tuple(words))
    return out


def model_state(model: TableModel) -> dict:
    return {(t, k): v for t in range(model.num_tables) for k, v in model.snapshot(t).items()}


def run_batch(index, model, op, items, ranks, clock):
    """One op on the index and the model with the same ranks; returns (kernel, model) outputs."""
    if index.ranks_victims:
        index.victim_rank.copy_(i64(ranks))
    for t in range(index.num_tables):
        if index.ranks_victims and index.ranked_list[t]:
            lo, hi = index.slot_range(t)
            local = ranks[lo:hi]
            model.set_victim_order(t, lambda slot, words, r=local: r[slot])
    keys = [k for k, _, _ in items]
    tids = [t % index.num_tables for _, t, _ in items]
    counts = [c for _, _, c in items]
    if op == "find_or_insert":
        args = [clock] * index.num_tables
        res = ops.find_or_insert(index, i64(keys), i64(tids), i64(args), i64(counts))
        expected = model.find_or_insert(keys, tids, args, counts)
    else:
        rows = [[c + clock, clock - c][: index.score_words] for c in counts]
        scores = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), index.score_words)
        scores = scores.T.contiguous()
        res = ops.insert_or_assign(index, i64(keys), i64(tids), scores)
        expected = model.insert_or_assign(keys, tids, rows)
    got = (res.slots.tolist(), res.status.tolist(), res.victim_keys.tolist())
    return got, expected[:3]


@settings(max_examples=60, deadline=None)
@given(tables=st.lists(TABLE, min_size=1, max_size=2), batches=st.lists(BATCH, max_size=6))
def test_ranked_victims_match_the_model(tables, batches):
    capacities = [c for c, _, _ in tables]
    policies = [p for _, p, _ in tables]
    ranked = [r for _, _, r in tables]
    index = TableIndex.create(
        capacities, [WIDTH] * len(tables), [ScorePolicy(p) for p in policies], ranked=ranked
    )
    model = TableModel(capacities, [WIDTH] * len(tables), policies, index.score_words)
    for clock, (op, items, data) in enumerate(batches, start=1):
        ranks = data.draw(st.lists(RANK, min_size=sum(capacities), max_size=sum(capacities)))
        got, expected = run_batch(index, model, op, items, ranks, clock)
        assert got == tuple(expected), f"{op}: kernel {got} != model {expected}"
        assert state(index) == model_state(model)
        assert index.sizes.tolist() == model.sizes()


@pytest.mark.cuda
@pytest.mark.parametrize("width", [WIDTH, 256], ids=["narrow", "wide"])
def test_cpu_and_cuda_pick_the_same_ranked_victims(width):
    """Narrow buckets (a thread searches each) and wide ones (a warp does) alike."""
    gen = np.random.default_rng(7)
    caps = [4 * width, 2 * width]
    make = {
        d: TableIndex.create(
            caps,
            [width, width],
            [ScorePolicy.TIMESTAMP_LFU, ScorePolicy.LFU],
            device=d,
            ranked=[True, True],
        )
        for d in ("cpu", "cuda")
    }
    for step in range(20):
        keys = i64(gen.integers(0, 300 * width // WIDTH, 3 * width))
        tids = i64(gen.integers(0, 2, 3 * width))
        counts = i64(gen.integers(0, 3, 3 * width))
        ranks = i64(gen.integers(-3, 3, sum(caps)))  # many ties
        out = {}
        for d, index in make.items():
            index.victim_rank.copy_(ranks.to(d))
            res = ops.find_or_insert(
                index, keys.to(d), tids.to(d), i64([step, step]).to(d), counts.to(d)
            )
            out[d] = [t.cpu() for t in res]
        for a, b in zip(out["cpu"], out["cuda"], strict=True):
            assert torch.equal(a, b)
        for t in range(2):
            ca, cu = ops.export(make["cpu"], t), ops.export(make["cuda"], t)
            for a, b in zip(ca, cu, strict=True):
                assert torch.equal(a, b.cpu())
