"""Argument errors of the table ops name what is wrong, and leave the index unchanged."""

from __future__ import annotations

import pytest
import torch
from demb_kernels import table as ops
from demb_kernels.table import InsertStatus, ScorePolicy, TableIndex


def make() -> TableIndex:
    index = TableIndex.create([32, 64], [16, 32], [ScorePolicy.LFU, ScorePolicy.STEP])
    ops.find_or_insert(index, torch.arange(10), torch.tensor([0, 1] * 5), torch.tensor([0, 1]))
    return index


def snapshot(index: TableIndex) -> list[torch.Tensor]:
    return [t.clone() for t in (index.keys, index.digests, index.scores, index.sizes)]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacities": [40]}, r"capacities\[0\]=40: must be a multiple of its bucket width 16"),
        ({"bucket_widths": [24]}, r"bucket_widths\[0\]=24: must be a multiple of 16"),
        ({"capacities": [0]}, r"capacities\[0\]=0: must be a positive integer"),
        ({"policies": [9]}, r"policies\[0\]=9: not a ScorePolicy"),
        ({"policies": [ScorePolicy.TIMESTAMP_LFU], "score_words": 1}, "score_words=1"),
        ({"capacities": [32, 32]}, "one entry per table"),
    ],
)
def test_create_names_the_bad_argument(kwargs, match):
    args = {"capacities": [32], "bucket_widths": [16], "policies": [ScorePolicy.LFU]} | kwargs
    with pytest.raises(ValueError, match=match):
        TableIndex.create(**args)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda ix: ops.find(ix, torch.tensor([1.0]), torch.tensor([0])), TypeError, "keys"),
        (lambda ix: ops.find(ix, torch.tensor([1]), torch.tensor([0.0])), TypeError, "table_ids"),
        (
            lambda ix: ops.find_or_insert(
                ix, torch.tensor([3, -1]), torch.tensor([0, 0]), torch.tensor([0, 1])
            ),
            ValueError,
            r"keys\[1\] is -1, the empty-key sentinel",
        ),
        (
            lambda ix: ops.find_or_insert(
                ix, torch.tensor([3]), torch.tensor([2]), torch.tensor([0, 1])
            ),
            ValueError,
            r"table_ids\[0\]=2 is out of range for an index of 2 tables",
        ),
        (
            lambda ix: ops.find_or_insert(
                ix, torch.tensor([3]), torch.tensor([0]), torch.tensor([0, 1]), torch.tensor([-2])
            ),
            ValueError,
            r"counts\[0\]=-2 is negative",
        ),
        (
            lambda ix: ops.find_or_insert(
                ix, torch.tensor([3, 4]), torch.tensor([0]), torch.tensor([0, 1])
            ),
            ValueError,
            "same length",
        ),
        (
            lambda ix: ops.find_or_insert(
                ix, torch.tensor([3]), torch.tensor([0]), torch.tensor([0])
            ),
            ValueError,
            r"score_args must be \(T,\)",
        ),
        (
            lambda ix: ops.insert_or_assign(
                ix, torch.tensor([3]), torch.tensor([0]), torch.zeros(2, 1, dtype=torch.int64)
            ),
            ValueError,
            r"scores must be \(W, N\)",
        ),
        (lambda ix: ops.erase(ix, torch.tensor([-1]), torch.tensor([0])), ValueError, "sentinel"),
        (lambda ix: ops.export(ix, 0, 5, 40), ValueError, "slot range"),
        (lambda ix: ops.export(ix, 3), ValueError, "table_id=3"),
        (lambda ix: ops.export(ix, 0, score_word=1), ValueError, "score_word=1"),
    ],
)
def test_bad_batches_raise_and_leave_the_index_unchanged(call, error, match):
    index = make()
    before = snapshot(index)
    with pytest.raises(error, match=match):
        call(index)
    for a, b in zip(before, snapshot(index), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_rehash_that_cannot_fit_raises_and_keeps_the_old_index():
    index = TableIndex.create([64], [16], [ScorePolicy.STEP])
    ops.find_or_insert(
        index, torch.arange(40), torch.zeros(40, dtype=torch.int64), torch.tensor([1])
    )
    before = snapshot(index)
    with pytest.raises(ValueError, match="new_capacity=16"):
        ops.rehash(index, 0, 16)
    for a, b in zip(before, snapshot(index), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_duplicates_in_a_batch_share_one_slot():
    index = TableIndex.create([64], [16], [ScorePolicy.LFU])
    res = ops.find_or_insert(
        index, torch.tensor([5, 6, 5, 5]), torch.zeros(4, dtype=torch.int64), torch.tensor([0])
    )
    assert res.status.tolist() == [
        InsertStatus.INSERTED,
        InsertStatus.INSERTED,
        InsertStatus.HIT,
        InsertStatus.HIT,
    ]
    assert res.slots[0] == res.slots[2] == res.slots[3]
    ex = ops.export(index, 0)
    assert dict(zip(ex.keys.tolist(), ex.scores[0].tolist(), strict=True)) == {5: 3, 6: 1}


def test_timestamp_is_monotone():
    a = int(ops.timestamp("cpu"))
    b = int(ops.timestamp("cpu"))
    assert 0 < a <= b


def test_timestamp_copies_one_reading():
    before = int(ops.timestamp("cpu"))
    many = ops.timestamp("cpu", 7)
    assert many.shape == (7,)
    assert many.dtype == torch.int64
    assert len(set(many.tolist())) == 1
    assert int(many[0]) >= before
    with pytest.raises(ValueError, match="count"):
        ops.timestamp("cpu", 0)


def test_find_or_insert_rows_says_whether_every_key_was_found():
    """all_hit is True exactly when every status is HIT: an empty batch, a batch of present
    keys with duplicates; False with one new key or one failed insert."""
    index = TableIndex.create([64], [16], [ScorePolicy.STEP])
    zeros = torch.zeros(3, dtype=torch.int64)
    res, all_hit, _ = ops.find_or_insert_rows(
        index, torch.tensor([5, 6, 5]), zeros, torch.tensor([1])
    )
    assert not all_hit
    assert res.status.tolist() == [InsertStatus.INSERTED, InsertStatus.INSERTED, InsertStatus.HIT]
    res, all_hit, _ = ops.find_or_insert_rows(
        index, torch.tensor([6, 5, 6]), zeros, torch.tensor([2])
    )
    assert all_hit
    assert res.status.tolist() == [InsertStatus.HIT] * 3
    empty = torch.zeros(0, dtype=torch.int64)
    assert ops.find_or_insert_rows(index, empty, empty, torch.tensor([3])).all_hit
    full = TableIndex.create([16], [16], [ScorePolicy.NO_EVICTION])
    keys = torch.arange(17)
    res, all_hit, _ = ops.find_or_insert_rows(
        full, keys, torch.zeros(17, dtype=torch.int64), torch.tensor([1])
    )
    assert int((res.status == InsertStatus.FAILED).sum()) == 1
    assert not all_hit
    res, all_hit, _ = ops.find_or_insert_rows(
        full, keys[:16], torch.zeros(16, dtype=torch.int64), torch.tensor([2])
    )
    assert all_hit


def test_find_or_insert_rows_reads_the_rows_when_every_key_is_found():
    """find_or_insert_rows with a gather is find_or_insert_rows without one (on a twin index)
    plus, when all keys are found, gather_table_rows of the slots found; rows None otherwise.
    A bad request raises before the index changes."""
    from demb_kernels.lookup import gather_table_rows

    index, twin = make(), make()
    values = [torch.randn(32, 6), torch.randn(64, 6)]
    keys, tids = torch.tensor([3, 8, 3]), torch.tensor([1, 0, 1])
    inverse = torch.tensor([2, 0, 1, 1, 0])
    for k, t, hit in ((keys, tids, True), (torch.tensor([3, 99]), torch.tensor([1, 0]), False)):
        args = torch.tensor([4, 5])
        res, all_hit, rows = ops.find_or_insert_rows(
            index, k, t, args, gather=ops.RowGather(values, inverse[inverse < k.numel()], 4)
        )
        expected, expected_hit, _ = ops.find_or_insert_rows(twin, k, t, args)
        assert all_hit == expected_hit == hit
        for a, b in zip(res, expected, strict=True):
            assert torch.equal(a, b)
        assert all(torch.equal(a, b) for a, b in zip(snapshot(index), snapshot(twin), strict=True))
        if hit:
            inv = inverse[inverse < k.numel()]
            assert torch.equal(rows, gather_table_rows(values, res.slots, t, inv, 4))
        else:
            assert rows is None
    before = snapshot(index)
    with pytest.raises(TypeError, match="inverse must be int64"):
        ops.find_or_insert_rows(
            index, keys, tids, torch.tensor([6, 7]), gather=ops.RowGather(values, inverse.int(), 4)
        )
    with pytest.raises(ValueError, match="values: 1 buffers for an index of 2 tables"):
        ops.find_or_insert_rows(
            index, keys, tids, torch.tensor([6, 7]), gather=ops.RowGather(values[:1], inverse, 4)
        )
    assert all(torch.equal(a, b) for a, b in zip(snapshot(index), before, strict=True))
