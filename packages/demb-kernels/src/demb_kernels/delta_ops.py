"""CPU kernels of the online-delta paths: the scan of an incremental export and a replay's
writes of keys at given slots (``demb`` ops, CPU only).

Each does in one pass what demb_storage's tensor-op paths (which CUDA runs) do in a few dozen
small ops, with the same results; on the CPU each of those ops costs more than its work.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)
from demb_kernels._table_index import TableIndex

__all__ = ["SLOT_WRITE_FLAGS", "export_scan", "slot_writes_apply", "slot_writes_check"]

SLOT_WRITE_FLAGS = ("empty_key", "repeated_key", "outside", "repeated_slot", "not_home")
"""What each flag of :func:`slot_writes_check` says, in its order."""

_BELOW_ALL = -(2**63)


def export_scan(
    index: TableIndex,
    table_ids: Sequence[int],
    min_scores: Sequence[int | None],
    word: int,
    words: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The occupied slots of tables ``table_ids`` (in that order) whose score word ``word`` is
    at least the table's ``min_scores`` entry (None: every occupied slot).

    Args:
        index: a CPU index.
        table_ids: the tables (a table may come twice: scanned twice).
        min_scores: per table its threshold, or None.
        word: the index score word the thresholds apply to.
        words: the index score words returned per slot.

    Returns:
        ``(slots, keys, words, counts)``: ``(n,)`` int64 table-local slots in table order then
        slot order, ``(n,)`` int64 keys, ``(n, len(words))`` int64 score words, and per table
        of ``table_ids`` how many of the ``n`` it holds.
    """
    limits = [_BELOW_ALL if m is None else int(m) for m in min_scores]
    slots, keys, found_words, counts = torch.ops.demb.table_export_scan(
        index.keys, index.scores, index.slot_offsets, list(table_ids), limits, word, list(words)
    )
    return slots, keys, found_words, [int(c) for c in counts.tolist()]


def slot_writes_check(
    index: TableIndex, keys: torch.Tensor, table_ids: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, list[bool]]:
    """Check writing ``(N,)`` int64 ``keys`` of tables ``table_ids`` at their table-local
    ``slots`` of a CPU index; nothing is written.

    Returns:
        ``(N,)`` uint8 each key's digest, and the flags of :data:`SLOT_WRITE_FLAGS`: the empty
        key, a key twice in one table, a slot outside its table, a slot twice in one table, a
        slot outside its key's home bucket.
    """
    digests, flags = torch.ops.demb.slot_writes_check(
        index.slot_offsets, index.bucket_widths, keys, table_ids, slots
    )
    return digests, [bool(f) for f in flags.tolist()]


def slot_writes_apply(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    slots: torch.Tensor,
    digests: torch.Tensor,
    words: torch.Tensor,
) -> torch.Tensor:
    """Write checked keys (:func:`slot_writes_check` passed) at their slots of a CPU index
    (mutated): a key found at another slot of its table leaves it first; each written slot
    gets the key, its ``digests`` entry and its column of ``words`` (``(W, N)`` int64); table
    sizes follow. Value rows are not touched.

    Returns:
        ``(N,)`` bool: the slot held another key (or none) before.
    """
    taken_over: torch.Tensor = torch.ops.demb.slot_writes_apply(
        index.keys,
        index.digests,
        index.scores,
        index.slot_offsets,
        index.bucket_widths,
        index.sizes,
        keys,
        table_ids,
        slots,
        digests,
        words.contiguous(),
    )
    return taken_over


@torch.library.register_fake("demb::table_export_scan")  # type: ignore[untyped-decorator]
def _export_scan_fake(
    index_keys: torch.Tensor,
    scores: torch.Tensor,
    slot_offsets: torch.Tensor,
    table_ids: list[int],
    min_scores: list[int],
    word: int,
    words: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    n = torch.library.get_ctx().new_dynamic_size()
    return (
        index_keys.new_empty((n,)),
        index_keys.new_empty((n,)),
        index_keys.new_empty((n, len(words))),
        index_keys.new_empty((len(table_ids),)),
    )


@torch.library.register_fake("demb::slot_writes_check")  # type: ignore[untyped-decorator]
def _slot_writes_check_fake(
    slot_offsets: torch.Tensor,
    bucket_widths: torch.Tensor,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        keys.new_empty(keys.shape, dtype=torch.uint8),
        keys.new_empty((len(SLOT_WRITE_FLAGS),), dtype=torch.bool),
    )


@torch.library.register_fake("demb::slot_writes_apply")  # type: ignore[untyped-decorator]
def _slot_writes_apply_fake(*args: torch.Tensor) -> torch.Tensor:
    keys = args[6]
    return keys.new_empty(keys.shape, dtype=torch.bool)
