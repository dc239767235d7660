"""gather_rows / scatter_rows (and their many-buffer forms) against plain torch indexing, for every
dtype and row width (the copy unit changes with the row's bytes), on the CPU and, marked `cuda`,
on a GPU."""

from __future__ import annotations

import pytest
import torch
from demb_kernels.rows import gather_rows, gather_rows_many, scatter_rows, scatter_rows_many
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8]


def reference_gather(values: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    out = values[slots.clamp_min(0)].clone()
    out[slots < 0] = 0
    return out


def cases(device: str):
    return given(
        rows=st.integers(1, 300),
        width=st.integers(1, 300),
        n=st.integers(0, 200),
        dtype=st.sampled_from(DTYPES),
        seed=st.integers(0, 2**31),
    )


def _data(rows, width, n, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(rows, width, generator=g) * 50).to(dtype).to(device)
    slots = torch.randint(-1, rows, (n,), generator=g).to(device)
    return values, slots


def _check(rows, width, n, dtype, seed, device):
    values, slots = _data(rows, width, n, dtype, seed, device)
    torch.testing.assert_close(
        gather_rows(values, slots), reference_gather(values, slots), rtol=0, atol=0
    )
    unique = torch.unique(slots[slots >= 0])
    target = torch.cat([unique, torch.tensor([-1], device=device)])
    new = (torch.arange(target.numel() * width) % 7).reshape(-1, width).to(dtype).to(device)
    expected = values.clone()
    expected[unique] = new[:-1]
    scatter_rows(values, target, new)
    torch.testing.assert_close(values, expected, rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@cases("cpu")
def test_rows_ops_equal_torch_indexing_on_cpu(rows, width, n, dtype, seed):
    _check(rows, width, n, dtype, seed, "cpu")


@pytest.mark.cuda
@settings(max_examples=60, deadline=None)
@cases("cuda")
def test_rows_ops_equal_torch_indexing_on_cuda(rows, width, n, dtype, seed):
    _check(rows, width, n, dtype, seed, "cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_rows_ops_reject_bad_arguments(device):
    values = torch.zeros(4, 3, device=device)
    with pytest.raises(ValueError, match="out of range"):
        gather_rows(values, torch.tensor([4], device=device))
    with pytest.raises(ValueError, match="out of range"):
        scatter_rows(values, torch.tensor([-2], device=device), torch.zeros(1, 3, device=device))
    with pytest.raises(TypeError, match="slots must be int64"):
        gather_rows(values, torch.tensor([1], dtype=torch.int32, device=device))
    with pytest.raises(TypeError, match="rows must be"):
        scatter_rows(values, torch.tensor([1], device=device), torch.zeros(1, 3, dtype=torch.half))
    with pytest.raises(ValueError, match="rows must be"):
        scatter_rows(values, torch.tensor([1], device=device), torch.zeros(2, 3, device=device))


@pytest.mark.parametrize(
    ("width", "dtype"), [(100, torch.float32), (101, torch.float32), (257, torch.int8)]
)
@pytest.mark.parametrize("offset", [0, 1])
def test_scatters_larger_than_a_cache_equal_torch_indexing(width, dtype, offset):
    """A scatter of more than 1 MiB streams its stores on the CPU where the rows allow it
    (16-byte multiples at 16-byte aligned places; ``offset`` shifts the buffer by one
    element): what it writes, and skips, is what indexing does."""
    rows = (3 << 20) // (width * dtype.itemsize)
    g = torch.Generator().manual_seed(width + offset)
    flat = torch.randint(-100, 100, (rows * width + 1,), generator=g).to(dtype)
    values = flat[offset : offset + rows * width].view(rows, width)
    target = torch.randperm(rows, generator=g)[: rows // 2]
    target[::97] = -1
    new = torch.randint(-100, 100, (target.numel(), width), generator=g).to(dtype)
    expected = values.clone()
    expected[target[target >= 0]] = new[target >= 0]
    scatter_rows(values, target, new)
    torch.testing.assert_close(values, expected, rtol=0, atol=0)


@settings(max_examples=40, deadline=None)
@given(
    tables=st.lists(
        st.tuples(
            st.integers(1, 200),  # rows
            st.integers(1, 80),  # width
            st.integers(0, 3000),  # n
            st.sampled_from(DTYPES),
        ),
        max_size=5,
    ),
    seed=st.integers(0, 2**31),
)
def test_many_buffer_ops_equal_torch_indexing_per_buffer(tables, seed):
    """gather_rows_many / scatter_rows_many over buffers of several shapes and dtypes (one op
    on the CPU, split over threads across buffers) equal indexing each buffer alone; slot -1
    gathers zeros and is skipped by a scatter."""
    data = [_data(r, w, n, d, seed + i, "cpu") for i, (r, w, n, d) in enumerate(tables)]
    values = [v for v, _ in data]
    slots = [s for _, s in data]
    got = gather_rows_many(values, slots)
    assert len(got) == len(values)
    for out, v, s in zip(got, values, slots, strict=True):
        torch.testing.assert_close(out, reference_gather(v, s), rtol=0, atol=0)
    slots = [torch.unique(s)[torch.randperm(torch.unique(s).numel())] for s in slots]
    rows = [
        (torch.randn(s.numel(), v.shape[1]) * 50).to(v.dtype)
        for v, s in zip(values, slots, strict=True)
    ]
    want = [v.clone() for v in values]
    for w, s, r in zip(want, slots, rows, strict=True):
        keep = s >= 0
        w[s[keep]] = r[keep]
    scatter_rows_many(values, slots, rows)
    for v, w in zip(values, want, strict=True):
        torch.testing.assert_close(v, w, rtol=0, atol=0)


def test_many_buffer_ops_check_their_arguments():
    values = [torch.zeros(4, 3), torch.zeros(5, 2)]
    slots = [torch.tensor([0, 3]), torch.tensor([5])]
    with pytest.raises(ValueError, match="out of range for 5 rows"):
        gather_rows_many(values, slots)
    with pytest.raises(ValueError, match="2 buffers, 1 slot lists"):
        gather_rows_many(values, slots[:1])
    with pytest.raises(ValueError, match="differ in length"):
        scatter_rows_many(values, slots, [torch.zeros(2, 3)])
    with pytest.raises(TypeError, match="rows must be Float"):
        scatter_rows_many(values[:1], slots[:1], [torch.zeros(2, 3, dtype=torch.float64)])
    assert (values[0] == 0).all()
    assert (values[1] == 0).all()
