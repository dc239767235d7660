"""Per-table counts of what inserts did (keys inserted, keys evicted, keys that found no slot):
what a training job plots. Counted on the index device, only while enabled: a table that never
enables them pays one attribute check per insert batch."""

from __future__ import annotations

import torch
from demb_kernels.table import InsertStatus

__all__ = ["OutcomeCounts"]

_KINDS = len(InsertStatus)


class OutcomeCounts:
    """Per table and :class:`~demb_kernels.table.InsertStatus`, the keys of insert batches with
    that outcome since the last :meth:`read` (while :attr:`enabled`)."""

    def __init__(self, num_tables: int, device: torch.device) -> None:
        self.num_tables = num_tables
        self.device = device
        self._counts: torch.Tensor | None = None
        """``(T, statuses)`` int64 on ``device`` while enabled, else None."""

    @property
    def enabled(self) -> bool:
        return self._counts is not None

    def enable(self, on: bool = True) -> None:
        """Start counting from zero (``on``), or stop and drop the counts."""
        self._counts = (
            torch.zeros((self.num_tables, _KINDS), dtype=torch.int64, device=self.device)
            if on
            else None
        )

    def add(self, table_ids: torch.Tensor, status: torch.Tensor) -> None:
        """Count an insert batch's final outcomes: ``(N,)`` int64 ``table_ids`` and their
        ``(N,)`` status (no sync; nothing while disabled)."""
        counts = self._counts
        if counts is None or status.numel() == 0:
            return
        flat = table_ids * _KINDS + status.to(torch.int64)
        ones = torch.ones(1, dtype=torch.int64, device=counts.device).expand(flat.numel())
        counts.view(-1).index_add_(0, flat, ones)

    def read(self, reset: bool = True) -> list[dict[str, int]]:
        """Per table ``{"inserted", "evicted", "failed"}`` since the last read: keys that took
        a free slot, keys that took an evicted key's slot (each evicted one key), keys that
        found no slot (one host sync; all zeros while disabled).

        Args:
            reset: start counting again from zero.
        """
        if self._counts is None:
            return [{"inserted": 0, "evicted": 0, "failed": 0} for _ in range(self.num_tables)]
        rows: list[list[int]] = self._counts.tolist()
        if reset:
            self._counts.zero_()
        return [
            {
                "inserted": r[InsertStatus.INSERTED],
                "evicted": r[InsertStatus.EVICTED],
                "failed": r[InsertStatus.FAILED],
            }
            for r in rows
        ]
