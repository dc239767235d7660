"""Admission strategies and admitters: frequency admission against a dict-and-table model,
probabilistic admission's rates, reproducibility and numpy reference, grouping and bad
configurations."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
import torch
from demb_kernels import table_reference as ref
from demb_storage import (
    DEFAULT_COUNTER_CAPACITY,
    AdmissionConfigError,
    AdmissionStrategy,
    FrequencyAdmissionStrategy,
    InitializerArgs,
    InitializerMode,
    KVCounter,
    MultiTableAdmitter,
    MultiTableFrequencyAdmitter,
    MultiTableKVCounter,
    MultiTableProbabilisticAdmitter,
    ProbabilisticAdmissionStrategy,
    TableConfigError,
)
from hypothesis import given, settings
from hypothesis import strategies as st

CPU = torch.device("cpu")
WIDTH = 16


def tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def zeros(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)


# --------------------------------------------------------------------------- frequency
class FrequencyModel:
    """Counts in a :class:`TableModel` (LFU; the counter's buckets), admission by threshold."""

    def __init__(self, threshold: int, capacities: list[int]) -> None:
        self.threshold = threshold
        self.table = ref.TableModel(
            capacities, [WIDTH] * len(capacities), [ref.LFU] * len(capacities), 1
        )

    def admit(self, keys: list[int], tables: list[int], freqs: list[int]) -> list[bool]:
        n = len(self.table.capacities)
        slots, status, _, _ = self.table.find_or_insert(keys, tables, [0] * n, freqs)
        failed: dict[tuple[int, int], int] = defaultdict(int)
        for k, t, f, s in zip(keys, tables, freqs, status, strict=True):
            if s == ref.FAILED:
                failed[(t, k)] += f
        snaps = [self.table.snapshot(t) for t in range(n)]
        counts = [
            snaps[t][k][1][0] if slot >= 0 else failed[(t, k)]
            for k, t, slot in zip(keys, tables, slots, strict=True)
        ]
        admitted = [c >= self.threshold for c in counts]
        chosen = [(k, t) for k, t, a in zip(keys, tables, admitted, strict=True) if a]
        self.table.erase([k for k, _ in chosen], [t for _, t in chosen])
        return admitted

    def contents(self, t: int) -> dict[int, int]:
        return {k: sc[0] for k, (_, sc) in self.table.snapshot(t).items()}


@settings(max_examples=40, deadline=None)
@given(
    threshold=st.integers(1, 5),
    buckets=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    batches=st.lists(
        st.lists(st.tuples(st.integers(0, 80), st.integers(0, 1), st.integers(0, 3)), max_size=40),
        min_size=1,
        max_size=8,
    ),
    with_frequencies=st.booleans(),
)
def test_frequency_admitter_matches_the_model(threshold, buckets, batches, with_frequencies):
    capacities = [b * WIDTH for b in buckets]
    strategies = [FrequencyAdmissionStrategy(threshold, KVCounter(c, WIDTH)) for c in capacities]
    admitter = FrequencyAdmissionStrategy.create_admitter(strategies, CPU)
    model = FrequencyModel(threshold, capacities)
    for batch in batches:
        keys = [k for k, _, _ in batch]
        tables = [t for _, t, _ in batch]
        freqs = [f for _, _, f in batch] if with_frequencies else [1] * len(batch)
        given_freqs = tensor(freqs) if with_frequencies else None
        got = admitter.admit(tensor(keys), tensor(tables), given_freqs)
        assert got.dtype == torch.bool
        assert got.shape == (len(batch),)
        assert got.tolist() == model.admit(keys, tables, freqs)
        counter = admitter.state()
        for t in range(2):
            k, c = counter.export(t)
            assert dict(zip(k.tolist(), c.tolist(), strict=True)) == model.contents(t)


@settings(max_examples=40, deadline=None)
@given(
    threshold=st.integers(1, 5),
    buckets=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    batches=st.lists(
        st.dictionaries(
            st.tuples(st.integers(0, 80), st.integers(0, 1)), st.integers(0, 4), max_size=60
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_admit_distinct_equals_the_model_on_distinct_pairs(threshold, buckets, batches):
    """The module's call (distinct, checked pairs: the counter skips its checks and the sum
    over repeats) decides as :meth:`admit` would: the model, with buckets that overflow (a
    pair that cannot be placed is judged on its own frequency) and keys leaving on admission."""
    capacities = [b * WIDTH for b in buckets]
    strategies = [FrequencyAdmissionStrategy(threshold, KVCounter(c, WIDTH)) for c in capacities]
    admitter = FrequencyAdmissionStrategy.create_admitter(strategies, CPU)
    model = FrequencyModel(threshold, capacities)
    for batch in batches:
        keys = [k for k, _ in batch]
        tables = [t for _, t in batch]
        freqs = list(batch.values())
        got = admitter.admit_distinct(tensor(keys), tensor(tables), tensor(freqs))
        assert got.tolist() == model.admit(keys, tables, freqs)
        for t in range(2):
            k, c = admitter.state().export(t)
            assert dict(zip(k.tolist(), c.tolist(), strict=True)) == model.contents(t)


def test_admit_distinct_judges_keys_its_full_bucket_cannot_place_on_their_frequency():
    admitter = FrequencyAdmissionStrategy.create_admitter(
        [FrequencyAdmissionStrategy(3, KVCounter(WIDTH, WIDTH))], CPU
    )
    keys = torch.arange(WIDTH + 8)
    freqs = torch.tensor([2] * WIDTH + [3, 1] * 4)
    got = admitter.admit_distinct(keys, zeros(keys.numel()), freqs)
    model = FrequencyModel(3, [WIDTH]).admit(keys.tolist(), [0] * keys.numel(), freqs.tolist())
    assert got.tolist() == model
    assert got[WIDTH:].tolist() == [True, False] * 4  # not placed: their own frequency
    assert admitter.state().size(0) == WIDTH


def test_an_admitter_without_its_own_admit_distinct_is_asked_through_admit():
    class EveryOther(MultiTableAdmitter):
        def admit(self, keys, table_ids, frequencies=None):
            return keys % 2 == 0

    got = EveryOther().admit_distinct(tensor([1, 2, 4]), zeros(3), tensor([1, 1, 1]))
    assert got.tolist() == [False, True, True]


@settings(max_examples=40, deadline=None)
@given(
    threshold=st.integers(1, 5),
    buckets=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    batches=st.lists(
        st.dictionaries(
            st.tuples(st.integers(0, 80), st.integers(0, 1)),
            st.tuples(st.integers(0, 4), st.booleans()),
            max_size=60,
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_admit_masked_decides_only_the_asked_pairs_as_the_model(threshold, buckets, batches):
    """The module's sync-free call (every unique pair of a batch, the asked ones masked): the
    asked pairs are decided as the model decides them alone, the others are neither admitted
    nor counted."""
    capacities = [b * WIDTH for b in buckets]
    strategies = [FrequencyAdmissionStrategy(threshold, KVCounter(c, WIDTH)) for c in capacities]
    admitter = FrequencyAdmissionStrategy.create_admitter(strategies, CPU)
    model = FrequencyModel(threshold, capacities)
    for batch in batches:
        pairs = list(batch)
        asked = [batch[p][1] for p in pairs]
        freqs = [batch[p][0] for p in pairs]
        got = admitter.admit_masked(
            tensor([k for k, _ in pairs]),
            tensor([t for _, t in pairs]),
            tensor(freqs),
            torch.tensor(asked, dtype=torch.bool),
        )
        chosen = [i for i, a in enumerate(asked) if a]
        want = model.admit(
            [pairs[i][0] for i in chosen], [pairs[i][1] for i in chosen], [freqs[i] for i in chosen]
        )
        expected = [False] * len(pairs)
        for i, w in zip(chosen, want, strict=True):
            expected[i] = w
        assert got.tolist() == expected
        for t in range(2):
            k, c = admitter.state().export(t)
            assert dict(zip(k.tolist(), c.tolist(), strict=True)) == model.contents(t)


def test_an_admitter_without_its_own_admit_masked_is_asked_its_masked_keys():
    asked_with = []

    class EveryOther(MultiTableAdmitter):
        def admit(self, keys, table_ids, frequencies=None):
            asked_with.append(keys.tolist())
            return keys % 2 == 0

    mask = torch.tensor([True, False, True, True])
    got = EveryOther().admit_masked(tensor([1, 2, 4, 6]), zeros(4), tensor([1, 1, 1, 1]), mask)
    assert got.tolist() == [False, False, True, True]
    assert asked_with == [[1, 4, 6]]


def test_a_default_admit_masked_names_an_admit_that_returns_no_mask():
    class Counts(MultiTableAdmitter):
        def admit(self, keys, table_ids, frequencies=None):
            return keys

    with pytest.raises(TypeError, match=r"Counts\.admit returned torch\.int64"):
        Counts().admit_masked(
            tensor([1, 2]), zeros(2), tensor([1, 1]), torch.ones(2, dtype=torch.bool)
        )


def test_frequency_admission_admits_at_the_threshold_and_forgets_admitted_keys():
    admitter = FrequencyAdmissionStrategy.create_admitter(
        [FrequencyAdmissionStrategy(3, KVCounter(64, WIDTH))], CPU
    )
    assert admitter.admit(tensor([1, 2, 1]), zeros(3)).tolist() == [False, False, False]
    assert admitter.admit(tensor([1, 2]), zeros(2), tensor([1, 1])).tolist() == [True, False]
    assert admitter.admit(tensor([2, 9]), zeros(2), tensor([1, 3])).tolist() == [True, True]
    assert admitter.state().size(0) == 0
    # An admitted key that misses again (e.g. evicted from its table) counts from zero.
    assert admitter.admit(tensor([1]), zeros(1)).tolist() == [False]
    assert admitter.admit(tensor([]), zeros(0)).tolist() == []


def test_frequency_admitter_state_initializer_and_per_table_capacities():
    init = InitializerArgs(mode=InitializerMode.CONSTANT, value=0.5)
    strategies = [
        FrequencyAdmissionStrategy(2, KVCounter(100, 32), initializer_args=init),
        FrequencyAdmissionStrategy(
            2,
            KVCounter(20, 32),
            initializer_args=InitializerArgs(mode=InitializerMode.CONSTANT, value=0.5),
        ),
    ]
    assert strategies[0].get_grouped_key() == strategies[1].get_grouped_key()
    admitter = FrequencyAdmissionStrategy.create_admitter(strategies, CPU)
    assert isinstance(admitter, MultiTableFrequencyAdmitter)
    assert admitter.threshold == 2
    assert admitter.non_admitted_initializer is init
    counter = admitter.state()
    assert isinstance(counter, MultiTableKVCounter)
    assert counter.capacities == (128, 32)
    plain = FrequencyAdmissionStrategy.create_admitter([FrequencyAdmissionStrategy(2)], CPU)
    assert plain.non_admitted_initializer is None


def test_frequency_default_counter():
    strategy = FrequencyAdmissionStrategy(2)
    assert strategy.counter == KVCounter(DEFAULT_COUNTER_CAPACITY)


def test_frequency_grouped_key_ignores_capacity_only():
    base = FrequencyAdmissionStrategy(2, KVCounter(64, 16))
    key = base.get_grouped_key()
    hash(key)
    assert FrequencyAdmissionStrategy(2, KVCounter(9999, 16)).get_grouped_key() == key
    for other in (
        FrequencyAdmissionStrategy(3, KVCounter(64, 16)),
        FrequencyAdmissionStrategy(2, KVCounter(64, 32)),
        FrequencyAdmissionStrategy(2, KVCounter(64, 16, torch.int32)),
        FrequencyAdmissionStrategy(2, KVCounter(64, 16), InitializerArgs(mode="normal")),
    ):
        assert other.get_grouped_key() != key


def test_create_admitter_rejects_mixed_groups():
    with pytest.raises(AdmissionConfigError, match=r"admit_strategy\[1\]"):
        FrequencyAdmissionStrategy.create_admitter(
            [FrequencyAdmissionStrategy(2), FrequencyAdmissionStrategy(3)], CPU
        )
    with pytest.raises(AdmissionConfigError, match=r"admit_strategy\[1\]"):
        FrequencyAdmissionStrategy.create_admitter(
            [FrequencyAdmissionStrategy(2), ProbabilisticAdmissionStrategy(0.5)], CPU
        )
    with pytest.raises(AdmissionConfigError, match="admit_strategy"):
        ProbabilisticAdmissionStrategy.create_admitter([], CPU)
    with pytest.raises(AdmissionConfigError, match="admit_strategy"):
        AdmissionStrategy.one_configuration([])


@pytest.mark.parametrize("threshold", [0, -1, 1.5, True, "2", None])
def test_bad_threshold_raises(threshold):
    strategy = FrequencyAdmissionStrategy(threshold)  # kept: checked where it is used
    with pytest.raises(AdmissionConfigError, match="threshold") as caught:
        strategy.check()
    with pytest.raises(AdmissionConfigError, match=r"admit_strategy\[0\]\.threshold"):
        FrequencyAdmissionStrategy.create_admitter([strategy], CPU)
    assert isinstance(caught.value, TableConfigError)
    assert repr(threshold) in str(caught.value)


def test_bad_counter_or_initializer_raises():
    with pytest.raises(AdmissionConfigError, match="counter"):
        FrequencyAdmissionStrategy(2, counter=128).check()  # type: ignore[arg-type]
    with pytest.raises(AdmissionConfigError, match=r"counter\.capacity=0"):
        FrequencyAdmissionStrategy(2, counter=KVCounter(0)).check()
    with pytest.raises(AdmissionConfigError, match="initializer_args"):
        FrequencyAdmissionStrategy(2, initializer_args={"mode": "n"}).check()  # type: ignore[arg-type]
    with pytest.raises(AdmissionConfigError, match="initializer_args"):
        ProbabilisticAdmissionStrategy(0.5, initializer_args="normal").check()  # type: ignore[arg-type]
    FrequencyAdmissionStrategy(2, counter=KVCounter(64)).check()  # valid: nothing


def test_default_admitter_members_and_identity_grouping():
    class AdmitAll(MultiTableAdmitter):
        def admit(self, keys, table_ids, frequencies=None):
            return torch.ones_like(keys, dtype=torch.bool)

    class Everything(AdmissionStrategy):
        @classmethod
        def create_admitter(cls, table_strategies, device):
            return AdmitAll()

    admitter = Everything.create_admitter([Everything()], CPU)
    assert admitter.state() is None
    assert admitter.non_admitted_initializer is None
    a, b = Everything(), Everything()
    assert a.get_grouped_key() is a
    assert a.get_grouped_key() != b.get_grouped_key()
    assert Everything.one_configuration([b, a]) is b


# --------------------------------------------------------------------------- probabilistic
M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def np_fmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xFF51AFD7ED558CCD)
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xC4CEB9FE1A85EC53)
        x ^= x >> np.uint64(33)
    return x


def np_scalar_mix(x: int) -> int:
    return int(np_fmix64(np.array([x % 2**64], dtype=np.uint64))[0])


def reference_decisions(keys, tables, freqs, p, call, seed):
    """The documented toss in numpy uint64 and Python floats."""
    keys = np.asarray(keys, dtype=np.int64).view(np.uint64)
    tables = np.asarray(tables, dtype=np.int64)
    salt = np_scalar_mix(seed ^ np_scalar_mix((call + 1) * 0x9E3779B97F4A7C15))
    table_salt = np.array(
        [np_scalar_mix((t + 1) * 0xD1B54A32D192ED03) for t in range(int(tables.max()) + 1)],
        dtype=np.uint64,
    )
    h = np_fmix64(np_fmix64(keys ^ np.uint64(salt)) ^ table_salt[tables])
    u = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53
    total: dict[tuple[int, int], int] = defaultdict(int)
    for k, t, f in zip(keys.tolist(), tables.tolist(), freqs, strict=True):
        total[(t, k)] += f
    out = []
    for i, (k, t) in enumerate(zip(keys.tolist(), tables.tolist(), strict=True)):
        n = total[(t, k)]
        if n == 1:
            chance = p
        else:
            power, base, e = 1.0, 1.0 - p, n
            while e:
                if e & 1:
                    power *= base
                base *= base
                e >>= 1
            chance = 1.0 - power
        out.append(bool(u[i] < chance))
    return out


def probabilistic(p: float, tables: int = 1, seed: int = 0) -> MultiTableProbabilisticAdmitter:
    strategies = [ProbabilisticAdmissionStrategy(p, seed=seed)] * tables
    admitter = ProbabilisticAdmissionStrategy.create_admitter(strategies, CPU)
    assert isinstance(admitter, MultiTableProbabilisticAdmitter)
    return admitter


def within_five_sigma(admitted: int, n: int, chance: float) -> bool:
    sigma = math.sqrt(n * chance * (1 - chance))
    return abs(admitted - n * chance) <= 5 * sigma


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_admitted_fraction_of_distinct_keys_is_p(p):
    n = 100_000
    got = probabilistic(p).admit(torch.arange(n) * 7919 + 3, zeros(n))
    assert within_five_sigma(int(got.sum()), n, p)


@pytest.mark.parametrize("k", [2, 5])
def test_k_occurrences_give_k_tosses(k):
    n, p = 50_000, 0.2
    chance = 1 - (1 - p) ** k
    keys = torch.arange(n)
    by_frequency = probabilistic(p).admit(keys, zeros(n), torch.full((n,), k))
    assert within_five_sigma(int(by_frequency.sum()), n, chance)
    # The same key k times in the batch (one frequency each) is the same k tosses.
    repeated = probabilistic(p).admit(keys.repeat(k), zeros(n * k))
    assert torch.equal(repeated[:n], by_frequency)
    assert torch.equal(repeated.view(k, n), by_frequency.expand(k, n))


def test_probability_one_admits_everything_and_zero_frequency_nothing():
    admitter = probabilistic(1.0)
    assert bool(admitter.admit(torch.arange(10_000), zeros(10_000)).all())
    got = admitter.admit(tensor([1, 2, 3]), zeros(3), tensor([0, 1, 7]))
    assert got.tolist() == [False, True, True]


def test_decisions_equal_the_numpy_reference():
    gen = torch.Generator().manual_seed(1)
    keys = torch.cat([torch.randint(-(2**62), 2**62, (300,), generator=gen), tensor([0, 1, 1, -2])])
    tables = torch.randint(0, 3, (keys.numel(),), generator=gen)
    freqs = torch.randint(0, 5, (keys.numel(),), generator=gen)
    for p, seed in ((0.3, 0), (0.05, 2**64 - 1), (0.9, 12345)):
        admitter = probabilistic(p, tables=3, seed=seed)
        for call in range(3):
            got = admitter.admit(keys, tables, freqs)
            expected = reference_decisions(
                keys.tolist(), tables.tolist(), freqs.tolist(), p, call, seed
            )
            assert got.tolist() == expected


def test_tosses_are_reproducible_and_independent_of_order_and_sharding():
    n = 2000
    keys, tables = torch.arange(n) * 31, torch.arange(n) % 2
    first = probabilistic(0.5, 2).admit(keys, tables)
    assert torch.equal(probabilistic(0.5, 2).admit(keys, tables), first)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    assert torch.equal(probabilistic(0.5, 2).admit(keys[perm], tables[perm]), first[perm])
    # Two "ranks", each with its own admitter at the same call count, each a part of the keys.
    rank0, rank1 = probabilistic(0.5, 2), probabilistic(0.5, 2)
    half = n // 2
    assert torch.equal(rank0.admit(keys[:half], tables[:half]), first[:half])
    assert torch.equal(rank1.admit(keys[half:], tables[half:]), first[half:])
    # Another seed, another table id or another call tosses anew.
    assert not torch.equal(probabilistic(0.5, 2, seed=1).admit(keys, tables), first)
    assert not torch.equal(probabilistic(0.5, 2).admit(keys, 1 - tables), first)


def test_every_call_counts_even_an_empty_one():
    n = 2000
    keys = torch.arange(n)
    a, b = probabilistic(0.5), probabilistic(0.5)
    a.admit(tensor([]), zeros(0))
    assert a.calls == 1
    b.admit(keys, zeros(n))
    assert torch.equal(a.admit(keys, zeros(n)), b.admit(keys, zeros(n)))
    assert a.state() is None
    assert a.non_admitted_initializer is None


def test_probabilistic_admitter_bad_batches_raise():
    admitter = probabilistic(0.5, tables=2)
    with pytest.raises(ValueError, match="table_ids"):
        admitter.admit(tensor([1]), tensor([2]))
    with pytest.raises(ValueError, match="frequencies"):
        admitter.admit(tensor([1]), tensor([0]), tensor([-1]))
    with pytest.raises(ValueError, match="frequencies"):
        admitter.admit(tensor([1, 2]), tensor([0, 0]), tensor([1]))
    with pytest.raises(TypeError, match="keys"):
        admitter.admit(torch.tensor([1.0]), tensor([0]))


@pytest.mark.parametrize("p", [0.0, -0.5, 1.5, math.nan, math.inf, True, "0.5", None])
def test_bad_probability_raises(p):
    with pytest.raises(AdmissionConfigError, match="probability") as caught:
        ProbabilisticAdmissionStrategy(p).check()
    assert isinstance(caught.value, ValueError)
    if isinstance(p, float) and p == 0.0:
        assert "never admit" in str(caught.value)


def test_bad_seed_raises():
    with pytest.raises(AdmissionConfigError, match="seed"):
        ProbabilisticAdmissionStrategy(0.5, seed=-1).check()


def test_probabilistic_grouped_key():
    key = ProbabilisticAdmissionStrategy(0.25).get_grouped_key()
    hash(key)
    assert ProbabilisticAdmissionStrategy(0.25).get_grouped_key() == key
    assert ProbabilisticAdmissionStrategy(0.5).get_grouped_key() != key
    assert ProbabilisticAdmissionStrategy(0.25, seed=3).get_grouped_key() != key


@pytest.mark.cuda
def test_cuda_decisions_equal_the_cpu_decisions():
    gen = torch.Generator().manual_seed(2)
    keys = torch.randint(-(2**62), 2**62, (5000,), generator=gen)
    tables = torch.randint(0, 2, (5000,), generator=gen)
    freqs = torch.randint(0, 6, (5000,), generator=gen)
    strategies = [ProbabilisticAdmissionStrategy(0.3, seed=7)] * 2
    cpu = ProbabilisticAdmissionStrategy.create_admitter(strategies, CPU)
    cuda = ProbabilisticAdmissionStrategy.create_admitter(strategies, torch.device("cuda"))
    for _ in range(3):
        a = cpu.admit(keys, tables, freqs)
        b = cuda.admit(keys.cuda(), tables.cuda(), freqs.cuda())
        assert torch.equal(a, b.cpu())


@pytest.mark.cuda
def test_cuda_frequency_admitter_equals_the_cpu_one():
    gen = torch.Generator().manual_seed(3)
    strategies = [FrequencyAdmissionStrategy(3, KVCounter(64, WIDTH))] * 2
    cpu = FrequencyAdmissionStrategy.create_admitter(strategies, CPU)
    cuda = FrequencyAdmissionStrategy.create_admitter(strategies, torch.device("cuda"))
    for _ in range(10):
        keys = torch.randint(0, 200, (60,), generator=gen)
        tables = torch.randint(0, 2, (60,), generator=gen)
        a = cpu.admit(keys, tables)
        b = cuda.admit(keys.cuda(), tables.cuda())
        assert torch.equal(a, b.cpu())
