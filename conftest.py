"""Root pytest configuration: `cuda` tests are skipped where they cannot run."""

from __future__ import annotations

import pytest


def _cuda_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    from demb_kernels import cuda_kernels_built

    if not cuda_kernels_built():
        return "demb-kernels was built without CUDA kernels (DEMB_CUDA=0 or no GPU at build)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("cuda" in item.keywords for item in items):
        return
    reason = _cuda_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
