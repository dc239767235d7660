"""Loading of the native library and what it was built with."""

from __future__ import annotations

import torch

import demb_kernels._C  # noqa: F401  (registers the `demb` ops and their CPU/CUDA kernels)

__all__ = ["OPS", "cuda_kernels_built", "has_kernel"]

OPS = (
    "hash64",
    "route_keys",
    "bucketize_by_owner",
    "table_lookup",
    "table_find_or_insert",
    "table_find_or_insert_rows",
    "table_insert_or_assign",
    "table_erase",
    "table_timestamp",
    "table_find_rows",
    "table_find_batch_rows",
    "gather_rows",
    "scatter_rows",
    "init_rows",
    "init_new_rows",
    "optimizer_update",
    "gather_table_rows",
    "pool_table_rows",
    "segment_plan",
    "segment_sum_rows",
    "segment_single_rows",
    "dedup_batch",
    "index_tables",
    "status_counts",
)
"""Every op of the ``demb`` torch library (each has CPU and CUDA kernels)."""


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether op ``demb::<op>`` has a kernel registered for ``dispatch_key`` ("CPU", "CUDA")."""
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"demb::{op}", dispatch_key))


def cuda_kernels_built() -> bool:
    """Whether the library was built with its CUDA kernels (``DEMB_CUDA=1`` at build time)."""
    return all(has_kernel(op, "CUDA") for op in OPS)
