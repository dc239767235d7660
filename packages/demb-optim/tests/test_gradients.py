"""reduce_gradients: each occurrence clipped, then a key's occurrences summed (float64 loop as
the reference), for every spec type."""

from __future__ import annotations

import pytest
import torch
from demb_optim import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad, nonfinite, reduce_gradients
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None)
@given(
    spec_type=st.sampled_from([SGD, Adam, Adagrad, RowWiseAdagrad, FTRL]),
    clip=st.booleans(),
    max_gradient=st.floats(0.01, 2.0),
    n=st.integers(0, 40),
    num_unique=st.integers(1, 8),
    dim=st.integers(1, 9),
    seed=st.integers(0, 2**31),
)
def test_reduce_gradients_clips_each_occurrence_then_sums(
    spec_type, clip, max_gradient, n, num_unique, dim, seed
):
    gen = torch.Generator().manual_seed(seed)
    spec = spec_type(gradient_clipping=clip, max_gradient=max_gradient)
    grads = torch.randn(n, dim, generator=gen) * 2
    inverse = torch.randint(0, num_unique, (n,), generator=gen)
    expected = torch.zeros(num_unique, dim, dtype=torch.float64)
    for row, key in zip(grads.to(torch.float64), inverse.tolist(), strict=True):
        expected[key] += row.clamp(-max_gradient, max_gradient) if clip else row
    got = reduce_gradients(spec, grads, inverse, num_unique)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.to(torch.float64), expected, rtol=1e-5, atol=1e-5)


def test_clipping_changes_the_sum_not_only_its_bound():
    """Two occurrences of 5 with max_gradient 1 sum to 2 (clip first), not 1 (clip the sum)."""
    spec = SGD(gradient_clipping=True, max_gradient=1.0)
    got = reduce_gradients(spec, torch.full((2, 1), 5.0), torch.tensor([0, 0]), 1)
    assert got.tolist() == [[2.0]]


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"grads must be \(n, dim\) and inverse \(n,\)"):
        reduce_gradients(SGD(), torch.zeros(3, 2), torch.zeros(2, dtype=torch.long), 1)


@pytest.mark.cuda
def test_cuda_reduce_gradients_equals_cpu():
    gen = torch.Generator().manual_seed(3)
    spec = Adam(gradient_clipping=True, max_gradient=0.5)
    grads = torch.randn(5000, 64, generator=gen)
    inverse = torch.randint(0, 700, (5000,), generator=gen)
    cpu = reduce_gradients(spec, grads, inverse, 700)
    gpu = reduce_gradients(spec, grads.cuda(), inverse.cuda(), 700)
    assert gpu.device.type == "cuda"
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("values", "bad"),
    [
        ([1.0, -2.0], False),
        ([1.0, float("nan")], True),
        ([float("inf"), 0.0], True),
        ([0.0, float("-inf")], True),
        ([], False),
    ],
)
def test_nonfinite_finds_nan_and_infinities(values, bad):
    assert bool(nonfinite(torch.tensor(values))) is bad
