"""The numbers ``demb train`` reports: loss, AUC and log loss over every rank's samples
(torchmetrics), and the tables' statistics summed over ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics.functional.classification import binary_auroc

from demb_torchrec.stats import table_stats
from demb_torchrec.train.model import Rank

__all__ = ["Window", "auc_logloss", "gather", "tables_record"]


def gather(x: torch.Tensor, rank: Rank) -> torch.Tensor:
    """``x`` (1-D, the same length on every rank) of every rank, concatenated in rank order
    (collective)."""
    if rank.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(rank.world_size)]
    dist.all_gather(parts, x.contiguous(), group=rank.group)
    return torch.cat(parts)


def auc_logloss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    """AUC and mean log loss of ``(n,)`` logits against ``(n,)`` 0/1 labels."""
    auc = float(binary_auroc(torch.sigmoid(logits.double()), labels.long()))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double())
    return auc, float(loss)


@dataclass
class Window:
    """This rank's training samples since the last report: loss sum, logits and labels."""

    loss_sum: float = 0.0
    steps: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)
    labels: list[torch.Tensor] = field(default_factory=list)

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One step: ``loss`` the mean over this rank's slice of the batch (a 0-d tensor)."""
        self.loss_sum += float(loss)
        self.steps += 1
        self.logits.append(logits.detach().cpu())
        self.labels.append(labels.detach().cpu())

    def report(self, rank: Rank) -> dict[str, float]:
        """The global mean loss per step and the AUC over every rank's samples since the last
        report (collective); empties the window."""
        total = torch.tensor([self.loss_sum], dtype=torch.float64)
        if rank.world_size > 1:  # equal slices: the global mean is the mean of the ranks'
            dist.all_reduce(total, group=rank.group)
            total /= rank.world_size
        logits = gather(torch.cat(self.logits).float(), rank)
        labels = gather(torch.cat(self.labels).float(), rank)
        auc, _ = auc_logloss(logits, labels)
        out = {"loss": float(total) / max(1, self.steps), "auc": auc}
        self.loss_sum, self.steps, self.logits, self.labels = 0.0, 0, [], []
        return out


_EXTRA = [
    "admitted",
    "rejected",
    "counter_evictions",
    "stored",
    "cache_hits",
    "storage_hits",
    "cache_misses",
    "write_backs",
    "overflows",
    "storage_evictions",
]
"""The admission and cache-tier counts of :class:`~demb_torchrec.stats.TableStats` a record
carries (zeros for a table without them)."""


def tables_record(model: torch.nn.Module, rank: Rank) -> dict[str, dict[str, Any]]:
    """Per table: size, capacity, load factor, and since the last call the keys inserted
    (``inserts``, into free or evicted slots), the keys evicted, the keys that found no slot,
    and with admission the missing keys admitted and rejected and the keys its counter
    evicted, and for a caching table the keys in its storage and what moved between its tiers
    (:class:`~demb_torchrec.stats.TableStats`), summed over ranks (collective)."""
    stats = {n: s for per in table_stats(model).values() for n, s in per.items()}
    names = sorted(stats)
    fields = ["size", "capacity", "inserts", "evictions", "failed"]
    fields += _EXTRA
    counts = torch.tensor(
        [
            [s.size, s.capacity, s.inserted + s.evicted, s.evicted, s.failed]
            + [getattr(s, f) for f in _EXTRA]
            for s in (stats[n] for n in names)
        ],
        dtype=torch.int64,
    )
    if rank.world_size > 1:
        dist.all_reduce(counts, group=rank.group)
    out: dict[str, dict[str, Any]] = {}
    for n, row in zip(names, counts.tolist(), strict=True):
        record: dict[str, Any] = dict(zip(fields, row, strict=True))
        record["load_factor"] = row[0] / row[1] if row[1] else 0.0
        out[n] = record
    return out
