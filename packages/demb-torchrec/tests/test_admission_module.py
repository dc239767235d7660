"""Admission in the table module: which missing keys a training forward inserts, the rows the
rejected ones read, that their gradients reach no row, that eval never admits, and the errors
and warnings of the admission options. References: a Python dict model of frequency admission
and a twin module without admission (the rows a key gets when inserted)."""

from __future__ import annotations

import math
import warnings
from collections import Counter as Tally

import pytest
import torch
from demb_torchrec import (
    DynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    FrequencyAdmissionStrategy,
    KVCounter,
    ProbabilisticAdmissionStrategy,
    TableConfigError,
    table_stats,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

NONE = DynamicEmbPoolingMode.NONE
UNIFORM = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.UNIFORM, lower=-1.0, upper=1.0)
MINUS = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=-3.0)


def module(strategies, *, device="cpu", lr=0.1, pooling=NONE, capacity=1024):
    options = [
        DynamicEmbTableOptions(
            dim=4,
            max_capacity=capacity,
            bucket_capacity=128,
            initializer_args=UNIFORM,
            admit_strategy=s,
        )
        for s in strategies
    ]
    return DynamicEmbeddingTables(
        options,
        feature_table_map=list(range(len(options))),
        pooling_mode=pooling,
        device=device,
        optimizer="sgd",
        learning_rate=lr,
    )


def keys_of(m, t):
    return set(m.tables.export(t).keys.tolist())


def batch(per_feature, device="cpu"):
    """NONE-pooling batch: one bag per index, feature-major."""
    flat = [k for keys in per_feature for k in keys]
    return torch.tensor(flat, device=device), torch.arange(len(flat) + 1, device=device)


class FrequencyModel:
    """Frequency admission as the spec says it, one dict per table (counters that never
    overflow): a missing key's batch count adds to its total; at ``>= threshold`` it is inserted
    and forgotten by the counter."""

    def __init__(self, threshold, tables):
        self.threshold = threshold
        self.counts = [Tally() for _ in range(tables)]
        self.keys = [set() for _ in range(tables)]

    def step(self, per_feature):
        rejected = []
        for t, keys in enumerate(per_feature):
            out = set()
            for k, n in Tally(keys).items():
                if k in self.keys[t]:
                    continue
                self.counts[t][k] += n
                if self.counts[t][k] >= self.threshold:
                    self.keys[t].add(k)
                    del self.counts[t][k]
                else:
                    out.add(k)
            rejected.append(out)
        return rejected


streams = st.lists(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=12).map(
        lambda samples: ([a for a, _ in samples], [b for _, b in samples])
    ),
    min_size=1,
    max_size=8,
)
"""Batches of samples with one id per feature (two features, one table each)."""


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams, threshold=st.integers(1, 4), own_init=st.booleans())
def test_frequency_admission_equals_a_dict_model(stream, threshold, own_init):
    """Key sets after every batch and every returned row: admitted and present keys read the
    row the table's initializer gives them (the twin without admission), rejected keys the
    strategy's initializer (or the table's when it gives none)."""
    init = MINUS if own_init else None
    strategy = FrequencyAdmissionStrategy(threshold, KVCounter(1024), initializer_args=init)
    m = module([strategy, strategy])
    twin = module([None, None])
    model = FrequencyModel(threshold, 2)
    for per_feature in stream:
        rejected = model.step(per_feature)
        indices, offsets = batch(per_feature)
        with torch.no_grad():
            out = m(indices, offsets)
            expected = twin(indices, offsets)
        flat_tables = [t for t, keys in enumerate(per_feature) for _ in keys]
        for i, (k, t) in enumerate(zip(indices.tolist(), flat_tables, strict=True)):
            if own_init and k in rejected[t]:
                torch.testing.assert_close(out[i], torch.full((4,), -3.0), rtol=0, atol=0)
            else:
                torch.testing.assert_close(out[i], expected[i], rtol=0, atol=0)
        for t in range(2):
            assert keys_of(m, t) == model.keys[t]


