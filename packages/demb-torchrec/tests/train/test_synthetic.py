"""The built-in synthetic click stream: reproducible by step, Criteo-shaped, power-law ids that
drift, labels from a hidden model whose Bayes AUC is well above 0.5."""

from __future__ import annotations

import re

import pytest
import torch
from demb_torchrec.errors import ConfigError, InputError, InputTypeError
from demb_torchrec.train.batch import NUM_DENSE, NUM_SPARSE, ClickBatch, feature_names
from demb_torchrec.train.synthetic import (
    BASE_VOCAB_SIZES,
    DRIFTING_FEATURES,
    SyntheticClicks,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torchmetrics.functional.classification import binary_auroc


@pytest.fixture(scope="module")
def stream() -> SyntheticClicks:
    return SyntheticClicks(seed=0)


def _same(a: ClickBatch, b: ClickBatch) -> bool:
    return (
        torch.equal(a.dense, b.dense)
        and torch.equal(a.sparse, b.sparse)
        and torch.equal(a.labels, b.labels)
    )


def test_shapes_dtypes_and_values(stream: SyntheticClicks) -> None:
    b = stream.batch(3, 1000)
    assert len(b) == 1000
    assert b.dense.shape == (1000, NUM_DENSE)
    assert b.dense.dtype == torch.float32
    assert b.sparse.shape == (1000, NUM_SPARSE)
    assert b.sparse.dtype == torch.int64
    assert b.labels.shape == (1000,)
    assert b.labels.dtype == torch.float32
    assert bool((b.sparse >= 0).all())
    assert bool((b.dense >= 0).all())
    assert bool(torch.isfinite(b.dense).all())
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}
    # dense values are log1p of integer counts, with zeros (missing or count 0)
    counts = torch.expm1(b.dense.double())
    assert bool(((counts - counts.round()).abs() <= 1e-5 * (1 + counts)).all())
    assert bool((b.dense == 0).any(dim=0).sum() >= 5)
    assert feature_names() == [f"cat_{i}" for i in range(NUM_SPARSE)]


@settings(max_examples=8, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    step=st.integers(0, 10**9),
    batch_size=st.integers(1, 300),
)
def test_reproducible_in_any_order(seed: int, step: int, batch_size: int) -> None:
    a = SyntheticClicks(seed=seed, scale=0.1)
    b = SyntheticClicks(seed=seed, scale=0.1)
    first = a.batch(step, batch_size)
    b.batch(step + 1, 7)  # other calls in between change nothing
    b.eval_batch(step, batch_size)
    assert _same(first, b.batch(step, batch_size))
    assert _same(a.eval_batch(step, batch_size), b.eval_batch(step, batch_size))
    assert a.bias == b.bias


def test_steps_seeds_and_eval_differ(stream: SyntheticClicks) -> None:
    base = stream.batch(5, 512)
    assert not torch.equal(base.sparse, stream.batch(6, 512).sparse)
    assert not torch.equal(base.dense, stream.batch(6, 512).dense)
    ev = stream.eval_batch(5, 512)
    assert not torch.equal(base.sparse, ev.sparse)
    assert not torch.equal(base.dense, ev.dense)
    # an eval batch is no training batch of any nearby step either
    for step in range(0, 12):
        assert not torch.equal(stream.batch(step, 512).dense, ev.dense)
    other = SyntheticClicks(seed=1).batch(5, 512)
    assert not torch.equal(base.sparse, other.sparse)


def test_slice_is_rows(stream: SyntheticClicks) -> None:
    b = stream.batch(0, 100)
    s = b.slice(10, 30)
    assert len(s) == 20
    assert torch.equal(s.sparse, b.sparse[10:30])
    assert torch.equal(s.labels, b.labels[10:30])
    assert _same(ClickBatch.concat([b.slice(0, 10), b.slice(10, 100)]), b)


