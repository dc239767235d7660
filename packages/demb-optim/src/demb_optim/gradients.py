"""From per-occurrence gradient rows to the reduced rows the fused update takes.

A key looked up several times in a batch gets one gradient row per occurrence. Gradient
clipping (``gradient_clipping`` / ``max_gradient`` of every spec) clamps each occurrence's row
elementwise, and only then are a key's occurrences summed, as FBGEMM's TBE does.
"""

from __future__ import annotations

import torch

from demb_optim.specs import OptimizerSpec

__all__ = ["clip_gradient", "nonfinite", "reduce_gradients"]


def clip_gradient(spec: OptimizerSpec, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` (per-occurrence gradient rows, any float dtype) clamped to
    ``[-max_gradient, max_gradient]`` elementwise when ``spec.gradient_clipping`` is on, else
    returned unchanged."""
    if spec.gradient_clipping:
        return grad.clamp(-spec.max_gradient, spec.max_gradient)
    return grad


def nonfinite(grad: torch.Tensor) -> torch.Tensor:
    """``()`` bool on ``grad``'s device, no sync: whether ``grad`` holds a NaN or an infinity.
    One read: NaN propagates through min/max, and an infinity is one of them."""
    if grad.numel() == 0 or not grad.is_floating_point():
        return torch.zeros((), dtype=torch.bool, device=grad.device)
    return ~torch.isfinite(torch.stack(torch.aminmax(grad))).all()


def reduce_gradients(
    spec: OptimizerSpec, grads: torch.Tensor, inverse: torch.Tensor, num_unique: int
) -> torch.Tensor:
    """Clip each occurrence's gradient row, then sum the rows of each unique key.

    Args:
        spec: the optimizer (its clipping options).
        grads: ``(n, dim)`` float gradient row of each occurrence.
        inverse: ``(n,)`` int64, the unique key of each occurrence, in ``[0, num_unique)``
            (``torch.unique(..., return_inverse=True)`` gives it).
        num_unique: the number of unique keys.

    Returns:
        ``(num_unique, dim)`` float32 on ``grads``' device, for :func:`demb_optim.apply_update`.
        On CUDA the sum uses atomics, so its float rounding can vary between runs.

    Raises:
        ValueError: shapes that do not match.
    """
    if grads.dim() != 2 or inverse.shape != (grads.shape[0],):
        raise ValueError(
            f"grads must be (n, dim) and inverse (n,), got {tuple(grads.shape)} and "
            f"{tuple(inverse.shape)}"
        )
    out = torch.zeros(num_unique, grads.shape[1], dtype=torch.float32, device=grads.device)
    return out.index_add_(0, inverse, clip_gradient(spec, grads.to(torch.float32)))
