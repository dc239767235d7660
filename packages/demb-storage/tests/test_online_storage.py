"""The storage pieces of online training: the settled clock of current_scores, the recorded-key
buffers (compaction, per-table pops, slots of the last record), and slot writes (checked against
each key's home bucket from demb_planner before anything is written; keys that moved leave their
old slot; sizes follow)."""

from __future__ import annotations

import pytest
import torch
from demb_kernels.table import ScorePolicy
from demb_planner import home_slots
from demb_storage import (
    KeyBuffer,
    ScoredHashTable,
    ScoreStrategy,
    SlotWriteBatch,
    SlotWrites,
    TableConfig,
    TableConfigError,
    clear_slots,
)
from demb_storage._scores import settled_clock
from demb_storage.slot_writes import batch_checks, home_buckets


def test_the_settled_clock_waits_for_the_clock_to_move():
    readings = iter([7, 7, 7, 8])
    calls = []

    def now(count: int) -> torch.Tensor:
        calls.append(count)
        return torch.tensor([next(readings)])

    assert settled_clock(now, settle=True) == 8  # 7 read, then read until past 7: 7 + 1
    assert len(calls) == 4
    assert settled_clock(lambda c: torch.tensor([5]), settle=False) == 5


def test_current_scores_per_policy():
    configs = [
        TableConfig(dim=2, max_capacity=32, bucket_capacity=16, score_strategy=s)
        for s in (ScoreStrategy.STEP, ScoreStrategy.CUSTOMIZED, ScoreStrategy.LFU)
    ]
    table = ScoredHashTable(configs)
    table.set_score(1, 40)
    assert table.current_scores() == [1, 40, 0]
    keys = torch.tensor([1, 2, 3])
    table.find_or_insert(keys, torch.tensor([0, 1, 2]))
    assert table.current_scores() == [2, 40, 0]
    assert table.index.policy_list[0] is ScorePolicy.STEP


def test_key_buffer_pops_one_table_and_keeps_the_last_slot():
    buf = KeyBuffer(2)
    for i in range(70):  # past the compaction threshold
        buf.add(torch.tensor([i % 5, -1]), torch.tensor([i % 2, 0]), torch.tensor([i, 99]))
    keys, slots = buf.pop_with_slots(0)
    assert keys.tolist() == [0, 1, 2, 3, 4]
    # key k of table 0 was last recorded at the largest even i with i % 5 == k
    assert slots.tolist() == [max(i for i in range(0, 70, 2) if i % 5 == k) for k in range(5)]
    assert buf.pop(0).numel() == 0
    assert buf.pop(1).tolist() == [0, 1, 2, 3, 4]
    assert len(buf) == 0


def _table(capacity: int = 64, bucket: int = 16) -> ScoredHashTable:
    return ScoredHashTable(
        [TableConfig(dim=2, max_capacity=capacity, bucket_capacity=bucket, state_dim=1)]
    )


def _slot_in_home(key: int, capacity: int = 64, bucket: int = 16, offset: int = 0) -> int:
    home = int(home_slots([key], capacity, bucket).bucket[0])
    return home * bucket + offset


def test_slot_writes_put_keys_at_their_slots():
    table = _table()
    keys = torch.tensor([11, 12, 13])
    slots = torch.tensor([_slot_in_home(11, offset=3), _slot_in_home(12, offset=5), -1])
    slots[2] = _slot_in_home(13, offset=7)
    writes = SlotWrites.check(table, 0, keys, slots)
    words = torch.tensor([[5, 6, 7]])
    taken = writes.apply(words)
    assert taken.tolist() == [True, True, True]
    assert table.find(keys, torch.zeros(3, dtype=torch.int64)).tolist() == slots.tolist()
    assert table.size(0) == 3
    ex = table.export(0)
    assert dict(zip(ex.keys.tolist(), ex.scores[:, 0].tolist(), strict=True)) == {
        11: 5,
        12: 6,
        13: 7,
    }
    # key 11 moves to another slot of its bucket; 12 stays (its row is its own)
    moved = torch.tensor([_slot_in_home(11, offset=9), slots[1]])
    taken = SlotWrites.check(table, 0, keys[:2], moved).apply(torch.tensor([[8, 9]]))
    assert taken.tolist() == [True, False]
    assert table.find(keys[:2], torch.zeros(2, dtype=torch.int64)).tolist() == moved.tolist()
    assert table.size(0) == 3
    assert clear_slots(table, 0, torch.tensor([moved[0], slots[0]])) == 1  # one held a key
    assert table.size(0) == 2


@pytest.mark.parametrize(
    ("keys", "slots", "match"),
    [
        ([11], [64], "outside"),
        ([11, 11], [0, 1], "repeated keys"),
        ([-1], [0], "empty key"),
        ([11], ["other bucket"], "lives in bucket"),
    ],
)
def test_bad_slot_writes_raise_and_write_nothing(keys, slots, match):
    table = _table()
    if slots == ["other bucket"]:
        slots = [(_slot_in_home(11) + 16) % 64]
    with pytest.raises(TableConfigError, match=match):
        SlotWrites.check(table, 0, torch.tensor(keys), torch.tensor(slots))
    assert table.size(0) == 0
    assert (table.index.keys == -1).all()


