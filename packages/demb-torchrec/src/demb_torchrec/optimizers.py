"""Optimizers a TorchRec model gives its dynamic tables through ``apply_optimizer_in_backward``.

TorchRec derives a table's fused optimizer from the in-backward optimizer *class*
(``torchrec.distributed.utils.optimizer_type_to_emb_opt_type``): the class maps to FBGEMM's
``EmbOptimType``. FBGEMM has no FTRL, so :class:`FTRL` is a placeholder class in TorchRec's style
(``torchrec.optim.optimizers``: it never steps; the table applies the update in its backward)
that registers itself in TorchRec's class-to-type table as ``DynamicEmbOptimType.FTRL``. One
mechanism serves the EmbeddingBagCollection path and the EmbeddingCollection path, which
overwrites any optimizer type named in the kwargs.

Example::

    apply_optimizer_in_backward(
        FTRL, model.parameters(), {"lr": 0.01, "l1_reg": 0.001, "initial_accumulator_value": 0.1}
    )
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torchrec.optim as trec_optim
from demb_optim import OptimizerKind, OptimizerSpec
from torchrec.distributed import utils as trec_utils
from torchrec.distributed.planner import shard_estimators

from demb_torchrec._args import optimizer_spec
from demb_torchrec.errors import ConfigError, InputTypeError
from demb_torchrec.options import DynamicEmbOptimType

__all__ = [
    "FTRL",
    "dynamic_optimizer_kind",
    "ftrl_spec",
    "optimizer_multiplier",
    "register_ftrl_emb_opt_type",
    "unregister_ftrl_emb_opt_type",
]

_CLASS_TO_TYPE: dict[type[torch.optim.Optimizer], object] = (
    trec_utils._OPTIMIZER_CLASS_TO_EMB_OPT_TYPE
)
_torchrec_multiplier: Callable[[type[torch.optim.Optimizer] | None, torch.Size], float] = (
    shard_estimators._get_optimizer_multipler
)


def ftrl_spec(kwargs: Mapping[str, float | bool]) -> OptimizerSpec:
    """The demb-optim FTRL spec of in-backward optimizer kwargs (``lr`` is TorchRec's name of
    ``learning_rate``; every other key is an FTRL hyper-parameter: ``learning_rate_power``,
    ``ftrl_beta``, ``l1_reg``, ``l2_reg``, ``initial_accumulator_value``,
    ``gradient_clipping``, ``max_gradient``).

    Raises:
        TypeError: a key that is not an FTRL hyper-parameter (never ignored).
        ValueError: a bad value (:class:`demb_optim.OptimizerConfigError`).
    """
    params = dict(kwargs)
    if "lr" in params:
        if "learning_rate" in params:
            raise InputTypeError("lr", "pass lr or learning_rate, not both")
        params["learning_rate"] = params.pop("lr")
    return optimizer_spec(DynamicEmbOptimType.FTRL, params)


class FTRL(torch.optim.Optimizer):
    """Placeholder for FTRL-Proximal on dynamic tables (it never steps: the table's backward
    applies the update). Constructing it checks the hyper-parameters (:func:`ftrl_spec`) and
    registers the class in TorchRec's class-to-type table (:func:`register_ftrl_emb_opt_type`).

    Args:
        params: the parameters, as ``apply_optimizer_in_backward`` passes them.
        **kwargs: FTRL hyper-parameters (``lr``, ``learning_rate_power``, ``ftrl_beta``,
            ``l1_reg``, ``l2_reg``, ``initial_accumulator_value``, ``gradient_clipping``,
            ``max_gradient``).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs: float | bool) -> None:
        self.spec = ftrl_spec(kwargs)
        register_ftrl_emb_opt_type()
        # TorchRec's placeholders keep these two and nothing else (no param groups).
        self._params = params
        self._kwargs = kwargs

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Never called for a dynamic table (it updates in its backward)."""
        raise NotImplementedError(
            "FTRL is applied by the dynamic table in its backward; it has no step of its own "
            "(use it through apply_optimizer_in_backward on dynamic tables)"
        )


def register_ftrl_emb_opt_type() -> None:
    """Map :class:`FTRL` to ``DynamicEmbOptimType.FTRL`` in TorchRec's class-to-type table
    (idempotent)."""
    _CLASS_TO_TYPE[FTRL] = DynamicEmbOptimType.FTRL


def unregister_ftrl_emb_opt_type() -> None:
    """Undo :func:`register_ftrl_emb_opt_type` (tests restore TorchRec's table with it)."""
    _CLASS_TO_TYPE.pop(FTRL, None)


def optimizer_multiplier(
    optimizer_class: type[torch.optim.Optimizer] | None, shape: torch.Size
) -> float:
    """Optimizer-state elements per embedding element, as TorchRec's storage estimate uses it:
    2 for :class:`FTRL` (``linear`` and ``accum`` per element, like Adam), TorchRec's own
    value for the classes it knows. (TorchRec maps any class it does not know to 1, which
    would undersize an FTRL table by one embedding width per row.)"""
    if optimizer_class is FTRL:
        return 2.0
    return float(_torchrec_multiplier(optimizer_class, shape))


def dynamic_optimizer_kind(
    optimizer_class: type[torch.optim.Optimizer] | None,
) -> OptimizerKind | None:
    """The demb optimizer a dynamic table runs for an in-backward optimizer class (None: no
    optimizer, no state).

    Raises:
        ValueError: a class dynamic tables have no update for, naming it.
    """
    if optimizer_class is None:
        return None
    kind = _DYNAMIC_KINDS.get(optimizer_class)
    if kind is None:
        known = sorted(c.__module__ + "." + c.__qualname__ for c in _DYNAMIC_KINDS)
        raise ConfigError(
            f"optimizer {optimizer_class.__module__}.{optimizer_class.__qualname__}: dynamic "
            f"tables have no update for it (they take {', '.join(known)})"
        )
    return kind


_DYNAMIC_KINDS: dict[type[torch.optim.Optimizer], OptimizerKind] = {
    torch.optim.SGD: OptimizerKind.SGD,
    trec_optim.SGD: OptimizerKind.SGD,
    torch.optim.Adam: OptimizerKind.ADAM,
    trec_optim.Adam: OptimizerKind.ADAM,
    torch.optim.Adagrad: OptimizerKind.ADAGRAD,
    trec_optim.Adagrad: OptimizerKind.ADAGRAD,
    trec_optim.RowWiseAdagrad: OptimizerKind.ROWWISE_ADAGRAD,
    FTRL: OptimizerKind.FTRL,
}
