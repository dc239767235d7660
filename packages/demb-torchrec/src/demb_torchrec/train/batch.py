"""The batch every data source of ``demb train`` yields: one click log sample per row.

A :class:`ClickBatch` has the shape of the Criteo click logs: 13 dense (integer count) features,
26 categorical features with one id each, and a 0/1 label. Sources (:mod:`.synthetic`,
:mod:`.criteo`) fill it on the CPU; the training loop moves and splits it.

The 64-bit mix both sources hash ids with, :func:`splitmix64`, lives here too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from demb_torchrec.errors import InputError, InputTypeError

__all__ = [
    "ID_MASK",
    "NUM_DENSE",
    "NUM_SPARSE",
    "ClickBatch",
    "feature_names",
    "splitmix64",
]

NUM_DENSE = 13
"""Dense (integer count) features per sample: Criteo's ``I1``..``I13``."""

NUM_SPARSE = 26
"""Categorical features per sample: Criteo's ``C1``..``C26``, one id each."""

ID_MASK = 0x7FFF_FFFF_FFFF_FFFF
"""Ids are 64-bit hashes with the top bit cleared, so every id is a non-negative ``int64``."""

_SPLITMIX_C1 = 0xBF58476D1CE4E5B9
_SPLITMIX_C2 = 0x94D049BB133111EB


def splitmix64(bits: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """The splitmix64 finalizer, a bijection of the 64-bit patterns with full avalanche.

    ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
    z ^= z >> 31``, all modulo 2**64.

    Args:
        bits: ``uint64`` array, any shape (not modified).

    Returns:
        ``uint64`` array of the same shape.
    """
    with np.errstate(over="ignore"):
        z = bits ^ (bits >> np.uint64(30))
        z *= np.uint64(_SPLITMIX_C1)
        z ^= z >> np.uint64(27)
        z *= np.uint64(_SPLITMIX_C2)
        z ^= z >> np.uint64(31)
    return z


def feature_names() -> list[str]:
    """The names of the sparse features, in column order: ``["cat_0", ..., "cat_25"]``."""
    return [f"cat_{i}" for i in range(NUM_SPARSE)]


@dataclass(frozen=True)
class ClickBatch:
    """``B`` click log samples, on the CPU as the sources make them (any device after ``.to``).

    Attributes:
        dense: ``(B, 13)`` float32, ``log1p(max(x, 0))`` of the integer features; a missing
            value is 0.
        sparse: ``(B, 26)`` int64 ids, each ``>= 0``: one id per sample and categorical feature,
            in the order of :func:`feature_names`.
        labels: ``(B,)`` float32 in ``{0., 1.}`` (1 = click).

    Raises:
        InputTypeError: a tensor of another dtype.
        InputError: shapes that do not agree as above.
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor

    def __post_init__(self) -> None:
        for name, dtype in (
            ("dense", torch.float32),
            ("sparse", torch.int64),
            ("labels", torch.float32),
        ):
            got = getattr(self, name).dtype
            if got != dtype:
                raise InputTypeError(name, f"must be {dtype}, got {got}")
        b = self.labels.shape[0] if self.labels.dim() == 1 else -1
        if b < 0:
            raise InputError("labels", f"must be (B,), got {tuple(self.labels.shape)}")
        if tuple(self.dense.shape) != (b, NUM_DENSE):
            raise InputError("dense", f"must be ({b}, {NUM_DENSE}), got {tuple(self.dense.shape)}")
        if tuple(self.sparse.shape) != (b, NUM_SPARSE):
            raise InputError(
                "sparse", f"must be ({b}, {NUM_SPARSE}), got {tuple(self.sparse.shape)}"
            )

    def __len__(self) -> int:
        """``B``, the number of samples."""
        return int(self.labels.shape[0])

    def slice(self, start: int, stop: int) -> ClickBatch:
        """Rows ``[start, stop)`` (Python slice semantics, views of the same storage)."""
        return ClickBatch(self.dense[start:stop], self.sparse[start:stop], self.labels[start:stop])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ClickBatch:
        """The same samples on ``device``."""
        return ClickBatch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
        )

    @staticmethod
    def from_numpy(
        dense: npt.NDArray[np.float32],
        sparse: npt.NDArray[np.int64],
        labels: npt.NDArray[np.float32],
    ) -> ClickBatch:
        """A batch sharing the memory of numpy arrays of the dtypes and shapes above."""
        return ClickBatch(
            torch.from_numpy(dense), torch.from_numpy(sparse), torch.from_numpy(labels)
        )

    @staticmethod
    def concat(batches: list[ClickBatch]) -> ClickBatch:
        """The rows of ``batches`` one after the other (at least one batch)."""
        if not batches:
            raise InputError("batches", "must hold at least one batch")
        return ClickBatch(
            torch.cat([b.dense for b in batches]),
            torch.cat([b.sparse for b in batches]),
            torch.cat([b.labels for b in batches]),
        )