@pytest.mark.parametrize("capacity", [16, 64 * 3, 1 << 20, 3 * (1 << 30), (1 << 40) + 128])
def test_home_buckets_are_the_planners_home_slots(capacity):
    gen = torch.Generator().manual_seed(capacity % 1000)
    keys = torch.cat(
        [
            torch.randint(-(2**63), 2**63 - 1, (4000,), generator=gen, dtype=torch.int64),
            torch.tensor([0, 1, -2, 2**63 - 1, -(2**63)]),
        ]
    )
    width = 16 if capacity % 128 else 128
    bucket, digest = home_buckets(keys, capacity, width)
    want = home_slots(keys.numpy(), capacity, width)
    assert bucket.tolist() == want.bucket.tolist()
    assert digest.tolist() == want.digest.tolist()


def _three_tables() -> ScoredHashTable:
    return ScoredHashTable(
        [
            TableConfig(dim=2, max_capacity=64, bucket_capacity=16, state_dim=1),
            TableConfig(dim=2, max_capacity=128, bucket_capacity=32, state_dim=1),
            TableConfig(dim=2, max_capacity=64, bucket_capacity=16, state_dim=1),
        ]
    )


def _parts(gen: torch.Generator, keys_per_table: int = 12):
    """Writes into tables 2 and 0 (out of order): the same keys in both tables, each at a
    distinct slot of its home bucket, some already in the table at another slot."""
    keys = torch.randperm(500, generator=gen)[:keys_per_table]
    parts = []
    for t, (capacity, bucket) in [(2, (64, 16)), (0, (64, 16))]:
        used: set[int] = set()
        slots = []
        for k in keys.tolist():
            offset = int(torch.randint(0, bucket, (1,), generator=gen))
            while (slot := _slot_in_home(k, capacity, bucket, offset)) in used:
                offset = (offset + 1) % bucket
            used.add(slot)
            slots.append(slot)
        parts.append((t, keys.clone(), torch.tensor(slots)))
    return parts


@pytest.mark.parametrize("seed", range(5))
def test_a_batch_of_tables_writes_as_each_table_alone(seed):
    """SlotWriteBatch over several tables leaves the index (keys, digests, scores, sizes) and
    reports the taken-over slots exactly as SlotWrites table by table."""
    gen = torch.Generator().manual_seed(seed)
    one, many = _three_tables(), _three_tables()
    for table in (one, many):  # some keys already held elsewhere in their bucket
        first = _parts(torch.Generator().manual_seed(seed + 100))
        for t, k, s in first:
            SlotWrites.check(table, t, k[:6], s[:6]).apply(torch.ones((1, 6), dtype=torch.int64))
    parts = _parts(gen)
    words = [torch.randint(0, 1000, (1, len(k)), generator=gen) for _, k, _ in parts]
    taken_one = [
        SlotWrites.check(one, t, k, s).apply(w) for (t, k, s), w in zip(parts, words, strict=True)
    ]
    batch = SlotWriteBatch.check(many, parts)
    assert batch is not None
    taken = batch.apply(torch.cat(words, dim=1))
    for i, expected in enumerate(taken_one):
        assert torch.equal(taken[batch.part(i)], expected)
        assert torch.equal(batch.slots[batch.part(i)], parts[i][2])
    for name in ("keys", "digests", "scores", "sizes"):
        assert torch.equal(getattr(many.index, name), getattr(one.index, name)), name


@pytest.mark.parametrize("fault", ["repeated key", "empty key", "outside", "other bucket"])
def test_a_bad_part_fails_the_batch_check_and_its_own_check_names_it(fault):
    table = _three_tables()
    parts = _parts(torch.Generator().manual_seed(7))
    t, keys, slots = parts[1]
    if fault == "repeated key":
        keys[3] = keys[2]
        slots[3] = _slot_in_home(int(keys[2]), 64, 16, (int(slots[2]) + 1) % 16)
    elif fault == "empty key":
        keys[0] = -1
    elif fault == "outside":
        slots[0] = 64
    else:
        slots[0] = (slots[0] + 16) % 64
    assert SlotWriteBatch.check(table, parts) is None
    with pytest.raises(TableConfigError):
        SlotWrites.check(table, t, keys, slots)
    assert (table.index.keys == -1).all()


def test_pairs_that_mix_alike_fall_back_to_each_tables_check():
    """Key k in table 0 and key k ^ (2 << 52) in table 2 mix into one word: the tensor-op batch
    check (what CUDA runs) cannot tell them apart and raises its repeated-key flag, so the batch
    declines there and each table's check decides; the CPU kernel's check tells them apart.
    Either way the batch writes them."""
    table = _three_tables()
    k0 = 5
    k2 = k0 ^ (2 << 52)
    parts = [
        (0, torch.tensor([k0]), torch.tensor([_slot_in_home(k0)])),
        (2, torch.tensor([k2]), torch.tensor([_slot_in_home(k2)])),
    ]
    keys = torch.cat([k for _, k, _ in parts])
    ids = torch.tensor([0, 2])
    slots = torch.cat([s for _, _, s in parts])
    assert batch_checks(table.index, keys, ids, slots)[1] == [False, True, False, False, False]
    for t, k, s in parts:
        SlotWrites.check(table, t, k, s)
    batch = SlotWriteBatch.check(table, parts)  # the CPU kernel's check
    assert batch is not None
    batch.apply(torch.tensor([[1, 2]]))
    assert table.size(0) == 1
    assert table.size(2) == 1
    assert table.find(torch.tensor([k2]), torch.tensor([2])).tolist() == parts[1][2].tolist()
