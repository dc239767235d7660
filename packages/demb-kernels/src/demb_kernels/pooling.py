"""A pooled lookup's bags summed straight from the tables' rows (``demb::pool_table_rows``,
``csrc/pool_checks.h``): each bag's rows read by slot and added in index order, one pass, with
no per-index row or per-index table materialized. The CPU and CUDA kernels add in the same
order without contraction, so they give the same floats."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from demb_kernels import _library  # noqa: F401  (loads the native ops)

__all__ = ["pool_cpu_build", "pool_table_rows"]


def pool_table_rows(
    values: Sequence[torch.Tensor],
    slots: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    batch_size: int,
    dim: int,
    *,
    mean: bool = False,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[b, f * dim + c]`` = the sum over bag ``f * batch_size + b``'s indices ``i``, in
    order, of ``values[feature_tables[f]][slots[i], c]`` (times ``weights[i]``: the product,
    then the sum); a slot of -1 adds nothing. With ``mean`` the sum is divided by the bag's
    length (missing keys included); an empty bag is zeros.

    Args:
        values: ``T <= 64`` contiguous float32 ``(R_t, W_t >= dim)`` value buffers.
        slots: ``(N,)`` int64 slot of each index in its feature's table, -1 for none.
        offsets: ``(F * B + 1,)`` int64 bag offsets, feature-major, from 0 to ``N``.
        feature_tables: ``(F,)`` int64 table of each feature.
        batch_size: ``B >= 1``.
        dim: the columns pooled, ``>= 1``.
        mean: divide each bag's sum by its length.
        weights: ``(N,)`` float32 per-index factors, or None.

    Returns:
        ``(B, F * dim)`` float32.

    Raises:
        TypeError / ValueError: a bad dtype or shape. The CPU kernel also checks the values
        (offsets in order from 0 to N, table ids and slots in range) before writing anything;
        the CUDA kernel does not read them back: a table id or slot out of range adds nothing,
        and a decreasing bag is empty.
    """
    out: torch.Tensor = torch.ops.demb.pool_table_rows(
        list(values), slots, offsets, feature_tables, batch_size, dim, mean, weights
    )
    return out


@torch.library.register_fake("demb::pool_table_rows")  # type: ignore[untyped-decorator]
def _pool_table_rows_fake(
    values: list[torch.Tensor],
    slots: torch.Tensor,
    offsets: torch.Tensor,
    feature_tables: torch.Tensor,
    batch_size: int,
    dim: int,
    mean: bool,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    return slots.new_empty((batch_size, feature_tables.shape[0] * dim), dtype=torch.float32)


def pool_cpu_build() -> str:
    """Which build of :func:`pool_table_rows`' CPU kernel this process runs: ``"avx2"`` (x86-64
    Linux, where PyTorch's CPU capability is AVX2 or AVX512) or ``"portable"`` (any CPU; also
    where ``ATEN_CPU_CAPABILITY=default`` holds PyTorch's own kernels to that level). Both add
    the same floats in the same order: the same results."""
    build: str = torch.ops.demb.pool_cpu_build.default()
    return build
