"""The intra-op threads of the calling thread (CPU kernels' parallel loops started from it).

``torch.set_num_threads`` sets one count for the whole process. Under PyTorch's OpenMP backend
the count is also each thread's own: a parallel loop runs on a team of the starting thread's
count, and every thread that starts loops gets a team of its own. A background thread (a
non-blocking dump's writer) running torch ops beside a training loop would so run as many
threads again as training does, on the same cores. :func:`limit_this_thread` gives the calling
thread its own, lower count and leaves every other thread's.
"""

from __future__ import annotations

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)

__all__ = ["limit_this_thread"]


def limit_this_thread(threads: int) -> bool:
    """Run the CPU kernels' parallel loops started from the calling thread on at most
    ``threads`` threads from now on; other threads keep their count.

    Args:
        threads: at least 1 (1: every loop runs on the calling thread alone).

    Returns:
        Whether the count took effect: False where PyTorch's parallel backend is not OpenMP
        (the process-wide count then stays in force for this thread too).

    Raises:
        ValueError: ``threads`` below 1.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"limit_this_thread: threads={threads!r} must be an integer >= 1")
    torch.ops.demb.set_thread_intra_op_threads.default(threads)
    return torch.get_num_threads() == threads
