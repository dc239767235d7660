"""Where the GPU idles in a step of the reference workload (Adam, NONE): a profiler recording
GPU work only (CUPTI kernel, copy and memset times, no host ops), and a marker kernel
(``torch.cuda._sleep``) launched right before each phase. Per phase, medians over 12 steps
after 6: the wall time (host, synchronized before and after), the delay from the marker's end
to the phase's first GPU work (the host's calls before its first launch, and for a backward
autograd's hand-over to its device thread), the idle time between the phase's GPU work, and its
busy time; then the last step of each phase in order, with each idle gap over 1 us. The
profiler adds about a microsecond to each launch.

Usage: ``python gpu_idle.py [caller] [unchecked]`` (after ``source .device/setup.sh`` on the
H200); ``caller``: the backward on the calling thread
(``torch.autograd.set_multithreading_enabled``); ``unchecked``: the module built with
``check_gradients=False``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload
from torch.profiler import ProfilerActivity, profile

_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_PHASES = ("fwd", "bwd", "eval")
_WARMUP, _STEPS = 6, 12


def _run(caller: bool, checked: bool) -> tuple[dict[str, list[float]], str]:
    """Walls (us) of the profiled steps' phases, and the Chrome trace's path."""
    device = torch.device("cuda")
    w = Workload(optimizer="adam", pooling="none", check_gradients=checked)
    module, batches, grad = ready(w, device, 2)
    walls: dict[str, list[float]] = {p: [] for p in _PHASES}

    def phase(name: str, fn: Callable[[], object]) -> None:
        torch.cuda.synchronize()
        torch.cuda._sleep(100)  # the marker: a spin kernel of about 0.1 us
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        walls[name].append((time.perf_counter() - start) * 1e6)

    def step(i: int) -> None:
        module.train()
        box: list[torch.Tensor] = []
        phase("fwd", lambda: box.append(module(*batches[i % 2])))
        with torch.autograd.set_multithreading_enabled(not caller):
            phase("bwd", lambda: torch.autograd.backward([box[0]], [grad]))
        module.eval()
        with torch.no_grad():
            phase("eval", lambda: module(*batches[i % 2]))

    for i in range(_WARMUP):
        step(i)
    walls = {p: [] for p in _PHASES}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(_STEPS):
            step(i)
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    return walls, path


def main() -> None:
    caller = "caller" in sys.argv[1:]
    checked = "unchecked" not in sys.argv[1:]
    walls, path = _run(caller, checked)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = sorted((e for e in events if e.get("cat") in _GPU_CATS), key=lambda e: e["ts"])
    marks = [i for i, e in enumerate(gpu) if "spin" in e["name"].lower()]
    stats: dict[str, dict[str, list[float]]] = {
        p: {"delay": [], "idle": [], "busy": []} for p in _PHASES
    }
    last: dict[str, list[str]] = {}
    for j, m in enumerate(marks):
        name = _PHASES[j % 3]
        body = gpu[m + 1 : marks[j + 1] if j + 1 < len(marks) else len(gpu)]
        if not body:
            continue
        origin = gpu[m]["ts"] + gpu[m]["dur"]
        cursor, idle, busy, lines = body[0]["ts"], 0.0, 0.0, []
        for e in body:
            gap = e["ts"] - cursor
            idle += max(gap, 0.0)
            if gap > 1.0:
                lines.append(f"      idle {gap:7.1f}")
            lines.append(f"  {e['ts'] - origin:8.1f} +{e['dur']:7.1f}  {e['name'][:90]}")
            busy += e["dur"]
            cursor = max(cursor, e["ts"] + e["dur"])
        stats[name]["delay"].append(body[0]["ts"] - origin)
        stats[name]["idle"].append(idle)
        stats[name]["busy"].append(busy)
        last[name] = lines
    mode = "backward on the calling thread" if caller else "autograd's default threading"
    if not checked:
        mode += ", check_gradients=False"
    print(f"{mode}; medians of {_STEPS} steps after {_WARMUP}, us")
    for p in _PHASES:
        med = {k: statistics.median(v) for k, v in stats[p].items()}
        print(
            f"{p:5s} wall {statistics.median(walls[p]):7.1f}  first work after "
            f"{med['delay']:6.1f}  idle between {med['idle']:6.1f}  busy {med['busy']:6.1f}"
        )
    for p in _PHASES:
        print(f"== the last {p} (us from the marker's end)")
        print("\n".join(last.get(p, [])))


if __name__ == "__main__":
    main()
