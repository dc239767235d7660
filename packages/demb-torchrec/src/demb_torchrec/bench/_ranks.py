"""What the multi-rank benchmarks share: one process per rank (spawned), each on its own GPU
over NCCL when CUDA is visible, else on the CPU over gloo; rank 0 writes the report."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import start_processes

__all__ = ["end_rank", "finish_rank", "init_rank", "machine", "spawn_ranks"]

W = TypeVar("W")


def init_rank(rank: int, world_size: int, store_path: str) -> torch.device:
    """Join the process group (file store ``store_path``); returns this rank's device. Quiets
    TorchRec's logging and warnings (the benchmarks print their own lines)."""
    logging.disable(logging.WARNING)
    warnings.filterwarnings("ignore")
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
    )
    return device


def machine(device: torch.device) -> dict[str, str]:
    """The report's ``device`` (the GPU's name, or ``cpu``) and ``backend`` fields."""
    on_gpu = device.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "backend": "nccl" if on_gpu else "gloo",
    }


def end_rank() -> NoReturn:
    """Wait for every rank (none leaves while another still talks to it), leave the process
    group, and end this rank's process at once (exit status 0, output flushed). The
    interpreter's teardown is skipped: clean-clone CI runs saw a gloo rank abort there
    ('terminate called without an active exception') after its results were written."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def finish_rank(report: dict[str, Any] | None, out: str | None) -> NoReturn:
    """Write ``report`` (rank 0's; None on the others) to ``out`` as JSON, then
    :func:`end_rank`."""
    if report is not None:
        with open(out or os.devnull, "w") as f:
            json.dump(report, f, indent=2)
    end_rank()


def spawn_ranks(
    target: Callable[[int, W, str, str], None],
    workload: W,
    world_size: int,
    preload: Sequence[str] = (),
) -> dict[str, Any]:
    """Run ``target(rank, workload, store_path, report_path)`` on ``world_size`` local ranks;
    returns the JSON report rank 0 wrote.

    Each rank is a fresh process (``spawn``). With ``preload`` and no CUDA device visible, ranks
    are forked instead from a server process (``forkserver``, started once per process) that
    has imported the ``preload`` modules, so that several runs import them once. Not with CUDA:
    the imports ask CUDA for its devices, after which a forked process cannot use CUDA.

    Raises:
        ValueError: more ranks than visible GPUs.
    """
    gpus = torch.cuda.device_count()
    if gpus and world_size > gpus:
        raise ValueError(f"world_size={world_size}: only {gpus} GPUs are visible")
    method = "spawn"
    if preload and not gpus:
        method = "forkserver"
        multiprocessing.get_context(method).set_forkserver_preload(list(preload))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        store = os.path.join(tmp, "store")
        start_processes(  # type: ignore[no-untyped-call]
            target, args=(workload, store, out), nprocs=world_size, start_method=method
        )
        with open(out) as f:
            report: dict[str, Any] = json.load(f)
    return report
