"""The baselines of ``demb bench delta``: copies of the same bytes as each figure moves, timed
in the same run (:mod:`demb_torchrec.bench.delta_bench`)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.bench.workload import timed

__all__ = ["Copies", "copier", "nbytes", "row_copies", "snapshot_tensors"]

_COPY_CHUNK = 1 << 28  # bytes per copy of the snapshot baseline (256 MiB)


class Copies:
    """The copy baselines of the delta's bytes: device to host (pinned and pageable) and host
    to device on CUDA, host to host on the CPU; buffers made once, touched before timing."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        cuda = device.type == "cuda"
        self.dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.pinned = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.pageable = torch.ones(nbytes, dtype=torch.uint8) if cuda else None

    def d2h_pinned(self) -> float:
        return timed(lambda: self.pinned.copy_(self.dev), self.device)

    def d2h_pageable(self) -> float:
        assert self.pageable is not None
        pageable = self.pageable
        return timed(lambda: pageable.copy_(self.dev), self.device)

    def h2d_pinned(self) -> float:
        return timed(lambda: self.dev.copy_(self.pinned), self.device)


def row_copies(
    model: DynamicEmbeddingTables, replica: DynamicEmbeddingTables, slots: list[torch.Tensor]
) -> tuple[Callable[[], float], Callable[[], float]]:
    """Timers (seconds) of the random-row copies a dump and a replay of a delta cannot avoid:
    its rows (``slots`` per table) gathered by slot from the model's value buffers into fresh
    buffers, and the same rows scattered into the replica's at the same slots (which, after the
    replay, rewrites what it holds: the replica does not change)."""
    tables = model.tables
    at = [s.to(tables.device) for s in slots]
    rows = [tables.read(t, s) for t, s in enumerate(at)]

    def gather() -> None:
        for t, s in enumerate(at):
            tables.read(t, s)

    def scatter() -> None:
        for t, (s, r) in enumerate(zip(at, rows, strict=True)):
            replica.tables.write(t, s, r)

    return partial(timed, gather, tables.device), partial(timed, scatter, tables.device)


def snapshot_tensors(model: DynamicEmbeddingTables) -> list[torch.Tensor]:
    """What a dump's snapshot copies: the index's keys, digests, score words and sizes, and
    every table's value rows (with optimizer state)."""
    index = model.tables.index
    return [index.keys, index.digests, index.scores, index.sizes, *model.tables.values]


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def copier(tensors: list[torch.Tensor], device: torch.device) -> Callable[[], None]:
    """A copy of every byte of ``tensors`` on their device into one scratch buffer, 256 MiB
    at a time."""
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
    largest = max(f.numel() for f in flat)
    scratch = torch.empty(min(largest, _COPY_CHUNK), dtype=torch.uint8, device=device)

    def copy() -> None:
        for f in flat:
            for start in range(0, f.numel(), _COPY_CHUNK):
                part = f[start : start + _COPY_CHUNK]
                scratch[: part.numel()].copy_(part)

    return copy
