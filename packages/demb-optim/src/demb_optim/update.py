"""The fused optimizer update: rows ``[embedding | state]`` of several tables updated in place.

``apply_update`` calls ``demb::optimizer_update`` (C++ on the CPU; the CUDA kernel is not
written yet) with a spec's hyper-parameters. Arithmetic is float32 whatever the rows' dtype
(float32, float16 or bfloat16); the state is stored in the rows' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from demb_kernels import _library  # noqa: F401  (loads the native ops)

from demb_optim.specs import FTRL, Adagrad, Adam, OptimizerSpec, RowWiseAdagrad

__all__ = ["apply_update"]


def apply_update(
    spec: OptimizerSpec,
    values: Sequence[torch.Tensor],
    slots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    dims: Sequence[int],
    steps: Sequence[int] | None = None,
) -> None:
    """Update the rows ``slots[t]`` of every table ``t`` in place with ``spec``.

    Args:
        spec: the optimizer (hyper-parameters).
        values: per table, ``(rows, dims[t] + spec.state_dim(dims[t], dtype))`` contiguous value
            buffer, float32, float16 or bfloat16 (mutated).
        slots: per table, ``(n_t,)`` int64 unique rows to update; -1 is skipped.
        grads: per table, ``(n_t, dims[t])`` float32 gradient of each row, summed over the
            batch's occurrences after clipping each (:func:`demb_optim.clip_gradient`).
        dims: per table, the embedding width.
        steps: per table, the number of updates including this one (Adam's bias correction);
            default 1 each.

    Raises:
        ValueError / TypeError: a shape, dtype or slot is wrong (the message names it).
    """
    eps = spec.eps if isinstance(spec, Adam | Adagrad | RowWiseAdagrad) else 0.0
    adam = spec if isinstance(spec, Adam) else None
    ftrl = spec if isinstance(spec, FTRL) else None
    torch.ops.demb.optimizer_update(
        list(values),
        list(slots),
        list(grads),
        list(dims),
        [1] * len(values) if steps is None else list(steps),
        str(spec.kind),
        spec.learning_rate,
        eps,
        adam.beta1 if adam else 0.0,
        adam.beta2 if adam else 0.0,
        adam.weight_decay if adam else 0.0,
        ftrl.learning_rate_power if ftrl else 0.0,
        ftrl.ftrl_beta if ftrl else 0.0,
        ftrl.l1_reg if ftrl else 0.0,
        ftrl.l2_reg if ftrl else 0.0,
    )
