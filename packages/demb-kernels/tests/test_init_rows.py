"""init_rows (the counter-based row initializer): Philox4x32-10 against its published known
answers, the CPU kernel against the pure-Python reference for every mode, row dtypes, state
columns, batch-order independence, distributions, bad input, and (marked `cuda`) CUDA == CPU
bit for bit."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from demb_kernels.init_reference import MODES, philox4x32, reference_rows
from demb_kernels.init_rows import INIT_MODES, init_rows
from hypothesis import given, settings
from hypothesis import strategies as st

INT64 = st.integers(-(2**63), 2**63 - 1)
EDGE_KEYS = [0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, -(2**63), 65535, 65536]
KEYS = st.one_of(INT64, st.sampled_from(EDGE_KEYS), st.integers(-1000, 1000))
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NARROW = 1 / math.sqrt(1.6e6)

# Random123's kat_vectors for philox4x32 with 10 rounds: (counter, key, output).
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def run(keys, dim, seed, mode, *, width=None, dtype=torch.float32, device="cpu", **params):
    """Rows of `keys` in a fresh (n, width) buffer, slot i = entry i."""
    keys_t = torch.as_tensor(keys, dtype=torch.int64).reshape(-1).to(device)
    values = torch.zeros(keys_t.numel(), width or dim, dtype=dtype, device=device)
    slots = torch.arange(keys_t.numel(), device=device)
    init_rows(values, slots, keys_t, dim, seed=seed, mode=mode, **params)
    return values


@pytest.mark.parametrize(("counter", "key", "expected"), PHILOX_KAT)
def test_philox_reference_matches_known_answers(counter, key, expected):
    assert philox4x32(counter, key) == expected


def test_modes_agree():
    assert INIT_MODES == MODES


@st.composite
def mode_params(draw, mode):
    finite = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False)
    if mode == "truncated_normal":
        mean = draw(finite)
        std_dev = draw(st.floats(1e-3, 1e3))
        a = draw(st.floats(-6.0, 6.0))
        b = draw(st.floats(-6.0, 6.0))
        a, b = min(a, b), max(a, b)
        b = max(b, a + 1e-3)
        return {"mean": mean, "std_dev": std_dev, "lower": mean + a * std_dev,
                "upper": mean + b * std_dev, "value": 0.0}  # fmt: skip
    return {"mean": draw(finite), "std_dev": draw(st.floats(0.0, 1e3)), "lower": draw(finite),
            "upper": draw(finite), "value": draw(finite)}  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=30, deadline=None)
@given(data=st.data(), dim=st.integers(1, 300), seed=INT64)
def test_cpu_rows_equal_reference(mode, data, dim, seed):
    keys = data.draw(st.lists(KEYS, min_size=1, max_size=max(1, 2000 // dim)))
    params = data.draw(mode_params(mode))
    got = run(keys, dim, seed, mode, **params).numpy().astype(np.float64)
    ref = reference_rows(keys, dim, seed, mode, **params)
    if mode in ("uniform", "constant", "debug"):
        ref32 = ref.astype(np.float32)
        np.testing.assert_array_less(np.abs(got - ref32), np.spacing(np.abs(ref32)) * 1.0001)
    else:  # an absolute 1e-12 covers results next to 0 (p within an ulp of its median)
        np.testing.assert_allclose(got, ref.astype(np.float32), rtol=1e-6, atol=1e-12)
    if mode == "truncated_normal":
        assert got.min() >= np.float32(params["lower"])
        assert got.max() <= np.float32(params["upper"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_half_rows_are_the_float32_rows_rounded(mode, dtype):
    keys = list(range(-500, 500, 3)) + EDGE_KEYS
    params = {"mean": 0.5, "std_dev": 2.0, "lower": -1.0, "upper": 3.0, "value": 1.1}
    full = run(keys, 40, 99, mode, **params)
    half = run(keys, 40, 99, mode, dtype=dtype, **params)
    assert torch.equal(half, full.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_state_columns_written_or_untouched(dtype):
    values = torch.full((5, 7), 9.0, dtype=dtype)
    slots = torch.tensor([3, -1, 0])
    keys = torch.tensor([10, 11, 12])
    state = torch.tensor([0.1, -2.0, 1e-3], dtype=torch.float32)
    init_rows(values, slots, keys, 4, seed=1, mode="debug")
    assert torch.equal(values[[0, 3], 4:], torch.full((2, 3), 9.0, dtype=dtype))
    init_rows(values, slots, keys, 4, seed=1, mode="constant", value=0.5, state=state)
    assert torch.equal(values[[0, 3], 4:], state.to(dtype).expand(2, 3))
    assert torch.equal(values[[0, 3], :4], torch.full((2, 4), 0.5, dtype=dtype))
    assert torch.equal(values[[1, 2, 4]], torch.full((3, 7), 9.0, dtype=dtype))


def test_skipped_slots_leave_other_rows_untouched():
    values = torch.full((6, 3), -5.0)
    init_rows(values, torch.tensor([-1, 4, -1, 1]), torch.tensor([7, 8, 9, 10]), 3,
              seed=3, mode="debug")  # fmt: skip
    expected = torch.full((6, 3), -5.0)
    expected[4] = torch.tensor([8.0, 8 + 1 / 256, 8 + 2 / 256])
    expected[1] = torch.tensor([10.0, 10 + 1 / 256, 10 + 2 / 256])
    assert torch.equal(values, expected)


@pytest.mark.parametrize("mode", MODES)
def test_a_key_gets_the_same_row_in_any_batch(mode):
    keys = torch.tensor([5, -3, 2**40, 77, 0, -(2**62), 123456789])
    params = {"lower": -0.1, "upper": 0.2, "mean": 0.0, "std_dev": 0.5}
    alone = torch.cat([run(k.reshape(1), 16, 42, mode, **params) for k in keys])
    order = torch.randperm(keys.numel(), generator=torch.Generator().manual_seed(0))
    values = torch.zeros(20, 16)
    slots = torch.tensor([19, 3, 7, 11, 0, 15, 9])
    init_rows(values, slots, keys[order], 16, seed=42, mode=mode, **params)
    assert torch.equal(values[slots], alone[order])


@pytest.mark.parametrize("mode", ["uniform", "normal", "truncated_normal"])
def test_different_seeds_give_different_rows(mode):
    keys = torch.arange(100)
    a = run(keys, 8, 1, mode, lower=-1.0, upper=1.0)
    b = run(keys, 8, 2, mode, lower=-1.0, upper=1.0)
    c = run(keys, 8, -(2**63), mode, lower=-1.0, upper=1.0)
    assert (a != b).float().mean() > 0.99
    assert (a != c).float().mean() > 0.99
    assert (a[:, :1] != a[:, 1:]).all()  # and the columns of a row differ


DRAWS = 200_000


def draws(mode, **params):
    keys = torch.arange(DRAWS // 8) * 7919 - 10**6
    return run(keys, 8, 2024, mode, **params).double().flatten()


def test_uniform_distribution():
    x = draws("uniform", lower=-0.25, upper=0.75)
    assert -0.25 <= x.min() < -0.2499
    assert 0.7499 < x.max() <= 0.75
    assert abs(x.mean().item() - 0.25) < 5 * (1 / math.sqrt(12)) / math.sqrt(DRAWS)
    hist = torch.histc(x, bins=10, min=-0.25, max=0.75)
    assert (hist - DRAWS / 10).abs().max() < 6 * math.sqrt(DRAWS / 10)


def test_normal_distribution():
    x = draws("normal", mean=1.5, std_dev=0.2)
    assert abs(x.mean().item() - 1.5) < 5 * 0.2 / math.sqrt(DRAWS)
    assert abs(x.std().item() - 0.2) < 0.2 * 0.01
    assert abs(((x - 1.5).abs() < 0.2).double().mean().item() - 0.6827) < 0.005


@pytest.mark.parametrize(
    ("mean", "std_dev", "lower", "upper"),
    [(0.0, 1.0, -1.0, 1.0), (0.0, 1.0, -NARROW, NARROW), (2.0, 0.5, 1.0, 4.0), (0.0, 1.0, 3, 5)],
)
def test_truncated_normal_distribution(mean, std_dev, lower, upper):
    x = draws("truncated_normal", mean=mean, std_dev=std_dev, lower=lower, upper=upper)
    assert x.min() >= np.float32(lower)
    assert x.max() <= np.float32(upper)
    a, b = (lower - mean) / std_dev, (upper - mean) / std_dev
    pdf = [math.exp(-t * t / 2) / math.sqrt(2 * math.pi) for t in (a, b)]
    mass = 0.5 * (math.erfc(-b / math.sqrt(2)) - math.erfc(-a / math.sqrt(2)))
    expected_mean = mean + std_dev * (pdf[0] - pdf[1]) / mass
    variance = std_dev**2 * (1 + (a * pdf[0] - b * pdf[1]) / mass - ((pdf[0] - pdf[1]) / mass) ** 2)
    sd = math.sqrt(variance)
    assert abs(x.mean().item() - expected_mean) < 5 * sd / math.sqrt(DRAWS)
    assert abs(x.std().item() - sd) < 0.01 * sd


def test_narrow_truncated_normal_fills_its_interval():
    x = draws("truncated_normal", mean=0.0, std_dev=1.0, lower=-NARROW, upper=NARROW)
    assert abs(x.mean().item()) < 5 * NARROW / math.sqrt(3 * DRAWS)
    assert x.min() < -0.999 * NARROW
    assert x.max() > 0.999 * NARROW


def test_bad_arguments_are_rejected():
    values = torch.zeros(4, 6)
    slots = torch.tensor([0, 1])
    keys = torch.tensor([5, 6])

    def call(**kw):
        args = {"values": values, "slots": slots, "keys": keys, "dim": 4, "seed": 0}
        args["mode"] = kw.pop("mode", "uniform")
        args.update(kw)
        init_rows(**args)

    with pytest.raises(ValueError, match=r"mode='gauss'.*'uniform', 'normal', 'truncated_normal'"):
        call(mode="gauss")
    with pytest.raises(TypeError, match="values must be float32, float16 or bfloat16"):
        call(values=torch.zeros(4, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="values must be contiguous"):
        call(values=torch.zeros(6, 4).t())
    with pytest.raises(ValueError, match=r"dim=0: must be in \[1, 6\]"):
        call(dim=0)
    with pytest.raises(ValueError, match=r"dim=7: must be in \[1, 6\]"):
        call(dim=7)
    with pytest.raises(ValueError, match=r"slots\[1\]=4 is out of range for 4 rows"):
        call(slots=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"slots\[0\]=-2 is out of range"):
        call(slots=torch.tensor([-2, 0]))
    with pytest.raises(ValueError, match=r"state must be \(2,\)"):
        call(state=torch.zeros(3))
    with pytest.raises(TypeError, match="state must be float32"):
        call(state=torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"keys must be 1-D with one key per slot \(2\)"):
        call(keys=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="keys must be int64"):
        call(keys=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="slots must be int64"):
        call(slots=torch.tensor([1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="std_dev=0: mode='truncated_normal' needs"):
        call(mode="truncated_normal", std_dev=0.0)
    with pytest.raises(ValueError, match="lower=1, upper=0: mode='truncated_normal' needs"):
        call(mode="truncated_normal", lower=1.0, upper=0.0)
    assert torch.equal(values, torch.zeros(4, 6))  # nothing written by a rejected call


def test_fake_kernel_traces():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        values = torch.empty(4, 3)
        init_rows(values, torch.tensor([0]), torch.tensor([1]), 3, seed=0, mode="normal")


CUDA_CASES = [
    ("uniform", {"lower": -0.05, "upper": 0.05}),
    ("normal", {"mean": 0.1, "std_dev": 0.02}),
    ("truncated_normal", {"mean": 0.0, "std_dev": 1.0, "lower": -2.0, "upper": 2.0}),
    ("truncated_normal", {"mean": 0.0, "std_dev": 1.0, "lower": -NARROW, "upper": NARROW}),
    ("truncated_normal", {"mean": 1.0, "std_dev": 0.5, "lower": 2.0, "upper": 3.5}),
    ("constant", {"value": 0.3}),
    ("debug", {}),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("mode", "params"), CUDA_CASES)
def test_cuda_rows_equal_cpu_rows(mode, params, dtype):
    g = torch.Generator().manual_seed(7)
    keys = torch.randint(-(2**63), 2**63 - 1, (100_000,), generator=g, dtype=torch.int64)
    keys[:10] = torch.tensor(EDGE_KEYS)
    slots = torch.randperm(120_000, generator=g)[:100_000]
    slots[::97] = -1
    state = torch.randn(5, generator=g)
    for dim, state_arg in [(16, None), (3, state)]:
        width = dim + 5
        cpu = torch.full((120_000, width), 7.0, dtype=dtype)
        gpu = cpu.cuda()
        args = {"seed": -123456789, "mode": mode, **params}
        init_rows(cpu, slots, keys, dim, state=state_arg, **args)
        init_rows(gpu, slots.cuda(), keys.cuda(), dim,
                  state=None if state_arg is None else state_arg.cuda(), **args)  # fmt: skip
        back = gpu.cpu()
        differ = (back != cpu).sum().item()
        assert torch.equal(back, cpu), f"{differ} of {cpu.numel()} elements differ"
