"""Root pytest configuration: where no GPU can run them, `cuda` tests are left out.

Without a CUDA device (or without demb's CUDA kernels) the tests marked ``cuda`` are deselected
and one line of the summary says how many and why. ``pytest -m cuda`` asks for them explicitly:
there they are kept and skipped with the reason, so an empty GPU run is visible as such.
"""

from __future__ import annotations

import pytest

_DESELECTED = pytest.StashKey[tuple[int, str]]()


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


def _asks_for_cuda(config: pytest.Config) -> bool:
    expression = str(config.getoption("markexpr") or "")
    return "cuda" in expression and "not cuda" not in expression


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda_items = [item for item in items if "cuda" in item.keywords]
    if not cuda_items:
        return
    reason = _cuda_skip_reason()
    if reason is None:
        return
    if _asks_for_cuda(config):
        skip = pytest.mark.skip(reason=reason)
        for item in cuda_items:
            item.add_marker(skip)
        return
    items[:] = [item for item in items if "cuda" not in item.keywords]
    config.hook.pytest_deselected(items=cuda_items)
    config.stash[_DESELECTED] = (len(cuda_items), reason)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    deselected = terminalreporter.config.stash.get(_DESELECTED, None)
    if deselected is not None:
        count, reason = deselected
        terminalreporter.write_line(
            f"{count} CUDA test{'s' if count != 1 else ''} deselected ({reason}); "
            "on a GPU machine run: pytest -m cuda"
        )
