"""demb::optimizer_update's ``grad_rows`` / ``grad_source``: an entry whose row ``r`` is not -1
reads its gradient from ``grad_source[r]`` instead of its ``grads`` row (the table module's
keys of one occurrence, whose sums are skipped). Checked against the same update given those
rows gathered into ``grads`` (torch indexing), bit for bit, on the CPU and (marker ``cuda``)
CUDA == CPU on the scalar and float4 paths; bad arguments are named and change no row."""

from __future__ import annotations

import pytest
import torch
from demb_optim import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad, update_parameters
from hypothesis import given, settings
from hypothesis import strategies as st

SPECS = [
    SGD(learning_rate=0.1),
    Adam(learning_rate=0.01, weight_decay=0.01),
    Adagrad(learning_rate=0.1, initial_accumulator_value=0.1),
    RowWiseAdagrad(learning_rate=0.1),
    FTRL(learning_rate=0.1, l1_reg=0.01, l2_reg=0.1, initial_accumulator_value=0.1),
]


def update(spec, values, slots, grads, dim, *, grad_rows=None, grad_source=None, step=2):
    torch.ops.demb.optimizer_update(
        values, slots, grads, [dim] * len(values), [step] * len(values), str(spec.kind),
        *update_parameters(spec), None, grad_rows, grad_source,
    )  # fmt: skip


def case(spec, sizes, dim, sources, dtype, gen):
    """Tables of 50 rows, ``sizes[t]`` entries each, their grads, a source of ``sources`` rows
    and each entry's source row (about half of them -1)."""
    tables, slots, grads = [], [], []
    for n in sizes:
        state = spec.initial_state(dim, dtype).float().repeat(50, 1)
        tables.append(torch.cat([torch.randn(50, dim, generator=gen), state], 1).to(dtype))
        slots.append(torch.randperm(50, generator=gen)[:n])
        grads.append(torch.randn(n, dim, generator=gen))
    source = torch.randn(sources, dim, generator=gen)
    rows = torch.randint(0, sources, (sum(sizes),), generator=gen)
    rows[torch.rand(rows.numel(), generator=gen) < 0.5] = -1
    return tables, slots, grads, source, rows


def gathered(grads, source, rows):
    """Each table's grads with the entries of a source row replaced by that row."""
    flat = torch.cat(grads)
    flat = torch.where((rows >= 0)[:, None], source[rows.clamp(min=0)], flat)
    return list(flat.split([g.shape[0] for g in grads]))


@settings(max_examples=40, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    sizes=st.lists(st.integers(0, 20), min_size=1, max_size=3),
    dim=st.integers(1, 40),
    sources=st.integers(1, 30),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    seed=st.integers(0, 2**31),
)
def test_grad_rows_equal_the_gathered_update(spec, sizes, dim, sources, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    tables, slots, grads, source, rows = case(spec, sizes, dim, sources, dtype, gen)
    want = [t.clone() for t in tables]
    update(spec, want, slots, gathered(grads, source, rows), dim)
    update(spec, tables, slots, grads, dim, grad_rows=rows, grad_source=source)
    for got, ref in zip(tables, want, strict=True):
        assert torch.equal(got, ref)


@pytest.mark.cuda
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
@pytest.mark.parametrize("dim", [128, 130, 12])
def test_cuda_grad_rows_equal_cpu(spec, dim):
    """dims 128 and 12: the float4 path (and a source at an odd offset: the scalar path);
    130: the scalar path. Three tables, one empty."""
    gen = torch.Generator().manual_seed(dim)
    tables, slots, grads, source, rows = case(spec, [40, 0, 33], dim, 500, torch.float32, gen)
    gpu = [t.cuda() for t in tables]
    update(spec, tables, slots, grads, dim, grad_rows=rows, grad_source=source)
    on_gpu = ([s.cuda() for s in slots], [g.cuda() for g in grads])
    update(spec, gpu, *on_gpu, dim, grad_rows=rows.cuda(), grad_source=source.cuda())
    for got, ref in zip(gpu, tables, strict=True):
        assert torch.equal(got.cpu(), ref)
    shifted = torch.randn(source.numel() + 1, device="cuda")[1:].view_as(source)
    shifted.copy_(source)
    update(spec, gpu, *on_gpu, dim, grad_rows=rows.cuda(), grad_source=shifted, step=3)
    update(spec, tables, slots, grads, dim, grad_rows=rows, grad_source=source, step=3)
    for got, ref in zip(gpu, tables, strict=True):
        assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize(
    ("bad", "error", "match"),
    [
        ("one", ValueError, "grad_rows and grad_source: give both or neither"),
        ("count", ValueError, r"grad_rows must be \(3,\): one row per entry"),
        ("dtype", TypeError, "grad_rows must be int64"),
        ("source", TypeError, "grad_source must be float32"),
        ("width", ValueError, r"grad_source has rows of 5 floats; dims\[0\]=4"),
        ("range", ValueError, "grad_rows: 7 is out of range for 6 grad_source rows"),
    ],
)
def test_bad_grad_rows_are_named_and_change_no_row(bad, error, match):
    spec = SGD(learning_rate=0.5)
    values = [torch.ones(5, 4), torch.ones(5, 4)]
    slots = [torch.tensor([0, 1]), torch.tensor([3])]
    grads = [torch.ones(2, 4), torch.ones(1, 4)]
    rows, source = torch.tensor([-1, 2, 0]), torch.ones(6, 4)
    if bad == "one":
        source = None
    elif bad == "count":
        rows = rows[:2]
    elif bad == "dtype":
        rows = rows.int()
    elif bad == "source":
        source = source.double()
    elif bad == "width":
        source = torch.ones(6, 5)
    elif bad == "range":
        rows = torch.tensor([-1, 7, 0])
    with pytest.raises(error, match=match):
        update(spec, values, slots, grads, 4, grad_rows=rows, grad_source=source)
    assert all(torch.equal(v, torch.ones(5, 4)) for v in values)
