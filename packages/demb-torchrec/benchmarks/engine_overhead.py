"""What torch's autograd engine alone costs a table-module backward on this machine: the
reference workload's output shape ((1,048,570, 128) float32 on the GPU) leaves the forward
through an identity Function like the module's TrainedRows, and ``torch.autograd.backward`` is
timed (to a synchronize) with a backward that does nothing, and with one that launches one
small kernel and reads one flag back (the module's NaN/inf check). Medians of 50 after 10.

Usage: ``python engine_overhead.py`` (after ``source .device/setup.sh`` on the H200).
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.autograd.function import FunctionCtx


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, trigger: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return rows.view_as(rows)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[None, None]:
        if Identity.read_flag:
            flag = torch.zeros((), dtype=torch.bool, device=grad.device)
            if bool(flag):
                raise RuntimeError("never")
        return None, None

    read_flag = False


def timed_backward(read_flag: bool) -> float:
    device = torch.device("cuda")
    rows = torch.zeros((1_048_570, 128), device=device)
    grad = torch.ones_like(rows)
    trigger = torch.zeros((), device=device, requires_grad=True)
    Identity.read_flag = read_flag
    times = []
    for i in range(60):
        out = Identity.apply(trigger, rows)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.autograd.backward([out], [grad])
        torch.cuda.synchronize()
        if i >= 10:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    print(f"autograd backward, nothing inside:          {timed_backward(False):.3f} ms")
    print(f"autograd backward, one kernel + one read:   {timed_backward(True):.3f} ms")


if __name__ == "__main__":
    main()
