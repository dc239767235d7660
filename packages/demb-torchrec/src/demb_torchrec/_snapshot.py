"""A point-in-time copy of some tables of a :class:`~demb_storage.ScoredHashTable`, exported
later while the live table goes on changing: what a non-blocking dump writes from.

The copy is a clone of the index tensors (keys, digests, score words, sizes) and of the value
rows of the chosen tables, made on the tensors' own devices: on CUDA the clones are queued on
the current stream (device-to-device, no host transfer, no sync), so they hold the state as of
every kernel queued before them. A hybrid table's value rows (most of them in host memory) are
copied into host memory instead, in the stream's order, the host waiting for the copy. A
reader on another stream must wait on that stream first (:meth:`torch.cuda.Stream.wait_stream`)
and keep the snapshot alive until its reads are done (:meth:`TableSnapshot.record_stream`).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from demb_kernels.memory import advise_huge_pages
from demb_kernels.table import TableIndex
from demb_storage import ScoredHashTable, TableExport, export_table
from demb_storage.options import TableConfig

__all__ = ["TableSnapshot", "background_reads", "release_snapshot_memory", "snapshots"]


class TableSnapshot:
    """The index of ``tables`` and the value rows of its tables ``table_ids``, copied now.

    Args:
        tables: the live table (left unchanged).
        table_ids: the tables whose rows are copied (the index is copied whole: it is shared).
        state: also copy each row's optimizer state (else only its ``dim`` embedding columns).

    Host value rows of a CUDA index are copied on the host, after the current stream has
    finished (their writes may still be queued on it): the one case with a host sync.
    """

    def __init__(
        self, tables: ScoredHashTable, table_ids: Iterable[int], *, state: bool = True
    ) -> None:
        index = tables.index
        self.configs: tuple[TableConfig, ...] = tables.configs
        """The live table's configs (immutable)."""
        self.device = index.keys.device
        """Where the index lives (with its index on CUDA)."""
        with torch.no_grad():
            self.index: TableIndex = dataclasses.replace(
                index,
                keys=_copy(index.keys),
                digests=_copy(index.digests),
                scores=_copy(index.scores),
                sizes=_copy(index.sizes),
            )
            """The index as it was (a copy; its other tensors are never written)."""
            self.values: dict[int, torch.Tensor] = {}
            """Per copied table, its ``(capacity, width)`` rows as they were (``width``: the
            embedding dim, plus the optimizer state with ``state``)."""
            synced = False
            for t in sorted(set(table_ids)):
                buf = tables.values[t]
                if buf.device.type == "cpu" and self.device.type == "cuda" and not synced:
                    torch.cuda.current_stream(self.device).synchronize()
                    synced = True
                width = buf.shape[1] if state else self.configs[t].dim
                # a hybrid table's rows are copied into host memory, where most of them live:
                # a copy in device memory may not fit
                hybrid = buf.is_cuda and self.configs[t].device_rows is not None
                self.values[t] = _copy(buf[:, :width], to_host=hybrid)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the snapshot owns (what a reader on another stream must keep alive)."""
        i = self.index
        return [i.keys, i.digests, i.scores, i.sizes, *self.values.values()]

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark every CUDA tensor of the snapshot as used on ``stream``: the caching allocator
        reuses none of their memory before the work queued on ``stream`` so far is done."""
        for t in self.tensors():
            if t.is_cuda:
                t.record_stream(stream)

    def capacity(self, table_id: int) -> int:
        """Slots (= value rows) of table ``table_id`` at the snapshot."""
        return self.index.capacities[table_id]

    def export(
        self,
        table_id: int,
        begin: int = 0,
        end: int | None = None,
        min_score: int | None = None,
        *,
        split: int | None = None,
    ) -> TableExport:
        """What :meth:`ScoredHashTable.export` returned at the snapshot: keys, scores (the
        table's ``score_strategy`` column order), slots and rows (``(n, width)``, see
        :attr:`values`) of table ``table_id`` in the slot range ``[begin, end)``; ``min_score``
        filters on the first score column (a compound strategy's timestamp); ``split``: the
        rows as two contiguous column ranges (see :func:`~demb_storage.export_table`).

        Raises:
            KeyError: ``table_id``'s rows were not copied.
        """
        values = self.values[table_id]
        layout = self.configs[table_id].score_layout
        # the slots come from the copied index, whose capacity is the copied rows': in range
        return export_table(
            self.index, layout, values, table_id, begin, end, min_score, check=False, split=split
        )


