"""The rank side of conftest's ``run_ranks``: a rank script runs as
``python SCRIPT RANK WORLD STORE OUT ARGS... [DEVICE]``; :func:`join` reads that, puts the rank
on its device and joins the process group; :func:`leave` leaves it."""

from __future__ import annotations

import sys
from typing import NamedTuple, NoReturn

import torch
import torch.distributed as dist
from demb_torchrec.bench._ranks import end_rank


class Rank(NamedTuple):
    rank: int
    world: int
    out: str
    """Where the rank saves its results (``torch.save``)."""
    device: torch.device
    args: list[str]
    """The script's own arguments (ARGS)."""


def join(own_args: int) -> Rank:
    """Read ``RANK WORLD STORE OUT``, the script's ``own_args`` arguments and an optional DEVICE
    after them (``cuda``: rank ``r`` on GPU ``r`` over NCCL; else the CPU over gloo); set the
    CUDA device and join the process group over the FileStore at STORE."""
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    end = 5 + own_args
    on_gpu = len(sys.argv) > end and sys.argv[end] == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        store=dist.FileStore(store, world),
        rank=rank,
        world_size=world,
    )
    return Rank(rank, world, out, device, sys.argv[5:end])


def leave() -> NoReturn:
    """Wait for every rank, leave the process group and end the process
    (:func:`demb_torchrec.bench._ranks.end_rank`, which the benchmarks' ranks end with too)."""
    end_rank()
