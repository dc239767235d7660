"""Hand-worked cases of the pure-Python hash-table model (``demb_kernels.table_reference``).

Keys are chosen through ``demb_planner.home_slots`` so that they collide in one bucket of a
small table (capacity 32, bucket width 16: buckets 0 and 1), and every expectation below is
worked out from ``docs/hash_table.md`` by hand, not by re-running the algorithm.
"""

from __future__ import annotations

import numpy as np
import pytest
from demb_kernels.table_reference import (
    CUSTOMIZED,
    EMPTY_KEY,
    EVICTED,
    FAILED,
    HIT,
    INSERTED,
    LFU,
    NO_EVICTION,
    SCORE_MAX,
    STEP,
    TIMESTAMP,
    TIMESTAMP_LFU,
    TableModel,
)
from demb_planner import home_slots

CAP, WIDTH = 32, 16
_CANDIDATES = np.arange(0, 20_000, dtype=np.int64)


def homes(capacity=CAP, width=WIDTH):
    where = home_slots(_CANDIDATES, capacity, width)
    return {
        int(k): (int(b), int(s))
        for k, b, s in zip(_CANDIDATES, where.bucket, where.start, strict=True)
    }


HOMES = homes()


def bucket_keys(bucket, n, exclude=()):
    """The first ``n`` candidate keys whose home is ``bucket``."""
    out = [k for k, (b, _) in HOMES.items() if b == bucket and k not in exclude]
    return out[:n]


def key_at(bucket, start, exclude=()):
    """A key whose home bucket is ``bucket`` and start position ``start``."""
    return next(k for k, bs in HOMES.items() if bs == (bucket, start) and k not in exclude)


def one_table(policy, capacity=CAP, width=WIDTH, words=None):
    if words is None:
        words = 2 if policy == TIMESTAMP_LFU else 1
    return TableModel([capacity], [width], [policy], words)


def fill_bucket(model, bucket, score_of=lambda j: 1):
    """Insert 16 keys of ``bucket`` one call each, key ``j`` at score arg ``score_of(j)``."""
    keys = bucket_keys(bucket, WIDTH)
    for j, key in enumerate(keys):
        _, status, victims, _ = model.find_or_insert([key], [0], [score_of(j)])
        assert status == [INSERTED]
        assert victims == [EMPTY_KEY]
    assert model.sizes() == [WIDTH]
    return keys


def test_first_key_goes_to_its_start_and_collisions_probe_in_circular_order():
    model = one_table(TIMESTAMP)
    a = key_at(0, 15)
    b = key_at(0, 15, exclude=(a,))
    c = key_at(0, 0)
    slots, status, _, _ = model.find_or_insert([a, b, c], [0, 0, 0], [7])
    # a takes its start 15; b starts at 15 too, wraps around to 0; c's start 0 is taken: 1.
    assert slots == [15, 0, 1]
    assert status == [INSERTED] * 3
    assert model.snapshot(0) == {a: (15, (7,)), b: (0, (7,)), c: (1, (7,))}
    assert model.lookup([a, b, c, key_at(1, 3)], [0, 0, 0, 0]) == [15, 0, 1, -1]


def test_full_bucket_evicts_the_minimum_score():
    model = one_table(TIMESTAMP)
    order = [5, 3, 9, 0, 12, 7, 1, 15, 2, 11, 4, 14, 8, 6, 13, 10]  # distinct, min at j=3
    keys = fill_bucket(model, 0, score_of=lambda j: 100 + order[j])
    snap = model.snapshot(0)
    new = bucket_keys(0, WIDTH + 1)[-1]
    slots, status, victims, victim_scores = model.find_or_insert([new], [0], [500])
    assert status == [EVICTED]
    assert victims == [keys[3]]
    assert victim_scores == [[100]]
    assert slots == [snap[keys[3]][0]]
    assert keys[3] not in model.snapshot(0)
    assert model.snapshot(0)[new] == (snap[keys[3]][0], (500,))
    assert model.sizes() == [WIDTH]
    # The next minimum is order value 1, key j=6.
    newer = bucket_keys(0, WIDTH + 2)[-1]
    _, status, victims, victim_scores = model.find_or_insert([newer], [0], [501])
    assert (status, victims, victim_scores) == ([EVICTED], [keys[6]], [[101]])
    # Bucket 1 is untouched by all this.
    assert model.find_or_insert([bucket_keys(1, 1)[0]], [0], [1])[1] == [INSERTED]


