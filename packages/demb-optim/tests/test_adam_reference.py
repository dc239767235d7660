"""The float64 Adam reference against torch.optim.AdamW (FBGEMM's CPU TBE has no Adam): rows
updated every step see the same bias correction as torch's per-parameter step, and the weight
decay is decoupled (AdamW's), as in FBGEMM's Adam."""

from __future__ import annotations

import torch
from demb_optim import Adam, reference_update
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=30, deadline=None)
@given(
    lr=st.floats(1e-3, 0.1),
    beta1=st.floats(0.0, 0.99),
    beta2=st.floats(0.5, 0.9999),
    eps=st.floats(1e-8, 1e-3),
    weight_decay=st.sampled_from([0.0, 0.01, 0.1]),
    dim=st.integers(1, 17),
    seed=st.integers(0, 2**31),
)
def test_adam_reference_equals_torch_adamw(lr, beta1, beta2, eps, weight_decay, dim, seed):
    spec = Adam(learning_rate=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay)
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(6, dim, generator=gen, dtype=torch.float64)
    param = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW(
        [param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay
    )
    w, s = w0, spec.initial_state(dim, torch.float64).repeat(6, 1)
    for step in range(1, 8):
        g = torch.randn(6, dim, generator=gen, dtype=torch.float64)
        param.grad = g.clone()
        opt.step()
        w, s = reference_update(spec, w, s, g, step)
    torch.testing.assert_close(w, param.detach(), rtol=1e-9, atol=1e-10)


def test_adam_rows_first_written_later_use_the_table_step():
    spec = Adam(learning_rate=0.1)
    g = torch.ones(1, 2, dtype=torch.float64)
    fresh = spec.initial_state(2, torch.float64).unsqueeze(0)
    early, _ = reference_update(spec, torch.zeros(1, 2, dtype=torch.float64), fresh, g, step=1)
    late, _ = reference_update(spec, torch.zeros(1, 2, dtype=torch.float64), fresh, g, step=50)
    # step 1: m_hat / sqrt(v_hat) = 1, a full lr step; at table step 50 the same fresh row's
    # bias correction is nearly gone, so its step is (1 - b1) / sqrt(1 - b2) times larger
    torch.testing.assert_close(early, torch.full((1, 2), -0.1, dtype=torch.float64))
    expected = -0.1 * (0.1 / (1 - 0.9**50)) / ((0.001 / (1 - 0.999**50)) ** 0.5 + 1e-8)
    torch.testing.assert_close(late, torch.full((1, 2), expected, dtype=torch.float64))