def test_power_law(stream: SyntheticClicks) -> None:
    b = stream.batch(0, 20_000)
    for f in (DRIFTING_FEATURES[0], 12):  # a large and a mid-size feature
        _, counts = torch.unique(b.sparse[:, f], return_counts=True)
        top = counts.sort(descending=True).values
        share = top[: max(1, len(top) // 100)].sum().item() / len(b)
        assert share > 0.3, (f, share)
        assert top[0].item() > 100 * top[len(top) // 2].item() or top[len(top) // 2] == 1


def test_vocabulary_sizes_and_scale() -> None:
    small = SyntheticClicks(scale=0.01, drift=0.0)
    assert small.vocab_sizes[8] == BASE_VOCAB_SIZES[8] == 3  # tiny features never scale
    assert small.vocab_sizes[2] == round(BASE_VOCAB_SIZES[2] * 0.01)
    b = small.batch(0, 20_000)
    for f in range(NUM_SPARSE):
        assert len(torch.unique(b.sparse[:, f])) <= small.vocab_sizes[f]
    sizes = [1, 2, *([5] * 24)]
    tiny = SyntheticClicks(vocab_sizes=sizes, drift=0.0)
    t = tiny.batch(0, 2000)
    assert [len(torch.unique(t.sparse[:, f])) for f in range(NUM_SPARSE)] == sizes


def test_drift(stream: SyntheticClicks) -> None:
    early, late = stream.batch(0, 20_000), stream.batch(20_000, 20_000)
    for f in DRIFTING_FEATURES[:3]:
        a, b = set(early.sparse[:, f].tolist()), set(late.sparse[:, f].tolist())
        assert 0 < len(a & b) < 0.5 * len(b), f  # partly the same ids
        assert len(b - a) > 0.5 * len(b), f  # many new ones
    # the most popular id has changed; stationary features keep their ids
    f = DRIFTING_FEATURES[0]
    assert torch.mode(early.sparse[:, f]).values != torch.mode(late.sparse[:, f]).values
    for f in (8, 19):  # 3 and 4 items, no drift
        assert set(early.sparse[:, f].tolist()) == set(late.sparse[:, f].tolist())
    # no drift: the same law at every step
    still = SyntheticClicks(drift=0.0)
    a = set(still.batch(0, 5000).sparse[:, f].tolist())
    assert a == set(still.batch(10**6, 5000).sparse[:, f].tolist())


def test_click_rate_and_oracle_auc(stream: SyntheticClicks) -> None:
    b = ClickBatch.concat([stream.eval_batch(s, 2500) for s in (0, 1000)])
    rate = b.labels.mean().item()
    assert 0.18 < rate < 0.32
    logits = stream.oracle_logits(b)
    assert logits.shape == (len(b),)
    assert logits.dtype == torch.float32
    # the labels follow the oracle: predicted and observed rates agree
    assert abs(torch.sigmoid(logits).mean().item() - rate) < 0.03
    auc = binary_auroc(logits, b.labels.long()).item()
    assert 0.7 < auc < 0.95
    # the training batches follow the same law
    t = stream.batch(7, 5000)
    assert binary_auroc(stream.oracle_logits(t), t.labels.long()).item() > 0.7


def test_click_rate_is_settable() -> None:
    s = SyntheticClicks(click_rate=0.05, scale=0.1)
    assert s.batch(0, 20_000).labels.mean().item() < 0.1


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"scale": 0.0}, "scale"),
        ({"scale": float("nan")}, "scale"),
        ({"drift": -0.5}, "drift"),
        ({"zipf_exponent": 0.0}, "zipf_exponent"),
        ({"click_rate": 1.0}, "click_rate"),
        ({"signal": -1.0}, "signal"),
        ({"vocab_sizes": [10] * 25}, "vocab_sizes"),
        ({"vocab_sizes": [10] * 25 + [0]}, "vocab_sizes[25]"),
    ],
)
def test_bad_parameters(kwargs: dict[str, object], name: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(name)):
        SyntheticClicks(**kwargs)  # type: ignore[arg-type]


def test_bad_calls(stream: SyntheticClicks) -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        stream.batch(0, 0)
    with pytest.raises(ConfigError, match="step"):
        stream.eval_batch(-1, 10)


def test_click_batch_checks() -> None:
    d, s, y = (
        torch.zeros(4, NUM_DENSE),
        torch.zeros(4, NUM_SPARSE, dtype=torch.int64),
        torch.zeros(4),
    )
    with pytest.raises(InputTypeError, match="sparse"):
        ClickBatch(d, s.int(), y)
    with pytest.raises(InputError, match="dense"):
        ClickBatch(d[:3], s, y)
    with pytest.raises(InputError, match="sparse"):
        ClickBatch(d, s[:, :5], y)
