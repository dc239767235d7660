"""The child side of conftest's ``run_ranks`` when ranks are forked from a server process that
has imported torch, TorchRec and demb once (:func:`run_script`), instead of each rank being a
fresh ``python SCRIPT ...`` that imports them again (seconds a rank on the CI machine)."""

from __future__ import annotations

import os
import runpy
import sys
import traceback

__all__ = ["PRELOAD", "run_script"]

PRELOAD = ["torch", "torch.distributed", "torchrec", "demb_torchrec", "_rank_join"]
"""What the server process imports before it forks any rank."""


def run_script(script: str, argv: list[str], log: str) -> None:
    """Run ``script`` as ``__main__`` with ``sys.argv = [script, *argv]``, its stdout and stderr
    (the file descriptors too) into ``log``; the process ends with the script's exit code (an
    uncaught exception: its traceback in the log, code 1)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = [script, *argv]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
        if not isinstance(end.code, int | None):
            print(end.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