def test_ties_go_to_the_first_slot_in_circular_order():
    model = one_table(CUSTOMIZED)
    keys = bucket_keys(0, WIDTH)
    model.find_or_insert(keys, [0] * WIDTH, [40])  # all 16 slots at score 40
    by_slot = {slot: key for key, (slot, _) in model.snapshot(0).items()}
    k1 = key_at(0, 9, exclude=keys)
    slots, status, victims, _ = model.find_or_insert([k1], [0], [50])
    assert (slots, status, victims) == ([9], [EVICTED], [by_slot[9]])
    # Starting at 9 again: slot 9 now holds score 50, so the tie among the 40s goes to 10.
    k2 = key_at(0, 9, exclude=[*keys, k1])
    slots, status, victims, _ = model.find_or_insert([k2], [0], [60])
    assert (slots, status, victims) == ([10], [EVICTED], [by_slot[10]])
    # Starting at 15 wraps: 15 is a 40, taken first.
    k3 = key_at(0, 15, exclude=[*keys, k1, k2])
    slots, _, victims, _ = model.find_or_insert([k3], [0], [70])
    assert (slots, victims) == ([15], [by_slot[15]])
    # Starting at 15 again: 15 is now 70, the circular order continues at 0.
    k4 = key_at(0, 15, exclude=[*keys, k1, k2, k3])
    slots, _, victims, _ = model.find_or_insert([k4], [0], [80])
    assert (slots, victims) == ([0], [by_slot[0]])


def test_customized_scores_may_decrease_and_a_lower_score_is_evicted_first():
    model = one_table(CUSTOMIZED)
    keys = fill_bucket(model, 0, score_of=lambda j: 1000)
    model.lookup([keys[4]], [0], [1000 - 1])  # a hit lowers its score
    model.find_or_insert([keys[9]], [0], [-5])  # negative is fine and lower still
    new = bucket_keys(0, WIDTH + 1)[-1]
    _, status, victims, victim_scores = model.find_or_insert([new], [0], [0])
    assert (status, victims, victim_scores) == ([EVICTED], [keys[9]], [[-5]])


def test_protection_fails_the_keys_beyond_the_unprotected_slots():
    model = one_table(STEP)
    keys = fill_bucket(model, 0)
    new = bucket_keys(0, WIDTH + 8)[WIDTH:]
    assert len(new) == 8
    hits = keys[:10]
    # New keys come first in the batch: phase A still protects the 10 hits before any insert.
    batch = new + hits
    slots, status, victims, victim_scores = model.find_or_insert(batch, [0] * len(batch), [2])
    assert status == [EVICTED] * 6 + [FAILED] * 2 + [HIT] * 10
    assert sorted(victims[:6]) == sorted(keys[10:])  # every unprotected key, once each
    assert victims[6:] == [EMPTY_KEY] * 12
    assert victim_scores == [[1]] * 6 + [[0]] * 12
    assert slots[6:8] == [-1, -1]
    snap = model.snapshot(0)
    assert set(snap) == set(new[:6]) | set(hits)
    assert all(snap[k] == (s, (2,)) for k, s in zip(batch, slots, strict=True) if s >= 0)
    assert model.sizes() == [WIDTH]


def test_a_batch_never_evicts_its_own_keys():
    model = one_table(TIMESTAMP)
    keys = fill_bucket(model, 0, score_of=lambda j: 10 + j)
    new = bucket_keys(0, WIDTH + 3)[WIDTH:]
    # keys[0] is the oldest; as a hit in the batch it is protected, so keys[1] goes first.
    slots, status, victims, _ = model.find_or_insert([new[0], keys[0], new[1]], [0] * 3, [99])
    assert status == [EVICTED, HIT, EVICTED]
    assert victims == [keys[1], EMPTY_KEY, keys[2]]
    # A duplicate of a key inserted earlier in phase B is a hit on that slot.
    slots, status, victims, _ = model.find_or_insert([new[2], new[2]], [0, 0], [100])
    assert status == [EVICTED, HIT]
    assert slots[0] == slots[1]
    assert victims == [keys[3], EMPTY_KEY]


