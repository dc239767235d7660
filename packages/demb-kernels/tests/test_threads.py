"""limit_this_thread: the calling thread's intra-op threads, other threads' left as they were."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
import torch
from demb_kernels.threads import limit_this_thread

OPENMP = "OpenMP" in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]


@pytest.mark.parametrize("threads", [0, -1, True, 1.0, "1"])
def test_rejects_counts_below_one_and_non_integers(threads):
    with pytest.raises(ValueError, match="limit_this_thread: threads="):
        limit_this_thread(threads)


@pytest.mark.skipif(not OPENMP, reason="per-thread counts need PyTorch's OpenMP backend")
def test_the_count_is_the_calling_threads_own():
    main = torch.get_num_threads()
    seen: dict[str, object] = {}

    def work() -> None:
        seen["applied"] = limit_this_thread(1)
        seen["inside"] = torch.get_num_threads()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == {"applied": True, "inside": 1}
    assert torch.get_num_threads() == main


# Counts the process's threads while a fresh thread runs a parallel CPU loop, with and without
# the limit: under OpenMP the loop starts a team of that thread's count (new threads of the
# process), and with the limit it runs on the thread alone.
_SCRIPT = """
import os, sys, threading, torch
from demb_kernels.threads import limit_this_thread
torch.set_num_threads(2)
limit = sys.argv[1] == "1"
x = torch.randn(1 << 22)
out = {}
def work():
    before = len(os.listdir("/proc/self/task"))
    if limit:
        limit_this_thread(1)
    for _ in range(3):
        x.exp()  # a parallel loop (at::parallel_for) over 4M elements
    out["new"] = len(os.listdir("/proc/self/task")) - before
t = threading.Thread(target=work)
t.start()
t.join()
print(out["new"])
"""


@pytest.mark.skipif(
    not OPENMP or not sys.platform.startswith("linux"), reason="OpenMP teams, /proc (Linux)"
)
def test_a_limited_threads_loops_start_no_threads():
    def new_threads(limit: bool) -> int:
        args = [sys.executable, "-c", _SCRIPT, "1" if limit else "0"]
        run = subprocess.run(args, capture_output=True, text=True, check=True)
        return int(run.stdout.strip().splitlines()[-1])

    assert new_threads(limit=False) == 1  # its own team: one more thread beside it
    assert new_threads(limit=True) == 0
