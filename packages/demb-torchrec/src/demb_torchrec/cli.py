"""The ``demb`` command. Until the main job exists it reports the environment."""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import sys
from collections.abc import Sequence

__all__ = ["environment_report", "main"]

_DISTRIBUTIONS = (
    "demb-planner",
    "demb-io",
    "demb-kernels",
    "demb-optim",
    "demb-storage",
    "demb-torchrec",
    "torch",
    "torchrec",
    "fbgemm-gpu",
    "fbgemm-gpu-cpu",
    "numpy",
)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> list[tuple[str, str]]:
    """``(name, value)`` lines: package versions, which kernels are built, the device found."""
    import torch
    from demb_kernels import cuda_kernels_built, has_kernel

    lines = [("python", sys.version.split()[0])]
    lines += [(name, _version(name)) for name in _DISTRIBUTIONS]
    lines.append(("demb CPU kernels", "built" if has_kernel("hash64", "CPU") else "missing"))
    lines.append(("demb CUDA kernels", "built" if cuda_kernels_built() else "not built"))
    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        device = "cpu (no CUDA device visible)"
    lines.append(("device", device))
    try:
        logging.disable(logging.WARNING)  # fbgemm_gpu logs a compatibility-table notice per op
        import fbgemm_gpu  # noqa: F401

        fbgemm = "imports"
    except Exception as error:
        fbgemm = f"fails to import: {type(error).__name__}: {error}"
    finally:
        logging.disable(logging.NOTSET)
    lines.append(("fbgemm_gpu", fbgemm))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``demb``: print the environment report."""
    parser = argparse.ArgumentParser(
        prog="demb", description="demb: dynamic embedding tables. Prints the environment."
    )
    parser.parse_args(argv)
    for name, value in environment_report():
        print(f"{name:<20} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
