"""Fixtures of the demb-torchrec tests."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The tests' shared modules (``_online_common``, ...) import by name: pytest's importlib mode
# puts no test directory on the path.
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def registry() -> Iterator[None]:
    """TorchRec's optimizer class-to-type table is left as the test found it: an FTRL entry a
    test made (constructing FTRL registers it) is undone in teardown, so no later test in the
    process sees FTRL registered by accident."""
    from demb_torchrec.optimizers import (
        FTRL,
        register_ftrl_emb_opt_type,
        unregister_ftrl_emb_opt_type,
    )
    from torchrec.distributed.utils import _OPTIMIZER_CLASS_TO_EMB_OPT_TYPE

    had = FTRL in _OPTIMIZER_CLASS_TO_EMB_OPT_TYPE
    yield
    if had:
        register_ftrl_emb_opt_type()
    else:
        unregister_ftrl_emb_opt_type()


@pytest.fixture
def run_ranks(tmp_path: Path) -> Callable[..., list[Any]]:
    """A launcher of multi-rank tests: ``run(script, world, *args)`` starts ``world``
    processes ``python SCRIPT RANK WORLD STORE OUT *args`` sharing a FileStore under
    ``tmp_path``, checks that each exits 0 (its log's tail in the message) and returns what each
    rank saved to its ``OUT`` (``torch.load``)."""

    runs = [0]

    def run(script: Path, world: int, *args: str) -> list[Any]:
        import torch

        runs[0] += 1  # each run its own store and outputs (a test may launch several)
        store = tmp_path / f"store{runs[0]}"
        outs = [tmp_path / f"run{runs[0]}-rank{r}.pt" for r in range(world)]
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), *map(str, (r, world, store, outs[r])), *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            for r in range(world)
        ]
        logs = [p.communicate(timeout=900)[0].decode(errors="replace") for p in procs]
        for r, p in enumerate(procs):
            assert p.returncode == 0, f"rank {r} failed:\n{logs[r][-4000:]}"
        return [torch.load(o, weights_only=False) for o in outs]

    return run
