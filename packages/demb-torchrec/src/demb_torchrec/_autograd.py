"""How a training forward hooks the fused optimizer update into ``loss.backward()``.

The looked-up rows leave the forward through an identity whose backward receives their
gradients, reduces them to one row per unique key and table, and updates the tables in place
with demb-optim's fused update: ``demb::summed_update``, one autograd node in C++, for the rows
summed in the dedup's order (:func:`summed_per_key`: the NONE and one-dim pooled forwards), and
:class:`TrainedRows`, a Python node, for the others. The rows are plain tensors, not
parameters: the only tensor that requires grad going in is a zero-size trigger, so no dense
gradient of a table ever exists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from demb_kernels.lookup import segment_plan, sums_need_plan
from demb_optim import (
    OptimizerSpec,
    SummedUpdateOptions,
    apply_update,
    nonfinite,
    summed_update,
    update_settings,
)
from torch.autograd.function import FunctionCtx

from demb_torchrec._dedup import DedupedBatch
from demb_torchrec.errors import InputError

__all__ = [
    "Reduced",
    "TrainStep",
    "TrainedRows",
    "Updatable",
    "summed_per_key",
    "trained_rows",
]

Reduced = tuple[list[torch.Tensor], list[torch.Tensor]]
"""Per table ``(U_t, D_t)`` summed gradients, and what to check for NaN/inf: tensors that hold
all of them (one pass each), or ``()`` bool flags already computed (True: some value is NaN or
infinite)."""


class Updatable(Protocol):
    """What the update needs of the module (the module's
    :class:`~demb_torchrec._state.ForwardState` provides it)."""

    optimizer: OptimizerSpec
    dims: list[int]
    step_counts: torch.Tensor
    """``(T,)`` int64 on the CPU: each table's updates so far (Adam's bias correction)."""
    check_gradients: bool
    sums_workspace: torch.Tensor | None
    """On the CPU, a float32 tensor the backward's sums go into (resized in place)."""

    def value_buffers(self) -> list[torch.Tensor]: ...


class TrainStep:
    """One training forward's rows and what its backward does with their gradients.

    Args:
        module: the tables (the module's forward state).
        rows: the tensors the forward hands autograd.
        slots: per table, ``(U_t,)`` int64 slot of each unique key (-1: not in the table).
        reduce: from the gradients of ``rows`` to per table ``(U_t, D_t)`` summed gradients
            (and the tensors to check, see :data:`Reduced`).
    """

    def __init__(
        self,
        module: Updatable,
        rows: list[torch.Tensor],
        slots: list[torch.Tensor],
        reduce: Callable[[Sequence[torch.Tensor]], Reduced],
    ) -> None:
        self.module = module
        self.rows = rows
        self.slots = slots
        self.reduce = reduce

    def update(self, grads: Sequence[torch.Tensor]) -> None:
        m = self.module
        per_table, holders = self.reduce(grads)
        bad: torch.Tensor | None = None
        if m.check_gradients and holders:
            flags = [h if h.dtype == torch.bool and h.dim() == 0 else nonfinite(h) for h in holders]
            bad = flags[0] if len(flags) == 1 else torch.stack(flags).any()
        reduced = [
            g if g.dtype == torch.float32 and g.is_contiguous() else g.float().contiguous()
            for g in per_table
        ]
        steps: list[int] = (m.step_counts + 1).tolist()
        values = m.value_buffers()
        if bad is None or not bad.is_cuda:  # CPU kernels run in order: the flag first
            if bad is not None and bool(bad):
                _raise_nonfinite()
            apply_update(m.optimizer, values, self.slots, reduced, m.dims, steps, check=False)
        else:
            # The flag goes to the host behind the sums and the update is queued behind it,
            # skipped on the device when set; the host waits for the flag's copy only, so the
            # update runs while autograd finishes its own host work.
            flag = torch.empty((), dtype=torch.bool, pin_memory=True)
            flag.copy_(bad, non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record()
            apply_update(
                m.optimizer,
                values,
                self.slots,
                reduced,
                m.dims,
                steps,
                check=False,  # slots come from the table
                skip=bad,
            )
            copied.synchronize()
            if bool(flag):
                _raise_nonfinite()
        m.step_counts.add_(1)


def _raise_nonfinite() -> None:
    raise InputError(
        "grads", "the embedding gradients contain NaN or infinite values; no row was updated"
    )


class TrainedRows(torch.autograd.Function):
    """Identity on a step's rows; its backward runs the step's update."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, trigger: torch.Tensor, step: TrainStep
    ) -> tuple[torch.Tensor, ...]:
        # The step hands its rows over: they become this node's outputs, and a step that kept
        # them would close a cycle (node -> ctx -> step -> rows -> grad_fn -> node) through
        # autograd's C++ graph, which Python's collector cannot see: each step's graph leaked.
        rows, step.rows = step.rows, []
        ctx.step = step  # type: ignore[attr-defined]
        return tuple(rows)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> tuple[None, None]:
        ctx.step.update(grads)  # type: ignore[attr-defined]
        return None, None


def trained_rows(trigger: torch.Tensor, step: TrainStep) -> tuple[torch.Tensor, ...]:
    """``step.rows`` wired to the update (``TrainedRows.apply`` with types)."""
    out: tuple[torch.Tensor, ...] = TrainedRows.apply(trigger, step)  # type: ignore[no-untyped-call]
    return out


def summed_per_key(
    module: Updatable,
    trigger: torch.Tensor,
    batch: DedupedBatch,
    slots: torch.Tensor,
    out: torch.Tensor,
    dim: int,
    rows: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out`` wired to the update (:func:`demb_optim.summed_update`): its backward sums each
    key's gradient rows in the dedup's sorted order
    (:func:`demb_kernels.lookup.segment_sum_rows`): the rows of ``out``, one per occurrence
    (clipped first when the optimizer clips), or, with ``rows`` / ``scale``, the rows of a
    pooled ``out`` seen as ``(B * F, dim)``, each occurrence's bag times its factor; then checks
    the sums (``check_gradients``) and updates the tables in place. On a GPU rows wider than
    128 floats have the sum's chunks planned now, queued behind the forward's work (narrower
    ones are summed by windows, with no plan; the CPU kernel would only check a plan: it cuts
    the chunks as it sums). The tables' value buffers are those of now: a table that grows
    before the backward would miss this step's update.

    Args:
        module: the tables (the module's forward state); trigger: the zero-size tensor that
            requires grad.
        batch: the deduplicated batch; slots: ``(U,)`` int64 slot of each unique key.
        out: the forward's output; dim: the tables' dim.
        rows, scale: as :func:`demb_kernels.lookup.segment_sum_rows` takes them.

    Returns:
        A view of ``out`` whose backward runs the update.
    """
    plan = None
    if batch.starts.is_cuda and sums_need_plan(dim):
        plan = segment_plan(batch.starts, batch.order.numel())
    options = SummedUpdateOptions(
        order=batch.order,
        starts=batch.starts,
        slots=slots,
        table_sizes=batch.table_sizes(),
        values=module.value_buffers(),
        dims=module.dims,
        steps=module.step_counts,
        settings=update_settings(module.optimizer),
        dim=dim,
        check=module.check_gradients,
        plan=plan,
        rows=rows,
        scale=scale,
        workspace=module.sums_workspace,
        nonfinite=batch.nonfinite,
    )
    return summed_update(trigger, out, options)
