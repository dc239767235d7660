"""Per step of ``demb bench module``'s loop (Adam, NONE, H200): the phases' wall times and the
caching allocator's cudaMalloc / cudaFree calls during the step. It found one cudaMalloc in every
step (the eval's batch checks took a new pool stream per call, and the allocator keeps a
stream's freed blocks for that stream only); none since the checks have one stream per device.

Usage: ``python alloc_per_step.py`` (after ``source .device/setup.sh`` on the H200).
"""

from __future__ import annotations

import torch
from demb_torchrec.bench.module_bench import _demb_step, ready
from demb_torchrec.bench.workload import Workload

_KEYS = ("num_device_alloc", "num_device_free", "num_alloc_retries")


def main() -> None:
    module, batches, grad = ready(Workload(), torch.device("cuda"))
    for i in range(25):
        before = torch.cuda.memory_stats()
        fwd, bwd, ev = _demb_step(module, batches[i % len(batches)], grad)
        after = torch.cuda.memory_stats()
        moves = {k: after.get(k, 0) - before.get(k, 0) for k in _KEYS}
        reserved = after["reserved_bytes.all.current"] / 2**30
        print(
            f"step {i:2d} fwd {fwd * 1e3:.3f} bwd {bwd * 1e3:.3f} eval {ev * 1e3:.3f} ms  "
            f"{moves}  reserved {reserved:.1f} GiB"
        )


if __name__ == "__main__":
    main()
