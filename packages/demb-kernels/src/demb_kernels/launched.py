"""A batch deduplicated with no sync (CUDA): :func:`dedup_launch` leaves the unique count and the
batch's checks on the device, where :func:`find_or_insert_gated` reads them;
that op's one read-back brings them to the host, and :func:`launch_info` reads them there.

A training forward then waits once, after the lookup, instead of once after the dedup and once
after the lookup; the dedup's read-back and the host work between the two calls no longer leave
the GPU idle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)
from demb_kernels.lookup import _BATCH_CHECK_WORDS
from demb_kernels.table import EMPTY_KEY, InsertResult, RowGather, TableIndex, as_batch

__all__ = [
    "LaunchInfo",
    "LaunchedDedup",
    "dedup_launch",
    "find_or_insert_gated",
    "gate_words",
    "launch_info",
    "live_unique",
    "packed_radix",
]

_EXTRA_WORDS = 6
"""What dedup_launch's info holds after dedup_batch's words: varying bits, the largest low
bits, the scatter's finished blocks, U, go, missed."""


class LaunchedDedup(NamedTuple):
    """:func:`dedup_launch`'s outputs: those of :func:`demb_kernels.lookup.dedup_batch` at full
    size ``N`` (only the first ``U`` rows of the per-key ones are meaningful), and ``info``."""

    keys: torch.Tensor
    """``(N,)`` int64: the unique keys, sorted by table then key, in rows ``[0, U)``."""
    tables: torch.Tensor
    """``(N,)`` int64 table of each unique key (rows ``[0, U)``)."""
    inverse: torch.Tensor
    """``(N,)`` int64 position in ``keys`` of each index."""
    counts: torch.Tensor
    """``(N,)`` int64 occurrences (or summed counters) of each unique key (rows ``[0, U)``);
    ``(0,)`` when :func:`dedup_launch` was told ``counts=False``."""
    order: torch.Tensor
    """``(N,)`` int64 index positions sorted by (table, key), stable."""
    starts: torch.Tensor
    """``(N,)`` int64 where each unique key's occurrences start in ``order`` (rows ``[0, U)``)."""
    info: torch.Tensor
    """``(T + 6 + F + 1 + 6,)`` int64 on the device: the words :func:`launch_info` reads."""
    nonfinite: torch.Tensor
    """``()`` bool on the device, zeroed, written by no kernel of the dedup or the gated find:
    a backward's NaN/inf flag (``demb::summed_update``'s ``nonfinite``), with no allocation or
    memset of its own."""
    clock: torch.Tensor
    """``(C,)`` int64 on the device: ``C`` (``clock_words``) copies of the GPU's global timer
    (ns), read once by the dedup's first kernel: the batch's timed scores, as
    :func:`demb_kernels.table.timestamp` makes them, with no launch of their own."""


class LaunchInfo(NamedTuple):
    """What :func:`launch_info` reads from a launched dedup's info words."""

    bounds: list[int]
    """``T + 1`` table bounds of the unique keys, then ``offsets[::B]`` (``F + 1``)."""
    unique: int
    """``U``."""
    ready: bool
    """The go flag: the dedup's sort looked at enough key bits (and with a ``key_radix``, every
    key's low bits were below it), so its first ``U`` rows are right (and the gated find ran).
    False: sort again on all 64 bits (nothing ran)."""
    missed: bool
    """Some key was not found by the gated find's first pass (it then inserted them)."""
    key_bits: int
    """The low bits the keys differ in."""
    low_max: int
    """The largest of the keys' low ``key_bits`` bits (as :func:`dedup_launch` took them),
    unsigned, sign bit flipped (a key ``k >= 0`` below ``2**key_bits`` is ``k`` itself)."""