def test_rejected_keys_gradients_reach_no_row_and_admitted_keys_train():
    """SGD, loss = sum of the rows: an admitted key's row falls by lr per occurrence from the
    batch that admitted it on; a rejected key is nowhere in the table."""
    lr = 0.25
    m = module([FrequencyAdmissionStrategy(2, KVCounter(512))], lr=lr)
    twin = module([None])
    first = {}
    seen = Tally()
    for keys in ([1, 2, 3], [1, 4], [1, 2, 2], [5]):
        indices, offsets = batch([keys])
        out = m(indices, offsets)
        out.sum().backward()
        with torch.no_grad():
            twin_rows = twin(indices, offsets)
        for k, row in zip(keys, twin_rows, strict=True):
            first.setdefault(k, row.clone())
        for k, n in Tally(keys).items():
            if k in keys_of(m, 0):
                seen[k] += n
    assert keys_of(m, 0) == {1, 2}
    export = m.tables.export(0)
    for k, row in zip(export.keys.tolist(), export.values[:, :4], strict=True):
        expected = first[k].clone()
        for _ in range(seen[k]):
            expected -= lr
        torch.testing.assert_close(row, expected)


def test_eval_never_admits_and_tables_without_a_strategy_admit_everything():
    m = module([FrequencyAdmissionStrategy(1, KVCounter(128)), None])
    m.eval()
    m(*batch([[1, 2], [3, 4]]))
    assert keys_of(m, 0) == set()
    assert keys_of(m, 1) == set()
    m.train()
    m(*batch([[1, 2], [3, 4]]))
    assert keys_of(m, 0) == {1, 2}
    assert keys_of(m, 1) == {3, 4}


def test_probabilistic_admission_one_admits_all_and_counts_are_reported():
    m = module([ProbabilisticAdmissionStrategy(1.0), FrequencyAdmissionStrategy(3, KVCounter(128))])
    with torch.no_grad():
        m(*batch([[1, 2, 3], [7, 7, 8]]))
    assert keys_of(m, 0) == {1, 2, 3}
    assert keys_of(m, 1) == set()
    counts = m.admission.read_counts()
    assert counts["admitted"].tolist() == [3, 0]
    assert counts["rejected"].tolist() == [0, 2]
    assert m.admission.read_counts()["rejected"].tolist() == [0, 0]


def test_probabilistic_admission_fraction():
    p = 0.3
    m = module([ProbabilisticAdmissionStrategy(p)], capacity=1 << 17)
    n = 100_000
    with torch.no_grad():
        m(torch.arange(n), torch.arange(n + 1))
    admitted = len(keys_of(m, 0))
    sigma = (n * p * (1 - p)) ** 0.5
    assert abs(admitted - n * p) < 5 * sigma


def test_admission_counter_is_deprecated_and_unset_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        module([FrequencyAdmissionStrategy(2, KVCounter(128))])
    with pytest.warns(DeprecationWarning, match="admission_counter"):
        DynamicEmbeddingTables(
            [DynamicEmbTableOptions(dim=4, max_capacity=128, admission_counter=KVCounter(128))]
        )


def test_bad_admission_options_name_the_table():
    with pytest.raises(ValueError, match="admit_strategy"):
        DynamicEmbeddingTables(
            [DynamicEmbTableOptions(dim=4, max_capacity=128, admit_strategy="often")],
            table_names=["users"],
        )
    for bad, option in (
        (FrequencyAdmissionStrategy(0, KVCounter(128)), "threshold"),
        (ProbabilisticAdmissionStrategy(-0.5), "probability"),
        (ProbabilisticAdmissionStrategy(0.0), "probability"),
        (FrequencyAdmissionStrategy(2, KVCounter(0)), r"counter\.capacity"),
    ):
        options = DynamicEmbTableOptions(dim=4, max_capacity=128, admit_strategy=bad)
        with pytest.raises(TableConfigError, match=rf"users\.{option}"):
            DynamicEmbeddingTables([options], table_names=["users"])


