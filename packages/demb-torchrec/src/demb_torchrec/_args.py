"""The table module's argument handling: its optimizer, its device, and the checks of a
forward's batch (the spec's errors, each naming the argument)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any, cast

import torch
from demb_optim import SPEC_TYPES, OptimizerKind, OptimizerSpec
from demb_storage import TableConfigError

from demb_torchrec.errors import DembError, InputError, InputTypeError
from demb_torchrec.options import DynamicEmbPoolingMode, DynamicEmbTableOptions

__all__ = [
    "batch_error",
    "check_batch_args",
    "check_offsets",
    "check_weight_args",
    "optimizer_spec",
    "resolve_device",
]

_ARGUMENT = re.compile(r"(indices|offsets|counters|keys)\b")
"""The batch arguments the native ops' checks name first in their messages (a table's ``keys``
are the module's ``indices``)."""


def batch_error(error: ValueError, tables: list[str]) -> ValueError:
    """``error``, raised by a native op's check of a batch's data, as an :class:`InputError`
    naming its argument (the one the message starts with, as ``offsets: ...``; else ``batch``)
    and the ``tables`` whose batch it is; an error of demb's own is returned as it is."""
    if isinstance(error, DembError):
        return error
    message = str(error)
    found = _ARGUMENT.match(message)
    argument = "batch" if found is None else found.group(1).replace("keys", "indices")
    reason = message.removeprefix(f"{found.group(1)}: ") if found else message
    return InputError(argument, f"{reason} (the batch of tables {tables})")


def check_offsets(offsets: torch.Tensor, n: int) -> None:
    """For a path that reads the offsets without a native op's check: raises the
    ``ValueError`` such a check raises (the module names the tables: :func:`batch_error`)
    unless the ``(F * B + 1,)`` ``offsets`` start at 0, never decrease and end at ``n`` (one
    sync)."""
    bad = (offsets[0] != 0) | (offsets[-1] != n) | (offsets.diff() < 0).any()
    if bool(bad):
        raise ValueError(
            f"offsets: must start at 0, never decrease and end at {n} (the number of indices)"
        )


def optimizer_spec(optimizer: object, hyper_parameters: dict[str, float | bool]) -> OptimizerSpec:
    """The demb-optim spec of ``optimizer`` (an ``OptimizerSpec``, FBGEMM's ``EmbOptimType``,
    ``DynamicEmbOptimType`` or a name) with FBGEMM-style keyword hyper-parameters.

    Raises:
        TypeError: a keyword that is not a hyper-parameter of this optimizer (never ignored).
        ValueError: a bad value (:class:`demb_optim.OptimizerConfigError`).
    """
    if isinstance(optimizer, OptimizerSpec):
        if hyper_parameters:
            raise InputTypeError(
                "hyper_parameters",
                f"{sorted(hyper_parameters)} given beside an OptimizerSpec (it holds them all)",
            )
        return optimizer
    spec_type = SPEC_TYPES[OptimizerKind.parse(optimizer)]
    known = [f.name for f in dataclasses.fields(spec_type)]
    unknown = sorted(set(hyper_parameters) - set(known))
    if unknown:
        raise InputTypeError(
            ", ".join(unknown),
            f"not hyper-parameters of {spec_type.kind} (it takes {', '.join(known)})",
        )
    return spec_type(**cast(dict[str, Any], hyper_parameters))


def resolve_device(
    device: torch.device | str | int | None, options: Sequence[DynamicEmbTableOptions]
) -> torch.device:
    """The module's device, with its index (``cuda`` means the current CUDA device)."""
    if device is None:
        ids = {o.device_id for o in options if o.device_id is not None}
        if len(ids) > 1:
            raise TableConfigError("device_id", sorted(ids), "tables of one module share a device")
        if ids:
            device = ids.pop()
        elif torch.cuda.is_available():
            device = "cuda"
        else:
            device = "cpu"
    resolved = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
    if str(resolved) == "cuda":  # no index: the current device
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def check_batch_args(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    device: torch.device,
    index_type: torch.dtype | None,
    features: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``indices`` and ``offsets`` as int64 and the batch size ``B``, or a TypeError /
    ValueError naming the argument."""
    for name, t in (("indices", indices), ("offsets", offsets)):
        if t.dtype not in (torch.int64, torch.int32) or t.dim() != 1:
            raise InputTypeError(
                name, f"must be a 1-D int64 or int32 tensor, got {t.dtype} {tuple(t.shape)}"
            )
        if t.device != device:
            raise InputError(name, f"on {t.device}, the module on {device}")
    if index_type is not None and indices.dtype != index_type:
        raise InputTypeError(
            "indices", f"{indices.dtype}, but the tables' index_type is {index_type}"
        )
    if offsets.numel() < 1 or (offsets.numel() - 1) % features:
        raise InputError(
            "offsets", f"{offsets.numel()} entries; expected F * B + 1 with F={features} features"
        )
    return _int64(indices), _int64(offsets), (offsets.numel() - 1) // features


def _int64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 else t.to(torch.int64)


def check_weight_args(
    indices: torch.Tensor,
    weights: torch.Tensor | None,
    counters: torch.Tensor | None,
    mode: DynamicEmbPoolingMode,
) -> None:
    """The spec's rules for ``pooling_weights`` and ``frequency_counters`` (ValueError)."""
    if counters is not None and (counters.shape != indices.shape or counters.is_floating_point()):
        raise InputError("frequency_counters", "must be an integer tensor shaped like indices")
    if weights is None:
        return
    if mode is not DynamicEmbPoolingMode.SUM:
        raise InputError("pooling_weights", f"only SUM pooling takes weights, not {mode.name}")
    if weights.dtype != torch.float32:
        raise InputError("pooling_weights", f"must be float32, got {weights.dtype}")
    if weights.numel() != indices.numel():
        raise InputError(
            "pooling_weights", f"{weights.numel()} weights for {indices.numel()} indices"
        )
    if weights.requires_grad and torch.is_grad_enabled():
        raise InputError(
            "pooling_weights",
            "requires grad, but weights are not differentiable (detach them, or look up under "
            "torch.no_grad())",
        )
    if counters is not None:
        raise InputError(
            "pooling_weights and frequency_counters",
            "pass one of them (both ride the one KJT weights channel)",
        )