def dedup_launch(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    num_tables: int,
    batch_size: int,
    counters: torch.Tensor | None = None,
    key_bits: int = 64,
    key_radix: int = 0,
    counts: bool = True,
    clock_words: int = 0,
) -> LaunchedDedup:
    """:func:`demb_kernels.lookup.dedup_batch` with no sync (CUDA only): the same kernels, the
    sort by key on the low ``key_bits`` bits only, outputs at full size, and on the device the
    unique count ``U`` and a go flag, set when every batch check passed and no key differs
    from the first above ``key_bits``. Read back and checked by :func:`launch_info`. The sort
    keeps its scratch and replays from a graph as :func:`demb_kernels.lookup.dedup_batch`'s.

    Args:
        key_radix: 0, or ``R > 0`` (``key_bits < 64``): sort ``(table, key)`` as one key
            ``table * R + low``, ``low`` the key's low ``key_bits`` bits (sign bit flipped),
            which takes ``ceil(log2(T * R) / 8)`` radix passes instead of
            ``ceil((key_bits + log2 T) / 8)``; the go flag then also needs every ``low < R``
            (:func:`packed_radix` picks one).
        counts: make :attr:`LaunchedDedup.counts` (False: a ``(0,)`` tensor, one launch fewer,
            for a caller whose tables count no occurrences).
        clock_words: ``C`` in ``[0, 1024]``: :attr:`LaunchedDedup.clock`'s size.
        others: as :func:`demb_kernels.lookup.dedup_batch`.
    """
    rows, made_counts, info = torch.ops.demb.dedup_launch(
        indices,
        offsets,
        feature_tables,
        num_tables,
        batch_size,
        counters,
        key_bits,
        key_radix,
        counts,
        clock_words,
    )
    inverse, order, keys, tables, starts = rows.unbind()  # one (5, N) buffer
    # info: the words, then a zeroed word (its first byte: the NaN/inf flag), then the clock.
    words, flag, clock = info.split([info.shape[0] - 1 - clock_words, 1, clock_words])
    nonfinite = flag.view(torch.bool)[0]
    return LaunchedDedup(keys, tables, inverse, made_counts, order, starts, words, nonfinite, clock)


def _words(host: torch.Tensor | list[int]) -> list[int]:
    """The info words as a list: ``host`` itself, or the tensor read once."""
    if isinstance(host, list):
        return host
    words: list[int] = host.tolist()
    return words


def launch_info(
    host: torch.Tensor | list[int], n: int, num_tables: int, features: int
) -> LaunchInfo:
    """Read a launched dedup's info words brought to the host (by :func:`find_or_insert_gated`).

    Args:
        host: ``(T + 6 + F + 1 + 6,)`` int64 on the CPU, or those words as a list (read once
            already: this runs on the forward's critical path).
        n: ``N``, the batch's indices; num_tables: ``T``; features: ``F``.

    Raises:
        ValueError: a failed batch check (as :func:`demb_kernels.lookup.dedup_batch` raises it).
    """
    words = _words(host)
    w = len(words) - _EXTRA_WORDS
    unique, go, missed = words[-3], words[-2] != 0, words[-1] != 0
    checks = words[num_tables : num_tables + _BATCH_CHECK_WORDS]
    if go and w == num_tables + _BATCH_CHECK_WORDS + features + 1 and not any(checks):
        # Every check passed (the go flag needs it too): the bounds as batch_bounds makes them
        # (table ends made non-decreasing, then offsets[::B]), without its call.
        bounds = [0]
        for end in words[:num_tables]:
            bounds.append(max(end, bounds[-1]))
        bounds += words[num_tables + _BATCH_CHECK_WORDS : w]
    else:  # raises the error a failed check earns
        checked = torch.tensor(words[:w], dtype=torch.int64)
        bounds = torch.ops.demb.batch_bounds(checked, n, num_tables, features).tolist()
    varying = words[w] & (2**64 - 1)  # the bits as unsigned
    low_max = words[w + 1] & (2**64 - 1)
    return LaunchInfo(bounds, unique, go, missed, varying.bit_length(), low_max)


