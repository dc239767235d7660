"""How many entries a prefetch that does not wait on the device stages (CUDA): the cache
misses of a batch are known on the device only, so they are gathered into a buffer whose size
the host picks from the misses of an earlier prefetch, read back without waiting."""

from __future__ import annotations

import torch
from demb_kernels.table import EMPTY_KEY

__all__ = ["MIN_BOUND", "PrefetchBound"]

MIN_BOUND = 1024
"""The fewest entries a bounded prefetch stages."""


class PrefetchBound:
    """The bound of a module's prefetches: twice the misses the last prefetch counted, at least
    :data:`MIN_BOUND`; unknown (None) until a prefetch that waited counted them.

    Args:
        enabled: prefetches may stage without waiting (CUDA, every storage a
            :class:`~demb_storage.DynamicEmbeddingTable`, whose search reads on the device).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bound: int | None = None
        self._count: torch.Tensor | None = None
        """``(1,)`` int64 pinned: the misses of a bounded prefetch, copied without waiting."""
        self._copied: torch.cuda.Event | None = None
        """Recorded after that copy; None when no copy is pending."""

    def ready(self) -> bool:
        """Whether the next prefetch may stage without waiting (a bound is known); the bound
        follows the last bounded prefetch's count when its copy is done (never waited for)."""
        if not self.enabled or self.bound is None:
            return False
        if self._copied is not None and self._copied.query():  # type: ignore[no-untyped-call]
            assert self._count is not None
            self.learn(int(self._count[0]))
            self._copied = None
        return True

    def learn(self, misses: int) -> None:
        """Set the bound from a prefetch's ``misses``."""
        self.bound = max(MIN_BOUND, 2 * misses)

    def gather(
        self, absent: torch.Tensor, keys: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The entries ``absent`` selects, in order, the first ``min(bound, N)`` of them (the
        rest left out), padded with the empty key (table 0); on CUDA nothing waits on the
        device (on the CPU, which the tests use, the count sets the next bound at once).

        Args:
            absent: ``(N,)`` bool; keys, ids: ``(N,)`` int64 keys and their tables.

        Returns:
            ``(B,)`` int64 keys and ``(B,)`` int64 tables, ``B = min(bound, N)``.
        """
        assert self.bound is not None
        n = int(absent.shape[0])
        bound = min(self.bound, n)
        at = torch.cumsum(absent, 0) - 1
        keep = absent & (at < bound)
        at = torch.where(keep, at, bound)  # the rest go to a spare entry, dropped below
        out_keys = torch.full((bound + 1,), EMPTY_KEY, dtype=torch.int64, device=keys.device)
        out_keys.index_put_((at,), torch.where(keep, keys, EMPTY_KEY))
        out_ids = torch.zeros(bound + 1, dtype=torch.int64, device=ids.device)
        out_ids.index_put_((at,), torch.where(keep, ids, 0))
        if absent.device.type != "cuda":  # nothing to wait for: the count is here
            self.learn(int(absent.sum()))
        elif self._copied is None:  # the count for a later bound, read back without waiting
            if self._count is None:
                self._count = torch.zeros(1, dtype=torch.int64, pin_memory=True)
            self._count.copy_(absent.sum().view(1), non_blocking=True)
            self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record()
        return out_keys[:bound], out_ids[:bound]