class _HostPool:
    """Host buffers of finished snapshots, kept for the next snapshot of the same shapes (a
    fresh copy of a big table spends as long faulting in and zeroing its pages as copying; a
    process that dumps every few minutes copies into the same memory each time, as the CUDA
    caching allocator reuses device memory). :func:`release_snapshot_memory` frees them."""

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        with self._lock:
            found = self._free.get((shape, dtype))
            return found.pop() if found else None

    def keep(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep the host tensors of a finished dump, and only those (buffers of an earlier
        dump not taken, of tables that have grown since, are let go)."""
        free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        for t in tensors:
            if t.device.type == "cpu" and not t.is_pinned():
                free.setdefault((tuple(t.shape), t.dtype), []).append(t)
        with self._lock:
            self._free = free

    def clear(self) -> int:
        with self._lock:
            freed = sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)
            self._free.clear()
            return freed


_POOL = _HostPool()


def release_snapshot_memory() -> int:
    """Free the host memory kept from finished non-blocking dumps for the next one (CPU
    tables and hybrid tables' rows; device memory stays with PyTorch's caching allocator, see
    ``torch.cuda.empty_cache``).

    Returns:
        The bytes freed.
    """
    return _POOL.clear()


def _copy(t: torch.Tensor, *, to_host: bool = False) -> torch.Tensor:
    """A contiguous copy of ``t``, on its device or, ``to_host``, in host memory (a CUDA
    tensor's copy is queued on the current stream and waited for). In host memory into a
    buffer kept from a finished snapshot of the same shape, else into memory asked to be
    backed by huge pages before its first write (:func:`demb_kernels.memory.advise_huge_pages`):
    a fresh copy of a big table otherwise spends more time faulting in 4 KiB pages than
    copying."""
    cpu = to_host or (t.device.type == "cpu" and not t.is_pinned())
    out = _POOL.take(tuple(t.shape), t.dtype) if cpu else None
    if out is None:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu" if cpu else t.device)
        if cpu:
            advise_huge_pages(out)
    return out.copy_(t)


def snapshots(
    tables: Sequence[tuple[ScoredHashTable, int]], *, state: bool
) -> dict[int, TableSnapshot]:
    """One :class:`TableSnapshot` per distinct live table of ``tables`` (``(table,
    table_id)`` pairs; several may share one table), by the live table's ``id``."""
    wanted: dict[int, tuple[ScoredHashTable, set[int]]] = {}
    for live, table_id in tables:
        wanted.setdefault(id(live), (live, set()))[1].add(table_id)
    return {key: TableSnapshot(live, ids, state=state) for key, (live, ids) in wanted.items()}


def background_reads(
    snaps: Mapping[int, TableSnapshot],
    jobs: Sequence[tuple[int, Callable[[TableSnapshot], None]]],
) -> Callable[[], None]:
    """The work of a thread that runs each job of ``jobs`` (``(key of snaps, job)``) on its
    snapshot, in order.

    Called right after the snapshots were taken, in the thread that took them: on CUDA it
    makes a side stream per device that waits (from now) on the device's current stream,
    where the copies were queued, and marks the snapshots' tensors as used on it. The work
    sets the CUDA device in its thread, runs each job on its snapshot's side stream, then
    synchronizes the side streams and lets the snapshots go (even when a job raised).
    """
    devices = sorted(
        {s.device for s in snaps.values() if s.device.type == "cuda"}, key=lambda d: d.index or 0
    )
    sides: dict[torch.device, torch.cuda.Stream] = {}
    for device in devices:  # behind the copies queued so far, and nothing later
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        for s in snaps.values():
            if s.device == device:
                s.record_stream(side)
        sides[device] = side
    held = dict(snaps)

    def work() -> None:
        if devices:
            torch.cuda.set_device(devices[0])
        try:
            for key, job in jobs:
                snap = held[key]
                side = sides.get(snap.device)
                on: AbstractContextManager[object] = nullcontext()
                if side is not None:
                    on = torch.cuda.stream(side)
                with on:
                    job(snap)
        finally:
            for side in sides.values():  # every read done before the copies are freed
                side.synchronize()
            _POOL.keep(t for snap in held.values() for t in snap.tensors())  # for the next
            held.clear()

    return work
