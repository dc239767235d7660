"""The eval forward right after a training step (as ``demb bench module``'s eval figure times
it) against a second eval forward right after that one, on the reference workload (Adam, NONE):
wall time, the host's time to return, and the GPU span (an event before the call to one after
it). Also with a 2 ms sleep between the training step and the eval, and with no training.

Usage: ``python eval_after_train.py`` (after ``source .device/setup.sh`` on the H200).
"""

from __future__ import annotations

import statistics
import time

import torch
from demb_torchrec.bench.module_bench import ready
from demb_torchrec.bench.workload import Workload, timed

Batch = tuple[torch.Tensor, torch.Tensor]


def main() -> None:
    device = torch.device("cuda")
    module, batches, grad = ready(Workload(), device)

    def one_eval(batch: Batch) -> tuple[float, float, float]:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        module(*batch)
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, t1 - t0, start.elapsed_time(end) / 1e3

    def loop(label: str, pause: float = 0.0, train: bool = True) -> None:
        rows: dict[str, list[tuple[float, float, float]]] = {"first": [], "second": []}
        for i in range(25):
            batch = batches[i % len(batches)]
            if train:
                module.train()
                box: list[torch.Tensor] = []
                timed(lambda: box.append(module(*batch)), device)  # noqa: B023
                timed(lambda: torch.autograd.backward([box[0]], [grad]), device)  # noqa: B023
            if pause:
                time.sleep(pause)
            module.eval()
            with torch.no_grad():
                first, second = one_eval(batch), one_eval(batch)
            if i >= 5:
                rows["first"].append(first)
                rows["second"].append(second)
        for name, got in rows.items():
            wall, host, span = (statistics.median(x[j] for x in got) * 1e6 for j in range(3))
            print(
                f"{label:26s} {name:6s} wall {wall:6.1f} us  host {host:6.1f} us  "
                f"gpu span {span:6.1f} us"
            )

    loop("after train")
    loop("after train + 2 ms sleep", pause=0.002)
    loop("no train", train=False)


if __name__ == "__main__":
    main()
