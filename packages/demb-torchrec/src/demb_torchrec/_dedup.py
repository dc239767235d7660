"""A batch's keys deduplicated per table: what the table module looks up once per step."""

from __future__ import annotations

from typing import NamedTuple

import torch
from demb_kernels.lookup import dedup_batch

from demb_torchrec._state import Bags, ForwardState
from demb_torchrec.errors import InputError

__all__ = ["DedupedBatch", "dedup", "dedup_bags", "next_key_bits"]


class DedupedBatch(NamedTuple):
    """The unique (table, key) pairs of a batch, grouped by table."""

    keys: torch.Tensor
    """``(U,)`` int64 unique keys, sorted by table, then key."""
    tables: torch.Tensor
    """``(U,)`` int64 table of each unique key."""
    inverse: torch.Tensor
    """``(N,)`` int64 position in ``keys`` of each index."""
    counts: torch.Tensor | None
    """``(U,)`` int64 occurrences of each unique key (or its summed frequency counters); None
    for a batch deduplicated on the device for tables that count no occurrences (the training
    forward's one-sync path: :func:`demb_torchrec._launched.launched_find_or_insert`), which
    made none (see :meth:`occurrence_counts`)."""
    table_bounds: list[int]
    """``T + 1`` host offsets: table ``t``'s unique keys are ``keys[b[t]:b[t+1]]``."""
    feature_bounds: list[int]
    """``F + 1`` host offsets: feature ``f``'s indices are ``indices[b[f]:b[f+1]]``."""
    order: torch.Tensor
    """``(N,)`` int64 the indices' positions sorted by (table, key): unique key ``u``'s
    occurrences are ``order[starts[u]:starts[u+1]]``."""
    starts: torch.Tensor
    """``(U,)`` int64 where each unique key's occurrences start in ``order``."""
    key_bits: int
    """A ``key_bits`` guess for the next batch: the low bits this batch's keys differ in,
    rounded up to whole radix passes of 8 bits."""
    nonfinite: torch.Tensor | None = None
    """A zeroed ``()`` bool on the device for the backward's NaN/inf flag
    (:attr:`demb_kernels.launched.LaunchedDedup.nonfinite`: the one-sync path's), or None (the
    backward's op makes one)."""

    def table_sizes(self) -> list[int]:
        """Per table, its unique keys (``U_t``)."""
        b = self.table_bounds
        return [b[t + 1] - b[t] for t in range(len(b) - 1)]

    def per_table(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Per table, the view of ``rows`` (one per unique key, in :attr:`keys`' order) that
        holds that table's keys."""
        return list(rows.split_with_sizes(self.table_sizes()))

    def occurrence_counts(self) -> torch.Tensor:
        """:attr:`counts`, which :func:`dedup` always makes.

        Raises:
            ValueError: the batch has none (deduplicated without counts).
        """
        if self.counts is None:
            raise InputError(
                "counts",
                "this batch was deduplicated without counts (its tables count no occurrences); "
                "deduplicate it with dedup() to have them",
            )
        return self.counts

    def count_per_table(self, mask: torch.Tensor) -> list[int]:
        """How many of each table's unique keys the ``(U,)`` bool ``mask`` holds (one sync; no
        atomics: the keys are grouped by table)."""
        ends = torch.tensor(self.table_bounds, device=mask.device)
        through = torch.cat([mask.new_zeros(1, dtype=torch.int64), torch.cumsum(mask, 0)])
        host: list[int] = through[ends].tolist()
        return [host[t + 1] - host[t] for t in range(len(host) - 1)]


def dedup(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    num_tables: int,
    batch_size: int,
    frequency_counters: torch.Tensor | None = None,
    key_bits: int = 64,
) -> DedupedBatch:
    """Deduplicate a TBE-layout batch per table, with one host sync (``demb::dedup_batch``).

    Args:
        indices: ``(N,)`` int64 keys, feature-major (feature ``f``'s bags come before
            ``f + 1``'s).
        offsets: ``(F * B + 1,)`` int64 bag offsets into ``indices``.
        feature_tables: ``(F,)`` int64 table of each feature.
        num_tables: ``T``.
        batch_size: ``B`` (>= 1).
        frequency_counters: ``(N,)`` int64 per-index counts summed into ``counts`` (default 1).
        key_bits: the previous batch's :attr:`DedupedBatch.key_bits` (64 for the first): how
            many low bits the CUDA sort looks at first (see :func:`dedup_batch`).
    """
    keys, tables, inverse, counts, order, starts, bounds, bits = dedup_batch(
        indices,
        offsets,
        feature_tables,
        num_tables,
        batch_size,
        None if frequency_counters is None else frequency_counters.to(torch.int64),
        key_bits,
    )
    host = bounds.tolist()
    return DedupedBatch(
        keys,
        tables,
        inverse,
        counts,
        host[: num_tables + 1],
        host[num_tables + 1 :],
        order,
        starts,
        next_key_bits(int(bits)),
    )


def dedup_bags(s: ForwardState, bags: Bags) -> DedupedBatch:
    """:func:`dedup` of a forward's checked batch, with the module's ``key_bits`` guess, which
    it then updates for the next batch (whose keys likely span as many bits)."""
    batch = dedup(
        bags.indices,
        bags.offsets,
        s.feature_tables,
        s.num_tables,
        bags.batch_size,
        bags.counters,
        s.key_bits[0],
    )
    s.key_bits[0] = batch.key_bits
    return batch


def next_key_bits(bits: int) -> int:
    """The ``key_bits`` guess for the next batch from the bits this one's keys differ in:
    rounded up to whole radix passes of 8 bits, at least 8."""
    return min(64, max(8, -(-bits // 8) * 8))