def test_table_stats_carry_admission_counts():
    m = module([FrequencyAdmissionStrategy(2, KVCounter(128))])
    with torch.no_grad():
        m(*batch([[1, 2, 2]]))
    stats = table_stats(m)
    only = next(iter(stats.values()))["table_0"]
    assert only.admitted == 1
    assert only.rejected == 1


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["frequency", "probabilistic"])
def test_cuda_admits_what_the_cpu_admits(kind):
    """The same stream on a CPU and a CUDA module: the same keys admitted (the probabilistic
    tosses are a hash of key, table and call: device-independent), the same rows."""

    def strategy():
        if kind == "frequency":
            return FrequencyAdmissionStrategy(3, KVCounter(256, bucket_capacity=16))
        return ProbabilisticAdmissionStrategy(0.3)

    cpu = module([strategy(), strategy()], lr=0.1, pooling=DynamicEmbPoolingMode.SUM)
    gpu = module([strategy(), strategy()], lr=0.1, pooling=DynamicEmbPoolingMode.SUM, device="cuda")
    gen = torch.Generator().manual_seed(5)
    for _ in range(6):
        indices = torch.randint(0, 300, (2 * 32 * 2,), generator=gen)
        offsets = torch.arange(0, indices.numel() + 1, 2)
        a = cpu(indices, offsets)
        b = gpu(indices.cuda(), offsets.cuda())
        torch.testing.assert_close(b.cpu(), a, rtol=1e-5, atol=1e-6)
        a.square().sum().backward()
        b.square().sum().backward()
    for t in range(2):
        assert keys_of(cpu, t) == keys_of(gpu, t)
    assert torch.equal(
        cpu.admission.read_counts()["rejected"], gpu.admission.read_counts()["rejected"]
    )


def _decay(scores, cur_timestamp):
    age_seconds = (cur_timestamp - scores[0]) * 1e-9
    return math.log(max(scores[1], 1)) + age_seconds * math.log(0.9)


def test_score_function_reaches_the_tables_and_bad_ones_name_the_table():
    """The option reaches the table (its evictions follow the function: the storage tests
    compare them with a Python model); errors name the table and the option."""
    compound = (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU)

    def build(function, strategy=compound):
        options = DynamicEmbTableOptions(
            dim=4, max_capacity=128, bucket_capacity=16, score_strategy=strategy,
            score_function=function,
        )  # fmt: skip
        return DynamicEmbeddingTables([options], table_names=["items"], optimizer="sgd")

    m = build(_decay)
    assert m.tables.configs[0].score_function is _decay
    with torch.no_grad():
        for step in range(6):
            keys = torch.arange(step * 64, step * 64 + 64)
            m(keys, torch.arange(65))
    assert m.tables.size(0) == 128  # full: every later batch evicted by the function's ranks
    with pytest.raises(TableConfigError, match=r"score_function.*table 'items'"):
        build(lambda scores: 0.0)
    with pytest.raises(TableConfigError, match=r"score_function.*table 'items'"):
        build(_decay, DynamicEmbScoreStrategy.LFU)
    with pytest.raises(TableConfigError, match=r"table 'items': numba cannot compile"):
        build(lambda scores, now: float(object() is None))


@pytest.mark.parametrize("dims", [(4, 4), (4, 8)])  # the unique-rows paths of one and two dims
def test_pooled_bags_read_rejected_rows_from_the_strategy_initializer(dims):
    """SUM pooling: a bag of rejected keys sums their initializer rows; a bag holding an
    admitted key sums its table row; the rejected keys stay out of the tables."""
    strategy = FrequencyAdmissionStrategy(2, KVCounter(128), initializer_args=MINUS)
    options = [
        DynamicEmbTableOptions(dim=d, max_capacity=256, initializer_args=UNIFORM,
                               admit_strategy=strategy)
        for d in dims
    ]  # fmt: skip
    m = DynamicEmbeddingTables(options, pooling_mode=DynamicEmbPoolingMode.SUM, learning_rate=0.1)
    # feature 0: bags [1, 2], [3, 3]; feature 1: bags [5], [6, 7]
    indices = torch.tensor([1, 2, 3, 3, 5, 6, 7])
    offsets = torch.tensor([0, 2, 4, 5, 7])
    out = m(indices, offsets)
    assert keys_of(m, 0) == {3}
    assert keys_of(m, 1) == set()
    row3 = m.tables.export(0).values[0, : dims[0]]
    torch.testing.assert_close(out[0, : dims[0]], torch.full((dims[0],), -6.0))
    torch.testing.assert_close(out[1, : dims[0]], 2 * row3)
    torch.testing.assert_close(out[0, dims[0] :], torch.full((dims[1],), -3.0))
    torch.testing.assert_close(out[1, dims[0] :], torch.full((dims[1],), -6.0))
    type_name = type(m._train_path).__name__
    assert type_name == ("UniformRows" if dims[0] == dims[1] else "MixedRows")
