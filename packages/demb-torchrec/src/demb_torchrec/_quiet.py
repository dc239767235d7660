"""Quiet imports and runs of TorchRec for command-line jobs: the notices its dependencies print
on every import or first call (fbgemm_gpu's per-op compatibility notice, deprecations inside
TorchRec) say nothing about the user's run and bury its output."""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_import", "quiet_torchrec"]

_NOISE = (
    "`_get_pg_default_device` will be deprecated",
    "Multiple backends are registered with this ProcessGroup",
    "Positional args are being deprecated",
)
"""Warnings raised inside TorchRec at every run (not the caller's doing)."""


def quiet_import() -> None:
    """Import TorchRec (through demb's lookup module) with logging below ERROR off: fbgemm_gpu
    logs a notice per op the first time."""
    logging.disable(logging.WARNING)
    try:
        import demb_torchrec.lookup  # noqa: F401
    finally:
        logging.disable(logging.NOTSET)


def quiet_torchrec() -> None:
    """:func:`quiet_import` of TorchRec and its model-parallel wrapper, and silence TorchRec's
    own deprecation warnings and the planner's dry-run notice."""
    for text in _NOISE:
        warnings.filterwarnings("ignore", message=f".*{text}.*")
    logging.getLogger("torchrec.distributed.planner.storage_reservations").setLevel(logging.ERROR)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    quiet_import()
    logging.disable(logging.WARNING)
    try:
        import torchrec.distributed.model_parallel  # noqa: F401
    finally:
        logging.disable(logging.NOTSET)