def test_lfu_counts_are_exact_with_duplicates_and_counts():
    model = one_table(LFU)
    a, b = bucket_keys(0, 2)
    slots, status, _, _ = model.find_or_insert([a, a, b], [0, 0, 0], [123], counts=[2, 3, 1])
    assert status == [INSERTED, HIT, INSERTED]
    assert slots[0] == slots[1]
    assert model.snapshot(0)[a][1] == (5,)  # inserted at 2, then +3
    assert model.snapshot(0)[b][1] == (1,)
    model.lookup([a, b, a], [0, 0, 0], [0], counts=[1, 4, 0])
    assert model.snapshot(0)[a][1] == (6,)
    assert model.snapshot(0)[b][1] == (5,)
    model.lookup([a, b], [0, 0], None, counts=[100, 100])  # no score args: no touch
    assert model.snapshot(0)[a][1] == (6,)
    model.find_or_insert([a, a], [0, 0], [0])  # phase A, default count 1 each
    assert model.snapshot(0)[a][1] == (8,)
    model.find_or_insert([b], [0], [0], counts=[0])  # a zero count leaves it
    assert model.snapshot(0)[b][1] == (5,)
    c = bucket_keys(0, 3)[2]
    model.find_or_insert([c], [0], [0], counts=[0])  # and inserts at 0
    assert model.snapshot(0)[c][1] == (0,)


def test_lfu_saturates():
    model = one_table(LFU)
    a = bucket_keys(0, 1)[0]
    model.insert_or_assign([a], [0], [[SCORE_MAX - 2]])
    model.lookup([a, a], [0, 0], [0], counts=[1, 5])
    assert model.snapshot(0)[a][1] == (SCORE_MAX,)
    model.find_or_insert([a], [0], [0], counts=[SCORE_MAX])
    assert model.snapshot(0)[a][1] == (SCORE_MAX,)


def test_lfu_evicts_the_least_frequent():
    model = one_table(LFU)
    keys = fill_bucket(model, 0)
    model.lookup(keys, [0] * WIDTH, [0], counts=[5] * 7 + [2] + [5] * 8)  # keys[7] at 3
    new = bucket_keys(0, WIDTH + 1)[-1]
    _, status, victims, victim_scores = model.find_or_insert([new], [0], [0], counts=[1])
    assert (status, victims, victim_scores) == ([EVICTED], [keys[7]], [[3]])
    # new (frequency 1) is now the least frequent and the next victim.
    newer = bucket_keys(0, WIDTH + 2)[-1]
    _, _, victims, victim_scores = model.find_or_insert([newer], [0], [0])
    assert (victims, victim_scores) == ([new], [[1]])


def test_compound_orders_by_frequency_then_older_timestamp():
    model = one_table(TIMESTAMP_LFU)
    keys = fill_bucket(model, 0, score_of=lambda j: 10 + j)  # all frequency 1, ts 10..25
    assert model.snapshot(0)[keys[0]][1] == (1, 10)
    model.find_or_insert([keys[0]], [0], [50])  # oldest key hit again: frequency 2, ts 50
    assert model.snapshot(0)[keys[0]][1] == (2, 50)
    model.lookup([keys[5]], [0], [3], counts=[4])  # frequency 5 but an older ts (3)
    new = bucket_keys(0, WIDTH + 2)[WIDTH:]
    _, status, victims, victim_scores = model.find_or_insert([new[0]], [0], [60])
    assert (status, victims, victim_scores) == ([EVICTED], [keys[1]], [[1, 11]])
    assert model.snapshot(0)[new[0]][1] == (1, 60)
    _, _, victims, victim_scores = model.find_or_insert([new[1]], [0], [61])
    assert (victims, victim_scores) == ([keys[2]], [[1, 12]])


def test_no_eviction_fails_instead_of_evicting():
    model = one_table(NO_EVICTION)
    keys = fill_bucket(model, 0, score_of=lambda j: j)
    new = bucket_keys(0, WIDTH + 1)[-1]
    other = bucket_keys(1, 1)[0]
    slots, status, victims, victim_scores = model.find_or_insert([new, other], [0, 0], [99])
    assert slots[0] == -1
    assert status == [FAILED, INSERTED]
    assert victims == [EMPTY_KEY, EMPTY_KEY]
    assert victim_scores == [[0], [0]]
    slots, status, victims, _ = model.insert_or_assign([new], [0], [[-100]])
    assert (slots, status, victims) == ([-1], [FAILED], [EMPTY_KEY])
    assert set(model.snapshot(0)) == {*keys, other}
    assert model.sizes() == [WIDTH + 1]
    # After an erase the bucket takes the key again.
    model.erase([keys[3]], [0])
    assert model.find_or_insert([new], [0], [99])[1] == [INSERTED]


