"""A write that runs in a background thread and is finished by the caller: the handle of a
non-blocking :func:`~demb_torchrec.DynamicEmbDump` (and of other writers that work the same way).

The thread runs at a lower CPU priority than the threads that start it (Linux), and the CPU
kernels its torch ops run keep to that thread (one intra-op thread: under PyTorch's OpenMP
backend a thread's parallel loops otherwise start a team of their own, as many threads again
as training's, on the same cores). The work is
split in two: ``work`` runs in a thread of its own (writing files from a snapshot,
say) and must not take part in collectives; ``finish`` runs in the caller's thread when it calls
:meth:`DumpHandle.wait`, with the exception ``work`` raised (or None), and does what must happen
in every rank's main thread (gathering errors, committing, barriers). A handle that is never
waited on never runs ``finish``: nothing is committed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
import warnings
from collections.abc import Callable

from demb_kernels.threads import limit_this_thread

__all__ = ["DumpHandle"]

_NICE = 10
"""The background thread's nice value (Linux; 0 is the default, 19 the lowest priority)."""


class DumpHandle:
    """A background write in progress: ``work`` is started in a new non-daemon thread at once.

    Args:
        work: ``() -> None``, run in the thread; whatever it raises is kept for ``finish``
            (the thread itself never raises).
        finish: ``(error: BaseException | None) -> None``, run by the first :meth:`wait` in
            the caller's thread once ``work`` ended, with what ``work`` raised or None. What
            ``finish`` raises, :meth:`wait` raises (and raises again on later calls).
        name: the thread's name.

    :meth:`wait` is as collective as ``finish`` is: a ``finish`` that gathers over a process
    group needs every rank of it to call :meth:`wait`.
    """

    def __init__(
        self,
        work: Callable[[], None],
        finish: Callable[[BaseException | None], None],
        *,
        name: str = "demb-background-write",
    ) -> None:
        self._work = work
        self._finish: Callable[[BaseException | None], None] | None = finish
        self._error: BaseException | None = None
        """What ``work`` raised (set by the thread before it ends)."""
        self._raised: BaseException | None = None
        """What ``finish`` raised: :meth:`wait` raises it again."""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=False)
        self._thread.start()

    def _run(self) -> None:
        _lower_priority()
        limit_this_thread(1)
        try:
            self._work()
        except BaseException as err:  # handed to finish, in the caller's thread
            # the traceback keeps its lines, not its frames' locals (what the work held)
            traceback.clear_frames(err.__traceback__)
            self._error = err
        finally:
            self._work = _nothing  # drop what the work holds (a snapshot) as soon as it ends

    def done(self) -> bool:
        """Whether the thread's work has ended (this rank's part; not whether :meth:`wait` ran
        or other ranks are done)."""
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Wait for the thread's work, then run ``finish`` (once; a later call returns at once,
        or raises what the first raised).

        Raises:
            BaseException: what ``finish`` raised.
        """
        with self._lock:
            self._thread.join()
            finish, self._finish = self._finish, None
            if finish is not None:
                error, self._error = self._error, None
                try:
                    finish(error)
                except BaseException as err:
                    self._raised = err
            if self._raised is not None:
                raise self._raised

    def __del__(self) -> None:
        if getattr(self, "_finish", None) is not None:
            warnings.warn(
                "a background write was never waited on (DumpHandle.wait()): nothing was committed",
                ResourceWarning,
                stacklevel=2,
            )


def _lower_priority() -> None:
    """Give the calling thread a lower CPU priority than the training thread (Linux: a
    thread's own nice value; elsewhere nothing): the write yields the CPU to training steps."""
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not allowed
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _NICE)


def _nothing() -> None:
    """The work of a handle whose work has ended."""
