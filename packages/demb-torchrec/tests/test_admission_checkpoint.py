"""Admission counters in checkpoints: a dump carries each table's counter (in its shard's
admit_keys / admit_counts parts, under the manifest's checksums), a load puts it back, so
training resumed from a checkpoint admits exactly what uninterrupted training admits; with
``counter=False`` the counts start again from zero (a load of a checkpoint without counters
warns). A probabilistic admitter's call count travels too."""

from __future__ import annotations

import warnings

import pytest
import torch
from demb_io import Checkpoint, FormatError
from demb_torchrec import (
    DynamicEmbDump,
    DynamicEmbeddingTables,
    DynamicEmbLoad,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
    KVCounter,
    ProbabilisticAdmissionStrategy,
)


def module():
    strategy = FrequencyAdmissionStrategy(3, KVCounter(256, bucket_capacity=16))
    options = [
        DynamicEmbTableOptions(dim=4, max_capacity=512, admit_strategy=strategy),
        DynamicEmbTableOptions(dim=4, max_capacity=512),
    ]
    return DynamicEmbeddingTables(
        options,
        table_names=["a", "b"],
        pooling_mode=DynamicEmbPoolingMode.SUM,
        optimizer="adam",
        learning_rate=0.05,
    )


def step(m, i):
    gen = torch.Generator().manual_seed(i)
    indices = torch.randint(0, 60, (2 * 16 * 3,), generator=gen)
    offsets = torch.arange(0, indices.numel() + 1, 3)
    m(indices, offsets).square().sum().backward()


def held(m, t):
    ex = m.tables.export(t)
    order = ex.keys.argsort()
    return ex.keys[order], ex.values[order]


def counter(m):
    keys, counts = m.admission.counter_of(0)[0].export(0)
    return dict(zip(keys.tolist(), counts.tolist(), strict=True))


def assert_same(a, b):
    for t in range(2):
        ka, va = held(a, t)
        kb, vb = held(b, t)
        assert torch.equal(ka, kb), t
        torch.testing.assert_close(va, vb, rtol=0, atol=0)
    assert counter(a) == counter(b)


@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("explicit", [False, True])
def test_resumed_training_admits_what_uninterrupted_training_admits(tmp_path, blocking, explicit):
    a = module()
    for i in range(4):
        step(a, i)
    assert counter(a)  # keys are waiting to be admitted
    args = {"counter": True} if explicit else {}
    handle = DynamicEmbDump(tmp_path / "ck", a, optim=True, blocking=blocking, **args)
    if handle is not None:
        step(a, 4)  # training goes on while the dump writes: the checkpoint is the call's state
        handle.wait()
    metas = Checkpoint(tmp_path / "ck").shards("model", "a")
    assert metas[0].admission_rows is not None
    assert metas[0].admission_rows > 0
    b = module()
    DynamicEmbLoad(tmp_path / "ck", b, optim=True, **args)
    b.step_counts.copy_(torch.tensor([4, 4]))  # Adam's steps travel with the dense state
    if handle is not None:
        step(b, 4)
    assert_same(a, b)
    for i in range(5, 9):
        step(a, i)
        step(b, i)
        assert_same(a, b)


def test_without_counters_counts_start_from_zero(tmp_path):
    a = module()
    for i in range(4):
        step(a, i)
    DynamicEmbDump(tmp_path / "ck", a, optim=True, counter=False)
    assert Checkpoint(tmp_path / "ck").shards("model", "a")[0].admission_rows is None
    b = module()
    step(b, 0)  # counts something before the load
    with pytest.warns(UserWarning, match="no admission counter"):
        DynamicEmbLoad(tmp_path / "ck", b, optim=True)
    assert counter(b) == {}
    c = module()
    step(c, 0)
    before = counter(c)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DynamicEmbLoad(tmp_path / "ck", c, optim=True, counter=False)  # leaves it alone
    assert counter(c) == before


def test_a_damaged_counter_part_fails_the_load_and_changes_nothing(tmp_path):
    a = module()
    for i in range(4):
        step(a, i)
    DynamicEmbDump(tmp_path / "ck", a, optim=True)
    (part,) = (tmp_path / "ck" / "model").glob("a.rank*.admit_counts")
    data = bytearray(part.read_bytes())
    data[3] ^= 0x40
    part.write_bytes(bytes(data))
    b = module()
    step(b, 0)
    before = (held(b, 0), held(b, 1), counter(b))
    with pytest.raises(FormatError):
        DynamicEmbLoad(tmp_path / "ck", b, optim=True)
    after = (held(b, 0), held(b, 1), counter(b))
    for x, y in zip(before[:2], after[:2], strict=True):
        assert torch.equal(x[0], y[0])
        assert torch.equal(x[1], y[1])
    assert before[2] == after[2]


def probabilistic_module():
    strategy = ProbabilisticAdmissionStrategy(0.3, seed=5)
    options = [DynamicEmbTableOptions(dim=4, max_capacity=512, admit_strategy=strategy)] * 2
    return DynamicEmbeddingTables(
        options,
        table_names=["a", "b"],
        pooling_mode=DynamicEmbPoolingMode.SUM,
        optimizer="sgd",
        learning_rate=0.05,
    )


@pytest.mark.parametrize("blocking", [True, False])
def test_resumed_probabilistic_admission_tosses_as_uninterrupted_training(tmp_path, blocking):
    """The admitter's call count travels in the shard metas (``admit_calls``): a resumed run
    tosses the same coins as an uninterrupted one; ``counter=False`` leaves it out."""
    a = probabilistic_module()
    for i in range(4):
        step(a, i)
    handle = DynamicEmbDump(tmp_path / "ck", a, optim=True, blocking=blocking)
    if handle is not None:
        step(a, 4)
        handle.wait()
    metas = [Checkpoint(tmp_path / "ck").shards("model", n)[0] for n in ("a", "b")]
    assert [m.admit_calls for m in metas] == [4, 4]
    b = probabilistic_module()
    DynamicEmbLoad(tmp_path / "ck", b, optim=True)
    if handle is not None:
        step(b, 4)
    for i in range(5, 12):
        step(a, i)
        step(b, i)
        for t in range(2):
            ka, va = held(a, t)
            kb, vb = held(b, t)
            assert torch.equal(ka, kb), (i, t)
            torch.testing.assert_close(va, vb, rtol=0, atol=0)
    DynamicEmbDump(tmp_path / "none", a, counter=False)
    assert Checkpoint(tmp_path / "none").shards("model", "a")[0].admit_calls is None
    c = probabilistic_module()
    DynamicEmbLoad(tmp_path / "none", c)  # nothing to restore: the count stays
    assert c.admission.admitter_of(0).calls == 0
