"""The CUDA stream on which a module's caching tables read their storage rows (a prefetch's
and a forward's), beside the training stream, and what the training stream waits for before
it uses those rows or writes the storage (docs/tiers.md). On the CPU every read is done when
it returns and nothing here waits."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["SideReads"]


class SideReads:
    """Storage reads on a stream of their own (made at first use on a CUDA device).

    Two points the training stream waits for, on the device (never the host): the keys a
    prefetch found (:meth:`await_keys`, before anything looks at what it staged) and every row
    read so far (:meth:`await_rows`, before the rows are placed or the storage is written).
    The tensors a read uses (the storage's buffers, the positions it reads) are held until
    the training stream has waited for it: a storage that grows meanwhile frees nothing the
    read still needs."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None
        self._keys: torch.cuda.Event | None = None
        self._rows: torch.cuda.Event | None = None
        self._held: dict[int, torch.Tensor] = {}
        """Tensors of reads issued since the last :meth:`mark_rows`."""
        self._held_rows: dict[int, torch.Tensor] = {}
        """Tensors of reads the event :attr:`_rows` covers."""
        self._retired: dict[int, torch.Tensor] = {}
        """Tensors of reads waited for at the last :meth:`await_rows`."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def training_stream(self) -> torch.cuda.Stream | None:
        """The current stream (the one the caller trains on); None on the CPU."""
        return torch.cuda.current_stream(self.device) if self.cuda else None

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run the block's device work on the side stream, after the current stream's work so
        far (nothing on the CPU)."""
        if not self.cuda:
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    def hold(self, tensors: Iterable[torch.Tensor]) -> None:
        """Keep ``tensors`` (read by side work just issued) until the training stream waits
        for that work."""
        if self.cuda:
            self._held.update((id(t), t) for t in tensors)

    def made_for(self, tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream | None) -> None:
        """``tensors`` made on the side stream are used on ``stream``: their memory is not
        reused before ``stream``'s work so far is done."""
        if stream is not None:
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(stream)

    def mark_keys(self) -> None:
        """Inside :meth:`side`: the keys and score words of a prefetch are written."""
        if self._stream is not None:
            self._keys = self._stream.record_event()

    def mark_rows(self) -> None:
        """Inside :meth:`side`: every read issued so far is done once the side stream gets
        here."""
        if self._stream is not None:
            self._rows = self._stream.record_event()
            self._held_rows.update(self._held)
            self._held = {}

    def await_keys(self) -> None:
        """The current stream waits for the last prefetch's keys."""
        event, self._keys = self._keys, None
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def await_rows(self) -> None:
        """The current stream waits for the reads :meth:`mark_rows` covered; their tensors are
        released."""
        event, self._rows = self._rows, None
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
        # Held one wait longer: host memory is not stream-ordered, and a later wait comes
        # after the host has waited on the device past this one.
        self._retired, self._held_rows = self._held_rows, {}
