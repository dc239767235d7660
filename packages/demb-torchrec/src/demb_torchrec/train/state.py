"""What ``demb train`` writes besides its logs, and how a run or a replica finds it again.

Under the output directory::

    deltas/00000200.delta/   an incremental dump of the tables (demb-io delta format)
    deltas/00000200.pt       the dense part at that step (written after the delta: its presence
                             marks the delta complete)
    ckpt/00000600.tables/    a full DynamicEmbDump (optim=True; every key with its slot)
    ckpt/00000600.pt         the dense part at that step (written once the dump committed)

A *dense state* (``.pt``) holds the step, the dense parameters and their optimizer's state, the
tables' step counters and update counts, and the next delta's threshold: with the tables of
the same step it is everything a resumed run needs to go on exactly as the uninterrupted run
did (the metric windows are empty at those steps: deltas and checkpoints fall on report
steps). Every file is written to a temporary name and renamed: a killed run leaves whole
files.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from demb_torchrec.errors import CheckpointError

__all__ = ["OnlinePaths", "Saved", "load_dense", "save_dense"]


@dataclass(frozen=True)
class Saved:
    """A complete delta or checkpoint: its step, its tables' path and its dense state's."""

    step: int
    tables: Path
    dense: Path


class OnlinePaths:
    """The delta and checkpoint files of one run's output directory ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.deltas = root / "deltas"
        self.ckpts = root / "ckpt"

    def delta(self, step: int) -> Saved:
        return Saved(step, self.deltas / f"{step:08d}.delta", self.deltas / f"{step:08d}.pt")

    def ckpt(self, step: int) -> Saved:
        return Saved(step, self.ckpts / f"{step:08d}.tables", self.ckpts / f"{step:08d}.pt")

    def complete_deltas(self, after: int = -1) -> list[Saved]:
        """The complete deltas of steps > ``after``, in step order."""
        return [d for d in self._scan(self.deltas, ".delta") if d.step > after]

    def last_ckpt(self) -> Saved | None:
        """The latest complete checkpoint, if any."""
        found = list(self._scan(self.ckpts, ".tables"))
        return found[-1] if found else None

    def _scan(self, folder: Path, suffix: str) -> Iterator[Saved]:
        if not folder.is_dir():
            return
        steps = sorted(
            int(p.stem) for p in folder.glob(f"*{suffix}") if p.stem.isdigit() and p.is_dir()
        )
        for step in steps:
            saved = Saved(step, folder / f"{step:08d}{suffix}", folder / f"{step:08d}.pt")
            if saved.dense.is_file():
                yield saved

    def remove_after(self, step: int) -> None:
        """Remove every delta and checkpoint file of a step after ``step`` (complete or not):
        a resumed run writes them again."""
        for folder in (self.deltas, self.ckpts):
            if not folder.is_dir():
                continue
            for p in folder.iterdir():
                head = p.name.split(".", 1)[0]
                if head.isdigit() and int(head) > step:
                    if p.is_dir():
                        shutil.rmtree(p, ignore_errors=True)
                    else:
                        p.unlink(missing_ok=True)


def save_dense(path: Path, state: dict[str, Any]) -> None:
    """Write a dense state atomically (a temporary file, fsynced, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_dense(path: Path) -> dict[str, Any]:
    """Read a dense state.

    Raises:
        CheckpointError: the file cannot be read.
    """
    try:
        state: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for a bad file
        raise CheckpointError(f"{path}: not a readable dense state ({err})") from err
    return state