def test_erase_then_reinsert():
    model = one_table(LFU)
    a, b = bucket_keys(0, 2)
    c = bucket_keys(1, 1)[0]
    slots, _, _, _ = model.find_or_insert([a, b], [0, 0], [0], counts=[7, 1])
    freed = model.erase([a, a, c], [0, 0, 0])
    assert freed == [slots[0], -1, -1]
    assert model.sizes() == [1]
    assert model.lookup([a, b], [0, 0]) == [-1, slots[1]]
    assert model.export(0) == ([b], [[1]], [slots[1]])
    # Re-inserted, a starts over as a new key (its old frequency is gone).
    again, status, _, _ = model.find_or_insert([a], [0], [0], counts=[2])
    assert status == [INSERTED]
    assert model.snapshot(0)[a] == (again[0], (2,))
    assert again[0] == slots[0]  # its start position's slot is free again
    assert model.sizes() == [2]


def test_insert_or_assign_overwrites_last_duplicate_wins_and_inserts():
    model = one_table(TIMESTAMP)
    a, b = bucket_keys(0, 2)
    model.find_or_insert([a], [0], [5])
    slots, status, victims, _ = model.insert_or_assign([a, b, b], [0, 0, 0], [[1], [2], [3]])
    assert status == [HIT, INSERTED, HIT]
    assert slots[1] == slots[2]
    assert victims == [EMPTY_KEY] * 3
    assert model.snapshot(0)[a][1] == (1,)
    assert model.snapshot(0)[b][1] == (3,)


def test_insert_or_assign_protects_only_keys_touched_so_far():
    # The batch order reading: a new key may evict a present key that comes later in the
    # batch; that key is then inserted again when its turn comes.
    model = one_table(TIMESTAMP)
    keys = fill_bucket(model, 0, score_of=lambda j: 10 + j)
    new = bucket_keys(0, WIDTH + 1)[-1]
    scores = [[100], [200]]
    slots, status, victims, victim_scores = model.insert_or_assign([new, keys[0]], [0, 0], scores)
    assert status == [EVICTED, EVICTED]
    assert victims == [keys[0], keys[1]]
    assert victim_scores == [[10], [11]]
    assert model.snapshot(0)[keys[0]] == (slots[1], (200,))
    assert keys[1] not in model.snapshot(0)


def test_single_word_policies_keep_word_one_at_zero():
    model = TableModel([CAP, CAP], [WIDTH, WIDTH], [STEP, TIMESTAMP_LFU], 2)
    a = bucket_keys(0, 1)[0]
    model.find_or_insert([a, a], [0, 1], [7, 8])
    assert model.snapshot(0)[a][1] == (7, 0)
    assert model.snapshot(1)[a][1] == (1, 8)
    model.lookup([a, a], [0, 1], [9, 10], counts=[3, 3])
    assert model.snapshot(0)[a][1] == (9, 0)
    assert model.snapshot(1)[a][1] == (4, 10)


def test_export_range_and_min_score():
    model = one_table(STEP)
    keys = bucket_keys(0, 5) + bucket_keys(1, 3)
    for step, key in enumerate(keys):
        model.find_or_insert([key], [0], [step])
    snap = model.snapshot(0)
    ex_keys, ex_scores, ex_slots = model.export(0)
    assert ex_slots == sorted(s for s, _ in snap.values())
    assert {k: (s, tuple(w)) for k, w, s in zip(ex_keys, ex_scores, ex_slots, strict=True)} == (
        snap
    )
    ex_keys, ex_scores, ex_slots = model.export(0, min_score=3)
    assert sorted(ex_keys) == sorted(keys[3:])
    assert all(w[0] >= 3 for w in ex_scores)
    assert ex_slots == sorted(ex_slots)
    ex_keys, _, ex_slots = model.export(0, begin=WIDTH, end=CAP)  # bucket 1 only
    assert sorted(ex_keys) == sorted(keys[5:])
    assert all(WIDTH <= s < CAP for s in ex_slots)
    ex_keys, _, _ = model.export(0, begin=WIDTH, end=CAP, min_score=6)
    assert sorted(ex_keys) == sorted(keys[6:])
    assert model.export(0, begin=3, end=3) == ([], [], [])


