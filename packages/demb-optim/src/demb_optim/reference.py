"""Float64 reference updates, written from each optimizer's formula (see :mod:`demb_optim.specs`).

The tests compare the fused updates and FBGEMM's CPU TBE against these. One call updates the
rows of one step: ``weight (n, dim)``, ``state (n, state_dim)``, ``grad (n, dim)`` (one reduced
gradient row per unique key), ``step`` the table's update count including this one (Adam).
Gradient clipping is not applied here: it applies to each occurrence's gradient before the
occurrences of a key are summed (:mod:`demb_optim.gradients`), as FBGEMM does.
"""

from __future__ import annotations

import torch

from demb_optim.specs import FTRL, SGD, Adagrad, Adam, OptimizerSpec, RowWiseAdagrad

__all__ = ["reference_update"]


def _ftrl(
    spec: FTRL, w: torch.Tensor, state: torch.Tensor, g: torch.Tensor, *, sqrt_path: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    dim = w.shape[1]
    z, n = state[:, :dim].clone(), state[:, dim:].clone()
    n_new = n + g * g
    if sqrt_path:
        sigma = (n_new.sqrt() - n.sqrt()) / spec.learning_rate
        rate_new = n_new.sqrt()
    else:
        p = spec.learning_rate_power
        sigma = (n_new.pow(-p) - n.pow(-p)) / spec.learning_rate
        rate_new = n_new.pow(-p)
    z = z + g - sigma * w
    denom = (spec.ftrl_beta + rate_new) / spec.learning_rate + spec.l2_reg
    w_new = (z.sign() * spec.l1_reg - z) / denom
    w_new = torch.where(z.abs() <= spec.l1_reg, torch.zeros_like(w_new), w_new)
    return w_new, torch.cat([z, n_new], dim=1)


def reference_update(
    spec: OptimizerSpec,
    weight: torch.Tensor,
    state: torch.Tensor,
    grad: torch.Tensor,
    step: int = 1,
    *,
    ftrl_sqrt_path: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of ``spec`` on float64 copies of the rows.

    Args:
        spec: the optimizer.
        weight: ``(n, dim)`` embeddings.
        state: ``(n, state_dim)`` optimizer state (``spec.state_dim(dim)`` columns).
        grad: ``(n, dim)`` reduced gradient rows (already clipped per occurrence).
        step: Adam's table step count, this update included (>= 1).
        ftrl_sqrt_path: FTRL only: force the square-root path (True), the general power path
            (False), or pick by ``learning_rate_power == -0.5`` (None).

    Returns:
        ``(new_weight, new_state)`` float64.
    """
    w = weight.to(torch.float64)
    s = state.to(torch.float64)
    g = grad.to(torch.float64)
    lr = spec.learning_rate
    if isinstance(spec, SGD):
        return w - lr * g, s
    if isinstance(spec, Adam):
        dim = w.shape[1]
        m = spec.beta1 * s[:, :dim] + (1 - spec.beta1) * g
        v = spec.beta2 * s[:, dim:] + (1 - spec.beta2) * g * g
        m_hat = m / (1 - spec.beta1**step)
        v_hat = v / (1 - spec.beta2**step)
        w_new = w - lr * (m_hat / (v_hat.sqrt() + spec.eps) + spec.weight_decay * w)
        return w_new, torch.cat([m, v], dim=1)
    if isinstance(spec, Adagrad):
        acc = s + g * g
        return w - lr * g / (acc.sqrt() + spec.eps), acc
    if isinstance(spec, RowWiseAdagrad):
        acc = s.clone()
        acc[:, 0] += (g * g).mean(dim=1)
        return w - lr * g / (acc[:, :1].sqrt() + spec.eps), acc
    if isinstance(spec, FTRL):
        sqrt_path = spec.learning_rate_power == -0.5 if ftrl_sqrt_path is None else ftrl_sqrt_path
        return _ftrl(spec, w, s, g, sqrt_path=sqrt_path)
    raise TypeError(f"no reference update for {type(spec).__name__}")
