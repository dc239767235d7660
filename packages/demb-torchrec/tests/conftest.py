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
    """A launcher of multi-rank tests: ``run(script, world, *args)`` runs ``world`` ranks of
    ``python SCRIPT RANK WORLD STORE OUT *args`` sharing a FileStore under ``tmp_path``, checks
    that each exits 0 (its log's tail in the message) and returns what each rank saved to its
    ``OUT`` (``torch.load``).

    Without a visible GPU the ranks are forked from a server process that imported torch,
    TorchRec and demb once (``forkserver``, :mod:`_rank_launch`); each still runs the script as
    ``__main__`` in a process of its own. With a GPU each rank is a fresh interpreter: a process
    forked after those imports asked CUDA for its devices could not use CUDA."""

    runs = [0]

    def run(script: Path, world: int, *args: str) -> list[Any]:
        import torch

        runs[0] += 1  # each run its own store and outputs (a test may launch several)
        store = tmp_path / f"store{runs[0]}"
        outs = [tmp_path / f"run{runs[0]}-rank{r}.pt" for r in range(world)]
        argv = [[*map(str, (r, world, store, outs[r])), *args] for r in range(world)]
        if torch.cuda.is_available():
            logs, codes = _fresh_ranks(script, argv)
        else:
            logs, codes = _forked_ranks(script, argv, tmp_path / f"run{runs[0]}")
        for r, code in enumerate(codes):
            assert code == 0, f"rank {r} failed (exit code {code}):\n{logs[r][-4000:]}"
        return [torch.load(o, weights_only=False) for o in outs]

    return run


def _fresh_ranks(script: Path, argv: list[list[str]]) -> tuple[list[str], list[int | None]]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *a], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for a in argv
    ]
    logs = [p.communicate(timeout=_RANK_TIMEOUT)[0].decode(errors="replace") for p in procs]
    return logs, [p.returncode for p in procs]


def _forked_ranks(
    script: Path, argv: list[list[str]], prefix: Path
) -> tuple[list[str], list[int | None]]:
    import multiprocessing

    import _rank_launch

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_rank_launch.PRELOAD)
    paths = [Path(f"{prefix}-rank{r}.log") for r in range(len(argv))]
    procs = [
        ctx.Process(target=_rank_launch.run_script, args=(str(script), a, str(log)))
        for a, log in zip(argv, paths, strict=True)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=_RANK_TIMEOUT)
    for p in procs:
        if p.is_alive():  # a hung rank: stopped, reported as failed
            p.kill()
            p.join()
    logs = [log.read_text(errors="replace") if log.exists() else "" for log in paths]
    return logs, [p.exitcode for p in procs]


_RANK_TIMEOUT = 900
"""Seconds a multi-rank run may take."""
