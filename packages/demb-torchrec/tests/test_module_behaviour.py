"""The table module's modes and edge cases: eval inserts nothing, empty batches, evicted keys,
scores, frozen tables, the weighted-SUM error paths and bad configurations."""

from __future__ import annotations

import demb_torchrec._direct as direct
import demb_torchrec._find_or_insert as fi
import demb_torchrec.batched_tables as bt
import pytest
import torch
from demb_optim import Adam
from demb_storage import InsertFailedError
from demb_torchrec import (
    DynamicEmbCheckMode,
    DynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)
from demb_torchrec.stats import table_memory

CONST = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.5)


def tables(mode=DynamicEmbPoolingMode.SUM, optimizer="sgd", device="cpu", **options):
    opts = {"dim": 4, "max_capacity": 256, "bucket_capacity": 128, "initializer_args": CONST}
    opts.update(options)
    extra = {"learning_rate": 0.1} if isinstance(optimizer, str) else {}
    return DynamicEmbeddingTables(
        [DynamicEmbTableOptions(**opts)],
        pooling_mode=mode,
        device=device,
        optimizer=optimizer,
        **extra,
    )


def keys_in(module):
    return sorted(module.tables.export(0).keys.tolist())


def test_eval_inserts_nothing_and_reads_eval_initializer_args():
    module = tables(
        eval_initializer_args=DynamicEmbInitializerArgs(
            mode=DynamicEmbInitializerMode.CONSTANT, value=-2.0
        )
    )
    module(torch.tensor([1, 2]), torch.tensor([0, 2]))  # training: inserts 1 and 2
    module.eval()
    out = module(torch.tensor([1, 3]), torch.tensor([0, 1, 2]))
    assert keys_in(module) == [1, 2]
    torch.testing.assert_close(out, torch.tensor([[0.5] * 4, [-2.0] * 4]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_eval_without_pooling_fills_missing_keys_and_checks_the_batch(device):
    """The NONE eval path (no dedup; the batch's checks run in the lookup's op, before it)."""
    minus_two = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=-2.0)
    module = tables(mode=DynamicEmbPoolingMode.NONE, device=device, eval_initializer_args=minus_two)

    def batch(*values):
        return torch.tensor(values, device=device)

    module(batch(1, 2), batch(0, 2))  # training: inserts 1 and 2
    module.eval()
    out = module(batch(1, 3, 2), batch(0, 1, 3))
    assert keys_in(module) == [1, 2]
    torch.testing.assert_close(out.cpu(), torch.tensor([[0.5] * 4, [-2.0] * 4, [0.5] * 4]))
    with pytest.raises(ValueError, match="offsets: must start at 0, never decrease and end at 2"):
        module(batch(1, 2), batch(0, 1))
    with pytest.raises(ValueError, match="indices: contains -1"):
        module(batch(1, -1), batch(0, 2))


def test_eval_default_reads_zeros_for_missing_keys():
    module = tables()
    module.eval()
    out = module(torch.tensor([3, 4]), torch.tensor([0, 2]))
    assert keys_in(module) == []
    torch.testing.assert_close(out, torch.zeros(1, 4))


@pytest.mark.parametrize("mode", list(DynamicEmbPoolingMode))
def test_empty_batches(mode):
    module = tables(mode)
    out = module(torch.zeros(0, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
    expected = (0, 4) if mode is DynamicEmbPoolingMode.NONE else (3, 4)
    assert out.shape == expected
    assert not out.any()
    out = module(torch.zeros(0, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    assert out.shape[0] == 0


def test_evicted_keys_come_back_with_a_fresh_row_and_state():
    module = tables(
        optimizer="adagrad",
        max_capacity=16,
        bucket_capacity=16,
        score_strategy=DynamicEmbScoreStrategy.STEP,
    )
    first = torch.arange(16)
    out = module(first, torch.tensor([0, 16]))
    out.backward(torch.ones_like(out))
    trained = module.tables.read(0, module.tables.find(torch.tensor([0]), torch.tensor([0])))
    assert not torch.equal(trained[0, :4], torch.full((4,), 0.5))
    # one bucket of 16: 16 new keys evict all the old ones (lowest STEP score first)
    module(torch.arange(100, 116), torch.tensor([0, 16]))
    assert keys_in(module) == list(range(100, 116))
    module(torch.tensor([0]), torch.tensor([0, 1]))
    row = module.tables.read(0, module.tables.find(torch.tensor([0]), torch.tensor([0])))
    torch.testing.assert_close(row[0], torch.tensor([0.5] * 4 + [0.0] * 4))


def test_lfu_scores_count_occurrences_or_frequency_counters():
    module = tables(score_strategy=DynamicEmbScoreStrategy.LFU)
    module(torch.tensor([1, 1, 2]), torch.tensor([0, 3]))
    module(torch.tensor([1, 2]), torch.tensor([0, 2]), frequency_counters=torch.tensor([5, 1]))
    ex = module.tables.export(0)
    scores = dict(zip(ex.keys.tolist(), ex.scores[:, 0].tolist(), strict=True))
    assert scores == {1: 7, 2: 2}


def test_a_batch_deduplicated_without_counts_says_so_when_asked_for_them():
    """dedup() always counts; a batch whose counts were not made (the CUDA one-sync forward
    of tables that count nothing) raises a ValueError naming them, not a None error."""
    from demb_torchrec._dedup import dedup

    batch = dedup(torch.tensor([5, 5, 7]), torch.tensor([0, 2, 3]), torch.tensor([0]), 1, 2)
    assert batch.occurrence_counts().tolist() == [2, 1]
    with pytest.raises(ValueError, match="counts: this batch was deduplicated without counts"):
        batch._replace(counts=None).occurrence_counts()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_no_eviction_holds_100_keys_of_init_capacity_128_in_128_rows(device):
    """The spec's row_capacity example: the table's value rows (with their optimizer state)
    stay at init_capacity until its keys outnumber them, and each key keeps its row."""
    module = tables(
        optimizer="adam",
        device=device,
        max_capacity=128,
        init_capacity=128,
        score_strategy=DynamicEmbScoreStrategy.NO_EVICTION,
    )
    ids = torch.arange(100, device=device) * 7919
    for chunk in ids.split(30):
        module(chunk, torch.arange(chunk.numel() + 1, device=device)).sum().backward()
    assert module.tables.size(0) == 100
    assert module.tables.capacity(0) == 128
    assert module.tables.values[0].shape[0] == 128
    used = table_memory(torch.nn.ModuleDict({"m": module}))
    row_bytes = module.tables.values[0][0].nbytes
    index_bytes = 128 * (8 + 1 + 8)  # key, digest, one score word a slot
    assert sum(m.total for c in used.values() for m in c.values()) == 128 * row_bytes + index_bytes
    before = module.tables.read(0, module.tables.find(ids, torch.zeros_like(ids)))
    more = torch.arange(100, 160, device=device) * 7919  # 160 keys > 128 rows: it doubles
    module(more, torch.arange(more.numel() + 1, device=device)).sum().backward()
    assert module.tables.capacity(0) == 256
    assert module.tables.size(0) == 160
    after = module.tables.read(0, module.tables.find(ids, torch.zeros_like(ids)))
    torch.testing.assert_close(after, before, rtol=0, atol=0)


def test_step_scores_advance_per_forward():
    module = tables(score_strategy=DynamicEmbScoreStrategy.STEP)
    module(torch.tensor([1]), torch.tensor([0, 1]))
    module(torch.tensor([2]), torch.tensor([0, 1]))
    module(torch.tensor([1]), torch.tensor([0, 1]))
    ex = module.tables.export(0)
    assert dict(zip(ex.keys.tolist(), ex.scores[:, 0].tolist(), strict=True)) == {1: 3, 2: 2}


def test_customized_scores_come_from_set_score():
    module = tables(score_strategy=DynamicEmbScoreStrategy.CUSTOMIZED)
    module.set_score("table_0", 42)
    module(torch.tensor([1]), torch.tensor([0, 1]))
    assert module.tables.export(0).scores[:, 0].tolist() == [42]


def test_a_table_built_with_training_false_has_no_state_and_cannot_train():
    module = tables(optimizer=Adam(), training=False)
    assert module.tables.values[0].shape[1] == 4
    with pytest.raises(RuntimeError, match="training=False"):
        module(torch.tensor([1]), torch.tensor([0, 1]))
    with torch.no_grad():
        module(torch.tensor([1]), torch.tensor([0, 1]))
    module.eval()
    module(torch.tensor([1]), torch.tensor([0, 1]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("mode", list(DynamicEmbPoolingMode))
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_gradient_is_rejected_and_no_row_changes(mode, bad, device):
    module = tables(mode=mode, optimizer="adam", device=device)
    indices, offsets = torch.tensor([1, 2, 1], device=device), torch.tensor([0, 3], device=device)
    out = module(indices, offsets)
    before = module.tables.values[0].clone()
    grad = torch.ones_like(out)
    grad[-1, 2] = bad
    with pytest.raises(ValueError, match="NaN or infinite"):
        out.backward(grad)
    assert torch.equal(module.tables.values[0], before)
    assert module.steps == [0]
    module(indices, offsets).backward(torch.ones_like(out))  # a good step still trains
    assert not torch.equal(module.tables.values[0], before)
    assert module.steps == [1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("mode", list(DynamicEmbPoolingMode))
def test_unchecked_gradients_train_the_same_rows_and_let_a_nan_through(mode, device):
    """check_gradients=False: the same tables, bit for bit, as the checked module over steps
    whose keys have 1 to 150 entries (on CUDA without pooling the update sums the short keys
    itself); a NaN is not rejected: its key's row takes it and the step counts."""
    gen = torch.Generator().manual_seed(21)
    twins = [
        DynamicEmbeddingTables(
            [DynamicEmbTableOptions(dim=8, max_capacity=512, bucket_capacity=128)] * 2,
            pooling_mode=mode, device=device, optimizer="adam", learning_rate=0.05,
            check_gradients=check,
        )
        for check in (True, False)
    ]  # fmt: skip
    for step in range(4):
        indices = torch.cat([torch.randint(0, 60, (500,), generator=gen), torch.zeros(150)])
        indices = indices[torch.randperm(650, generator=gen)].long()
        lengths = torch.ones(650, dtype=torch.long)
        if mode is not DynamicEmbPoolingMode.NONE:
            lengths = torch.randint(1, 6, (130,), generator=gen)
            indices = indices[: int(lengths.sum())]
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        batch = (indices.to(device), offsets.to(device))
        outs = [m(*batch) for m in twins]
        grad = torch.randn(outs[0].shape, generator=gen).to(device)
        if step == 3:
            grad[0, 1] = float("nan")
            with pytest.raises(ValueError, match="NaN or infinite"):
                outs[0].backward(grad)
            outs[1].backward(grad)
            assert twins[1].tables.values[0].isnan().any()
            assert twins[1].steps == [4, 4]
            break
        for out in outs:
            out.backward(grad)
        for a, b in zip(twins[0].tables.values, twins[1].tables.values, strict=True):
            assert torch.equal(a, b)
    assert twins[0].steps == [3, 3]


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("mean", "only SUM pooling takes weights"),
        ("dtype", "must be float32"),
        ("numel", "3 weights for 2 indices"),
        ("grad", "not differentiable"),
        ("counters", "pass one of them"),
    ],
)
def test_weighted_sum_errors(case, match):
    mode = DynamicEmbPoolingMode.MEAN if case == "mean" else DynamicEmbPoolingMode.SUM
    module = tables(mode)
    weights = torch.ones(
        3 if case == "numel" else 2, dtype=torch.float64 if case == "dtype" else torch.float32
    )
    weights.requires_grad_(case == "grad")
    counters = torch.ones(2, dtype=torch.int64) if case == "counters" else None
    with pytest.raises(ValueError, match=match):
        module(
            torch.tensor([1, 2]),
            torch.tensor([0, 2]),
            pooling_weights=weights,
            frequency_counters=counters,
        )


def test_weights_that_require_grad_are_fine_under_no_grad():
    module = tables()
    weights = torch.tensor([1.0, 2.0], requires_grad=True)
    with torch.no_grad():
        out = module(torch.tensor([1, 2]), torch.tensor([0, 2]), pooling_weights=weights)
    torch.testing.assert_close(out, torch.full((1, 4), 1.5))


def test_bad_configurations_are_named():
    one = [DynamicEmbTableOptions(dim=4, max_capacity=128)]
    with pytest.raises(TypeError, match="beta1: not hyper-parameters of sgd"):
        DynamicEmbeddingTables(one, device="cpu", beta1=0.9)
    with pytest.raises(ValueError, match="learning_rate"):
        DynamicEmbeddingTables(one, device="cpu", learning_rate=-1.0)
    with pytest.raises(ValueError, match="caching=True sizes its device cache"):
        tables(caching=True)
    with pytest.raises(ValueError, match="score_function"):  # only with (TIMESTAMP, LFU)
        tables(score_function=lambda s, now: 0.0)
    with pytest.raises(ValueError, match="max_capacity"):
        DynamicEmbeddingTables([DynamicEmbTableOptions(dim=4)], device="cpu")
    with pytest.raises(ValueError, match="NONE needs"):
        DynamicEmbeddingTables(
            [*one, DynamicEmbTableOptions(dim=8, max_capacity=128)],
            pooling_mode=DynamicEmbPoolingMode.NONE,
            device="cpu",
        )


def test_index_type_is_what_indices_must_be():
    module = tables(index_type=torch.int32)
    out = module(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 2]))
    assert out.shape == (1, 4)
    with pytest.raises(TypeError, match=r"indices: torch\.int64, but the tables' index_type"):
        module(torch.tensor([1, 2]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="index_type"):
        DynamicEmbeddingTables(
            [
                DynamicEmbTableOptions(dim=4, max_capacity=128, index_type=torch.int32),
                DynamicEmbTableOptions(dim=4, max_capacity=128, index_type=torch.int64),
            ],
            device="cpu",
        )


def test_bad_batches_are_named():
    module = tables()
    with pytest.raises(TypeError, match="indices: must be a 1-D int64 or int32"):
        module(torch.tensor([1.0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="offsets: must start at 0, never decrease and end at 2"):
        module(torch.tensor([1, 2]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="indices: contains -1"):
        module(torch.tensor([1, -1]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="frequency_counters: contains a negative count"):
        module(torch.tensor([1, 2]), torch.tensor([0, 2]), frequency_counters=torch.tensor([1, -2]))
    with pytest.raises(ValueError, match="with 1 decreases"):
        module(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 1, 3]))


@pytest.mark.parametrize("check", list(DynamicEmbCheckMode))
def test_keys_that_find_no_slot_follow_the_safe_check_mode(check):
    """200 new keys for one 128-slot bucket: no key of a batch evicts another, so 72 fail;
    they count in failed_inserts, read zeros (IGNORE / WARNING) or raise (ERROR)."""
    module = tables(mode=DynamicEmbPoolingMode.NONE, max_capacity=128, safe_check_mode=check)
    keys = torch.arange(200)
    if check is DynamicEmbCheckMode.ERROR:
        with pytest.raises(InsertFailedError, match="72 of 200 keys"):
            module(keys, torch.arange(201))
        return
    if check is DynamicEmbCheckMode.WARNING:
        with pytest.warns(UserWarning, match="72 of 200 keys could not be inserted"):
            out = module(keys, torch.arange(201))
    else:
        out = module(keys, torch.arange(201))
    assert module.tables.failed_inserts.tolist() == [72]
    assert len(keys_in(module)) == 128
    zero_rows = (out == 0).all(1)
    assert int(zero_rows.sum()) == 72
    assert int((out[~zero_rows] == 0.5).all(1).sum()) == 128


def test_a_batch_of_known_keys_initializes_and_counts_nothing(monkeypatch):
    """When every key is already in the table the forward skips the new-row initialization
    and the failure count (nothing to do); after a batch found whole its rows come from
    find_or_insert (no gather of its own). The rows it returns are the trained ones. With one
    new key all run again."""
    calls = {"init": 0, "count": 0, "gather": 0}
    real_init, real_count, real_gather = (
        fi.init_new_rows,
        bt.status_count_tensor,
        direct.gather_table_rows,
    )

    def gather(*args, **kwargs):
        calls["gather"] += 1
        return real_gather(*args, **kwargs)

    def init(*args, **kwargs):
        calls["init"] += 1
        return real_init(*args, **kwargs)

    def count(*args, **kwargs):
        calls["count"] += 1
        return real_count(*args, **kwargs)

    monkeypatch.setattr(fi, "init_new_rows", init)
    monkeypatch.setattr(bt, "status_count_tensor", count)
    monkeypatch.setattr(direct, "gather_table_rows", gather)
    module = tables(mode=DynamicEmbPoolingMode.NONE)
    offsets = torch.arange(4)
    out = module(torch.tensor([3, 1, 3]), offsets)
    assert calls == {"init": 1, "count": 1, "gather": 1}
    out.backward(torch.ones_like(out))
    again = module(torch.tensor([1, 3, 1]), offsets)  # the last batch had new keys: a gather
    assert calls == {"init": 1, "count": 1, "gather": 2}
    trained = 0.5 - 0.1 * torch.tensor([[1.0] * 4, [2.0] * 4, [1.0] * 4])  # SGD, lr 0.1
    torch.testing.assert_close(again, trained)
    again.backward(torch.ones_like(again))
    once_more = module(torch.tensor([3, 1]), torch.arange(3))  # rows from find_or_insert
    assert calls == {"init": 1, "count": 1, "gather": 2}
    # key 1 (0.4) had two occurrences, key 3 (0.3) one: both at 0.2 now
    torch.testing.assert_close(once_more, torch.full((2, 4), 0.2))
    once_more.backward(torch.ones_like(once_more))  # the rows read by find_or_insert train too
    torch.testing.assert_close(
        module(torch.tensor([1, 3]), torch.arange(3)), torch.full((2, 4), 0.1)
    )
    module(torch.tensor([1, 7, 3]), offsets)
    assert calls == {"init": 2, "count": 2, "gather": 3}
    assert keys_in(module) == [1, 3, 7]
