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
    SlotWrites,
    TableConfig,
    TableConfigError,
    clear_slots,
)
from demb_storage._scores import settled_clock
from demb_storage.slot_writes import home_buckets


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