def test_rehash_to_double_capacity_keeps_every_key_and_score():
    model = TableModel([CAP, CAP], [WIDTH, WIDTH], [TIMESTAMP_LFU, STEP], 2)
    keys = list(range(100, 160))
    model.find_or_insert(keys, [0] * len(keys), [3, 4])  # 60 keys into 32 slots: both full
    model.find_or_insert(keys[:40], [1] * 40, [3, 4])
    model.lookup(keys[::3], [0] * len(keys[::3]), [9, 9], counts=[2] * len(keys[::3]))
    before = model.snapshot(0)
    other = model.snapshot(1)
    assert len(before) == CAP
    old_slots, new_slots = model.rehash(0, 2 * CAP)
    assert model.capacities == (2 * CAP, CAP)
    assert old_slots == sorted(s for s, _ in before.values())
    after = model.snapshot(0)
    assert {k: w for k, (_, w) in after.items()} == {k: w for k, (_, w) in before.items()}
    by_old = {s: k for k, (s, _) in before.items()}
    for old, new in zip(old_slots, new_slots, strict=True):
        assert after[by_old[old]][0] == new
        assert new // WIDTH in (old // WIDTH, old // WIDTH + CAP // WIDTH)
        assert home_slots([by_old[old]], 2 * CAP, WIDTH).bucket[0] == new // WIDTH
    assert model.sizes() == [CAP, len(other)]
    assert model.snapshot(1) == other
    # The rehashed table works on: a new key fits without evicting.
    fresh = next(k for k in range(1000, 2000) if k not in after)
    assert model.find_or_insert([fresh], [0], [1, 1])[1] == [INSERTED]


def test_rehash_places_keys_in_ascending_old_slot_order():
    model = one_table(TIMESTAMP)
    a = key_at(0, 4)
    b = key_at(0, 4, exclude=(a,))
    assert a < b
    model.find_or_insert([b, a], [0, 0], [1])  # b at its start 4, a probes on to 5
    assert model.lookup([a, b], [0, 0]) == [5, 4]
    # Re-inserted in old-slot order (b, then a), not key order: they keep their slots.
    old, new = model.rehash(0, CAP)
    assert (old, new) == ([4, 5], [4, 5])
    assert model.lookup([a, b], [0, 0]) == [5, 4]


def test_clear_one_table_or_all():
    model = TableModel([CAP, CAP], [WIDTH, WIDTH], [STEP, LFU], 1)
    keys = bucket_keys(0, 3)
    model.find_or_insert(keys + keys, [0] * 3 + [1] * 3, [1, 0])
    model.clear(0)
    assert model.sizes() == [0, 3]
    assert model.lookup(keys, [0] * 3) == [-1] * 3
    model.clear()
    assert model.sizes() == [0, 0]


def test_fused_tables_are_independent():
    model = TableModel([CAP, 64], [WIDTH, 32], [NO_EVICTION, TIMESTAMP], 1)
    keys = bucket_keys(0, WIDTH)
    model.find_or_insert(keys, [0] * WIDTH, [1, 1])
    new = bucket_keys(0, WIDTH + 1)[-1]
    _, status, _, _ = model.find_or_insert([new, new], [0, 1], [2, 2])
    assert status == [FAILED, INSERTED]
    assert model.sizes() == [WIDTH, 1]


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.find_or_insert([1, -1], [0, 0], [0]), "empty key"),
        (lambda m: m.lookup([-1], [0]), "empty key"),
        (lambda m: m.erase([-1], [0]), "empty key"),
        (lambda m: m.insert_or_assign([-1], [0], [[0]]), "empty key"),
        (lambda m: m.find_or_insert([1], [1], [0]), "table_id"),
        (lambda m: m.lookup([1], [-1]), "table_id"),
        (lambda m: m.find_or_insert([1], [0], [0], counts=[-1]), "counts"),
        (lambda m: m.lookup([1], [0], [0], counts=[-1]), "counts"),
        (lambda m: m.find_or_insert([1, 2], [0], [0]), "table ids"),
        (lambda m: m.find_or_insert([1], [0], [0, 0]), "score args"),
        (lambda m: m.find_or_insert([1], [0], [0], counts=[1, 1]), "counts"),
        (lambda m: m.insert_or_assign([1], [0], [[0, 0]]), "words"),
        (lambda m: m.insert_or_assign([1, 2], [0, 0], [[0]]), "score rows"),
        (lambda m: m.export(1), "table_id"),
        (lambda m: m.export(0, begin=0, end=CAP + 1), "slot range"),
        (lambda m: m.rehash(0, CAP + 8), "multiple"),
        (lambda m: m.find_or_insert([2**63], [0], [0]), "int64"),
    ],
)
def test_invalid_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call(one_table(STEP))


def test_invalid_construction_raises():
    with pytest.raises(ValueError, match="multiple of 16"):
        TableModel([24], [8], [STEP], 1)
    with pytest.raises(ValueError, match="multiple of bucket_width"):
        TableModel([40], [16], [STEP], 1)
    with pytest.raises(ValueError, match="2 score words"):
        TableModel([32], [16], [TIMESTAMP_LFU], 1)
    with pytest.raises(ValueError, match="policy"):
        TableModel([32], [16], [6], 1)
    with pytest.raises(ValueError, match="one length"):
        TableModel([32, 32], [16], [STEP], 1)
