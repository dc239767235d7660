"""The fused optimizer update: rows ``[embedding | state]`` of several tables updated in place.

``apply_update`` calls ``demb::optimizer_update`` (C++ on the CPU, a CUDA kernel on GPUs) with
a spec's hyper-parameters. Arithmetic is float32 whatever the rows' dtype
(float32, float16 or bfloat16); the state is stored in the rows' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import demb_kernels  # noqa: F401  (loads the native ops)
import torch

from demb_optim.gradients import nonfinite
from demb_optim.specs import FTRL, Adagrad, Adam, OptimizerSpec, RowWiseAdagrad

__all__ = ["UpdateParameters", "apply_update", "update_parameters"]


def _check_data(
    values: Sequence[torch.Tensor], slots: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
) -> None:
    """Non-finite gradients and (off the CPU) out-of-range slots, with one sync for all tables."""
    flags: list[torch.Tensor] = []
    for v, s, g in zip(values, slots, grads, strict=False):
        bad_grad = nonfinite(g)
        bad_slot = torch.zeros((), dtype=torch.bool, device=g.device)
        if s.device.type != "cpu" and s.numel() > 0 and v.dim() > 0:
            bad_slot = ((s < -1) | (s >= v.shape[0])).any().to(g.device)
        flags.append(torch.stack([bad_grad, bad_slot]))
    if not flags:
        return
    found = torch.stack([f.to(flags[0].device) for f in flags]).tolist()
    for t, (bad_grad, bad_slot) in enumerate(found):
        if bad_grad:
            raise ValueError(f"grads[{t}]: contains NaN or infinite values; no row was updated")
        if bad_slot:
            raise ValueError(
                f"slots[{t}]: a slot is out of range for {values[t].shape[0]} rows "
                "(-1 skips a row); no row was updated"
            )


def apply_update(
    spec: OptimizerSpec,
    values: Sequence[torch.Tensor],
    slots: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    dims: Sequence[int],
    steps: Sequence[int] | None = None,
    *,
    check: bool = True,
    skip: torch.Tensor | None = None,
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
        check: before any row changes, check that every gradient is finite and (on a GPU,
            where the kernel would skip them) every slot is in ``[-1, rows)``: one
            synchronizing reduction on CUDA. The CPU kernel always checks slots.
        skip: a ``()`` bool tensor on the values' device: when True the update changes no row.
            A caller that computed a NaN/inf flag on the device passes it here and reads it
            back afterwards, so the check costs no sync before the update.

    Raises:
        ValueError / TypeError: a shape, dtype, slot or non-finite gradient (the message names
            the table); no row is changed then.
    """
    if check:
        _check_data(values, slots, grads)
    torch.ops.demb.optimizer_update(
        list(values),
        list(slots),
        list(grads),
        list(dims),
        [1] * len(values) if steps is None else list(steps),
        str(spec.kind),
        *update_parameters(spec),
        skip,
    )


class UpdateParameters(NamedTuple):
    """The nine floats ``demb::optimizer_update`` and ``demb::summed_update`` take after the
    optimizer's name, in this order (0.0 where the optimizer has no such parameter). A tuple:
    pass it as ``*params`` or as the ops' ``float[]``."""

    learning_rate: float
    eps: float
    beta1: float
    beta2: float
    weight_decay: float
    learning_rate_power: float
    """FTRL's."""
    ftrl_beta: float
    l1_reg: float
    l2_reg: float


def update_parameters(spec: OptimizerSpec) -> UpdateParameters:
    """:class:`UpdateParameters` of ``spec``."""
    eps = spec.eps if isinstance(spec, Adam | Adagrad | RowWiseAdagrad) else 0.0
    adam = spec if isinstance(spec, Adam) else None
    ftrl = spec if isinstance(spec, FTRL) else None
    return UpdateParameters(
        learning_rate=spec.learning_rate,
        eps=eps,
        beta1=adam.beta1 if adam else 0.0,
        beta2=adam.beta2 if adam else 0.0,
        weight_decay=adam.weight_decay if adam else 0.0,
        learning_rate_power=ftrl.learning_rate_power if ftrl else 0.0,
        ftrl_beta=ftrl.ftrl_beta if ftrl else 0.0,
        l1_reg=ftrl.l1_reg if ftrl else 0.0,
        l2_reg=ftrl.l2_reg if ftrl else 0.0,
    )
