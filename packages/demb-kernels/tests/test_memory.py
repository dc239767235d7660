"""demb_kernels.memory: CPU tables backed by transparent huge pages where Linux grants them. The
values are torch.full's; on a Linux with THP not ``never``, the kernel marks the tensor's memory
eligible for huge pages (/proc/self/smaps)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from demb_kernels import memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_usable() -> bool:
    return sys.platform.startswith("linux") and THP.exists() and "[never]" not in THP.read_text()


def smaps_entry(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
            continue
        if inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.parametrize(
    ("size", "value", "dtype"),
    [
        ((3,), -1, torch.int64),
        ((1 << 20,), -1, torch.int64),  # 8 MiB: advised
        ((2, 1 << 19), 0, torch.int64),
        ((4096, 300), 0.0, torch.float32),
        ((5 << 20,), 0, torch.uint8),
        ((1024, 1000), 1.5, torch.bfloat16),
    ],
)
def test_full_holds_torch_full_values(size, value, dtype):
    got = memory.full(size, value, dtype=dtype, device=torch.device("cpu"))
    assert got.dtype == dtype
    assert got.shape == size
    assert got.is_contiguous()
    assert torch.equal(got, torch.full(size, value, dtype=dtype))


@pytest.mark.skipif(not thp_usable(), reason="transparent huge pages are off or not Linux")
def test_a_big_cpu_tensor_is_advised_and_eligible_for_huge_pages():
    # 64 MiB: above glibc's largest mmap threshold (32 MiB), so a fresh mapping of its own even
    # late in a long run (a 16 MiB block reused from the heap once tested not eligible)
    t = torch.empty(64 << 20, dtype=torch.uint8)
    assert memory.advise_huge_pages(t)
    first = -(-t.data_ptr() // memory.HUGE_PAGE_BYTES) * memory.HUGE_PAGE_BYTES
    assert smaps_entry(first).get("THPeligible") == "1"


def test_what_cannot_be_advised_is_left_alone():
    assert not memory.advise_huge_pages(torch.empty(1000))  # under one aligned huge page
    big = torch.empty(4096, 2048)
    assert not memory.advise_huge_pages(big.t())  # not contiguous
    if not sys.platform.startswith("linux"):
        assert not memory.advise_huge_pages(big)
