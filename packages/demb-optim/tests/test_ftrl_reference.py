"""The float64 FTRL reference against the spec: its retention table, exact zeros from l1_reg,
and the square-root fast path equal to the general power path."""

from __future__ import annotations

import pytest
import torch
from demb_optim import FTRL, clip_gradient, reference_update
from hypothesis import given, settings
from hypothesis import strategies as st

# The spec's table: kept fraction (%) of an initialized weight after one step, by
# (initial_accumulator_value n0, ftrl_beta) and gradient g, as printed.
RETENTION = {
    (0.0, 0.0): ["100", "100", "100"],
    (0.1, 0.0): ["69.8", "0.05", "0.000005"],
    (0.0, 1.0): ["50", "0.99", "0.01"],
    (0.1, 1.0): ["35.8", "0.012", "0.0000012"],
}
GRADS = [1.0, 0.01, 0.0001]


def one_step(spec: FTRL, w0: float, g: float, sqrt_path: bool | None = None) -> float:
    state = spec.initial_state(1, torch.float64).unsqueeze(0)
    f64 = torch.float64
    w, _ = reference_update(
        spec,
        torch.tensor([[w0]], dtype=f64),
        state,
        torch.tensor([[g]], dtype=f64),
        ftrl_sqrt_path=sqrt_path,
    )
    return float(w[0, 0])


@pytest.mark.parametrize("sqrt_path", [True, False])
@pytest.mark.parametrize(("n0", "beta"), list(RETENTION))
def test_retention_table_of_the_spec(n0, beta, sqrt_path):
    spec = FTRL(learning_rate=0.05, ftrl_beta=beta, initial_accumulator_value=n0)
    for g, printed in zip(GRADS, RETENTION[(n0, beta)], strict=True):
        kept = one_step(spec, 1.0, g, sqrt_path) - one_step(spec, 0.0, g, sqrt_path)
        decimals = len(printed.split(".")[1]) if "." in printed else 0
        assert f"{100 * kept:.{decimals}f}" == printed, (n0, beta, g, 100 * kept)


@settings(max_examples=50, deadline=None)
@given(
    l1=st.floats(0.5, 10.0),
    w0=st.floats(-1.0, 1.0),
    g=st.floats(-0.3, 0.3),
)
def test_l1_reg_drives_small_coordinates_to_exactly_zero(l1, w0, g):
    spec = FTRL(learning_rate=0.1, l1_reg=l1, initial_accumulator_value=0.1)
    w = one_step(spec, w0, g)
    state = spec.initial_state(1, torch.float64).unsqueeze(0)
    f64 = torch.float64
    _, new_state = reference_update(
        spec, torch.tensor([[w0]], dtype=f64), state, torch.tensor([[g]], dtype=f64)
    )
    if abs(float(new_state[0, 0])) <= l1:
        assert w == 0.0  # exactly, not merely small
    else:
        assert w != 0.0


@settings(max_examples=60, deadline=None)
@given(
    lr=st.floats(1e-3, 1.0),
    beta=st.floats(0.0, 2.0),
    l1=st.floats(0.0, 0.1),
    l2=st.floats(0.0, 1.0),
    n0=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_sqrt_fast_path_equals_the_general_path(lr, beta, l1, l2, n0, seed):
    spec = FTRL(
        learning_rate=lr, ftrl_beta=beta, l1_reg=l1, l2_reg=l2, initial_accumulator_value=n0
    )
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    s = spec.initial_state(6, torch.float64).repeat(5, 1)
    fast = slow = (w, s)
    for _ in range(4):
        g = torch.randn(5, 6, generator=gen, dtype=torch.float64)
        fast = reference_update(spec, *fast, g, ftrl_sqrt_path=True)
        slow = reference_update(spec, *slow, g, ftrl_sqrt_path=False)
    torch.testing.assert_close(fast[0], slow[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast[1], slow[1], rtol=1e-12, atol=1e-12)


def test_gradient_clipping_applies_to_ftrl():
    clipped = FTRL(gradient_clipping=True, max_gradient=0.01, initial_accumulator_value=0.1)
    plain = FTRL(initial_accumulator_value=0.1)
    g = clip_gradient(clipped, torch.tensor([5.0, -5.0, 0.001], dtype=torch.float64))
    assert g.tolist() == [0.01, -0.01, 0.001]
    assert clip_gradient(plain, torch.tensor([5.0])).tolist() == [5.0]
    assert one_step(clipped, 0.5, float(g[0])) == one_step(plain, 0.5, 0.01)
