"""demb-optim: one spec per optimizer (hyper-parameters, per-row state, initial state).

:mod:`demb_optim.specs` has the specs (SGD, Adam, Adagrad, row-wise Adagrad, FTRL);
:mod:`demb_optim.reference` the float64 reference updates the fused kernels are tested against;
:mod:`demb_optim.gradients` clips and sums per-occurrence gradients;
:func:`demb_optim.apply_update` runs the fused update (``demb::optimizer_update``);
:func:`demb_optim.summed_update` wires a forward's rows to it through one autograd node
(``demb::summed_update``).
"""

from demb_optim._errors import OptimizerConfigError
from demb_optim.gradients import clip_gradient, nonfinite, reduce_gradients
from demb_optim.reference import reference_update
from demb_optim.specs import (
    FTRL,
    ROWWISE_ADAGRAD_STATE_BYTES,
    SGD,
    SPEC_TYPES,
    Adagrad,
    Adam,
    OptimizerKind,
    OptimizerSpec,
    RowWiseAdagrad,
    optimizer_state_bytes,
)
from demb_optim.summed import SummedUpdateOptions, UpdateSettings, summed_update, update_settings
from demb_optim.update import UpdateParameters, apply_update, update_parameters

__all__ = [
    "FTRL",
    "ROWWISE_ADAGRAD_STATE_BYTES",
    "SGD",
    "SPEC_TYPES",
    "Adagrad",
    "Adam",
    "OptimizerConfigError",
    "OptimizerKind",
    "OptimizerSpec",
    "RowWiseAdagrad",
    "SummedUpdateOptions",
    "UpdateParameters",
    "UpdateSettings",
    "apply_update",
    "clip_gradient",
    "nonfinite",
    "optimizer_state_bytes",
    "reduce_gradients",
    "reference_update",
    "summed_update",
    "update_parameters",
    "update_settings",
]