def packed_radix(key_bits: int, low_max: int, num_tables: int) -> int:
    """A ``key_radix`` for :func:`dedup_launch`: the largest ``R`` with ``T * R`` one radix
    pass (8 bits) below the ``(table << key_bits) | low`` packing, when the last batch's
    largest low bits ``low_max`` were below it; else 0 (no radix). For ids below 1,677,721 in
    10 tables (``key_bits`` 24): ``R = 2**24 // 10``, 3 passes instead of 4.

    Args:
        key_bits: the next sort's low key bits; low_max: :attr:`LaunchInfo.low_max`;
        num_tables: ``T``.

    Raises:
        ValueError: ``key_bits`` outside ``[1, 64]`` or ``num_tables < 1``.
    """
    if not 1 <= key_bits <= 64 or num_tables < 1:
        raise ValueError(
            f"key_bits={key_bits}, num_tables={num_tables}: need key_bits in [1, 64] and "
            "num_tables >= 1"
        )
    table_bits = max((num_tables - 1).bit_length(), 1)
    packed = key_bits + table_bits
    if key_bits >= 64 or packed > 64 or packed <= 8:
        return 0
    radix = (1 << (8 * ((packed - 1) // 8))) // num_tables
    return radix if low_max < radix <= (1 << key_bits) else 0


def find_or_insert_gated(
    index: TableIndex,
    keys: torch.Tensor,
    table_ids: torch.Tensor,
    score_args: torch.Tensor,
    counts: torch.Tensor | None,
    info: torch.Tensor,
    *,
    gather: RowGather | None = None,
) -> tuple[InsertResult, torch.Tensor, torch.Tensor | None]:
    """:func:`demb_kernels.table.find_or_insert` of a batch from :func:`dedup_launch` (CUDA
    only), with the forward's one sync: the first pass runs over the first ``U`` rows, ``U``
    and the go flag read on the device from ``info`` (no row at all when the flag is clear:
    nothing changes); the gather of the occurrences' rows (``gather`` given) is queued behind
    it; then ``info`` is read back whole, and when a key missed, the insert pass
    runs on the first ``U`` rows.

    Args:
        index: the index (mutated).
        keys, table_ids, counts: dedup_launch's ``(N,)`` keys, tables and counts (LFU words).
        score_args: ``(T,)`` int64 batch score per table.
        info: dedup_launch's info words (its ``missed`` word is set here).
        gather: the occurrences' rows to read when every key is found
            (:class:`demb_kernels.table.RowGather`), or None.

    Returns:
        ``(InsertResult, host, rows)``: the result's tensors have ``N`` rows, of which the
        first ``U`` are meaningful (the victims only when a key missed: the insert pass writes
        them, and a batch that finds every key evicts none); ``host`` is ``info`` read back, for
        :func:`launch_info`; ``rows`` ``(N_occ, dim)`` float32 when asked for, the go flag
        was set and every key was found, else None.
    """
    keys, table_ids = as_batch(index, keys, table_ids)
    values, inverse, dim = ([], None, 0) if gather is None else gather
    *out, host, rows = torch.ops.demb.table_find_or_insert_gated(
        *index._tensors(), index.sizes, keys, table_ids, score_args, counts, info,
        values, inverse, dim, *index._ranks(),
    )  # fmt: skip
    return InsertResult(*out), host, rows if rows.shape[0] else None


def live_unique(launched: LaunchedDedup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device, without waiting: which rows of a launched dedup hold a unique key, and
    its keys and tables with every other row as the empty key of table 0 (rows at or past
    ``U``, which the dedup leaves unwritten, and every row when its go flag is clear), for work
    queued before the host learns ``U``.

    Returns:
        ``(N,)`` bool ``live``, ``(N,)`` int64 keys and ``(N,)`` int64 tables.
    """
    words = launched.info  # its last three words: U, the go flag, the gated find's miss flag
    rows = torch.arange(launched.keys.shape[0], device=launched.keys.device)
    live = (rows < words[-3]) & (words[-2] != 0)
    keys = torch.where(live, launched.keys, EMPTY_KEY)
    return live, keys, torch.where(live, launched.tables, 0)


def gate_words(host: torch.Tensor | list[int]) -> tuple[int, bool, bool]:
    """``(U, go, missed)`` from a launched dedup's info words brought to the host (the tensor,
    or its words as a list): the unique count, the go flag (the gated find ran) and whether its
    first pass missed a key."""
    unique, go, missed = _words(host)[-3:]  # a slice of the tensor first would cost a tensor
    return unique, go != 0, missed != 0


@torch.library.register_fake("demb::dedup_launch")  # type: ignore[untyped-decorator]
def _dedup_launch_fake(
    indices: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    num_tables: int,
    batch_size: int,
    counters: torch.Tensor | None,
    key_bits: int = 64,
    key_radix: int = 0,
    counts: bool = True,
    clock_words: int = 0,
) -> tuple[torch.Tensor, ...]:
    n = indices.shape[0]
    words = num_tables + _BATCH_CHECK_WORDS + feature_tables.shape[0] + 1 + _EXTRA_WORDS
    rows = indices.new_empty((5, n))
    made_counts = indices.new_empty((n,) if counts else (0,))
    return rows, made_counts, indices.new_empty((words + 1 + clock_words,))


@torch.library.register_fake("demb::table_find_or_insert_gated")  # type: ignore[untyped-decorator]
def _find_or_insert_gated_fake(*args: object) -> tuple[torch.Tensor, ...]:
    scores, keys, info, inverse, dim = args[2], args[7], args[11], args[13], args[14]
    assert isinstance(scores, torch.Tensor)
    assert isinstance(keys, torch.Tensor)
    assert isinstance(info, torch.Tensor)
    assert isinstance(dim, int)
    n = keys.shape[0]
    # (N_occ, dim) when inverse was given, the go flag set and every key found, else (0, dim):
    # a size known only from the data.
    occurrences = torch.library.get_ctx().new_dynamic_size() if inverse is not None else 0
    return (
        keys.new_empty((n,)),
        keys.new_empty((n,)),
        keys.new_empty((n,)),
        keys.new_empty((scores.shape[0], n)),
        torch.empty((info.shape[0],), dtype=torch.int64),  # on the host
        keys.new_empty((occurrences, dim), dtype=torch.float32),
    )
