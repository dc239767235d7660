"""The fused CPU update (demb::optimizer_update) against the float64 references: every optimizer,
hypothesis-drawn dims and hyper-parameters, several steps, rows first written at later steps
(seeded with the spec's initial state), several tables of different dims in one call, and
float32 / float16 / bfloat16 rows with float32 arithmetic."""

from __future__ import annotations

import pytest
import torch
from demb_optim import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad, apply_update, reference_update
from hypothesis import example, given, settings
from hypothesis import strategies as st

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}

SPECS = st.one_of(
    st.builds(SGD, learning_rate=st.floats(0.01, 0.5)),
    st.builds(
        Adam,
        learning_rate=st.floats(0.001, 0.1),
        beta1=st.floats(0.0, 0.95),
        beta2=st.floats(0.9, 0.9999),
        eps=st.floats(1e-8, 1e-4),
        weight_decay=st.sampled_from([0.0, 0.01]),
    ),
    st.builds(
        Adagrad,
        learning_rate=st.floats(0.01, 0.5),
        initial_accumulator_value=st.sampled_from([0.0, 0.1, 1.0]),
    ),
    st.builds(
        RowWiseAdagrad,
        learning_rate=st.floats(0.01, 0.5),
        initial_accumulator_value=st.sampled_from([0.0, 0.1, 1.0]),
    ),
    st.builds(
        FTRL,
        learning_rate=st.floats(0.01, 0.5),
        learning_rate_power=st.sampled_from([-0.5, -0.3, 0.0]),
        ftrl_beta=st.sampled_from([0.0, 1.0]),
        l1_reg=st.sampled_from([0.0, 0.01]),
        l2_reg=st.sampled_from([0.0, 0.1]),
        initial_accumulator_value=st.sampled_from([0.1, 1.0]),
    ),
)


def update_cases(max_dim):
    """The strategies of an update case: a spec, one to three tables of dims up to
    ``max_dim``, a row dtype and a seed."""
    return {
        "spec": SPECS,
        "dims": st.lists(st.integers(1, max_dim), min_size=1, max_size=3),
        "dtype": st.sampled_from(list(TOLERANCE)),
        "seed": st.integers(0, 2**31),
    }


def check_cuda_equals_cpu(spec, cpu_tables, slot_lists, grad_lists, dims, steps):
    """Each update of ``steps`` (per table step lists) applied to ``cpu_tables`` and to their
    copies on CUDA (the same slots and gradients): the rows end equal bit for bit."""
    gpu_tables = [t.cuda() for t in cpu_tables]
    gpu_slots = [s.cuda() for s in slot_lists]
    gpu_grads = [g.cuda() for g in grad_lists]
    for step in steps:
        apply_update(spec, cpu_tables, slot_lists, grad_lists, dims, step)
        apply_update(spec, gpu_tables, gpu_slots, gpu_grads, dims, step)
    for a, b in zip(cpu_tables, gpu_tables, strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0)


def ftrl_example(power):
    """An explicit example: FTRL at learning rate 0.01 and power ``power`` (no beta, initial
    accumulator 1.0), one float32 table of dim 40, seed 34."""
    spec = FTRL(
        learning_rate=0.01, learning_rate_power=power, ftrl_beta=0.0, initial_accumulator_value=1.0
    )
    return example(spec=spec, dims=[40], dtype=torch.float32, seed=34)


def first_rows(spec, n, dim, dtype, gen):
    """``n`` rows as a key's first write makes them: random embedding, the initial state."""
    state = spec.initial_state(dim, dtype).float().repeat(n, 1)
    return torch.cat([torch.randn(n, dim, generator=gen), state], dim=1).to(dtype)


@settings(max_examples=80, deadline=None)
@given(**update_cases(max_dim=40))
# FTRL at a small learning rate: the rate's growth divided by it once cancelled most digits of
# a float32 difference of two close rates (a weight 1.8% off the reference after 3 steps).
@ftrl_example(power=-0.5)
@ftrl_example(power=-0.3)
def test_fused_update_equals_the_float64_reference(spec, dims, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = 12
    tables, refs = [], []
    for dim in dims:
        width = dim + spec.state_dim(dim, dtype)
        buf = torch.zeros(rows, width, dtype=dtype)
        tables.append(buf)
        refs.append(torch.zeros(rows, width, dtype=torch.float64))
    written = [torch.zeros(rows, dtype=torch.bool) for _ in dims]
    for step in range(1, 6):
        slot_lists, grad_lists = [], []
        for t, dim in enumerate(dims):
            slots = torch.randperm(rows, generator=gen)[
                : int(torch.randint(1, rows, (1,), generator=gen))
            ]
            new = slots[~written[t][slots]]  # first written now: initial row and state
            tables[t][new] = first_rows(spec, new.numel(), dim, dtype, gen)
            refs[t][new] = tables[t][new].to(torch.float64)
            written[t][new] = True
            grad = torch.randn(slots.numel(), dim, generator=gen) * 0.3
            slots = torch.cat([slots, torch.tensor([-1])])  # -1 is skipped
            grad = torch.cat([grad, torch.full((1, dim), 1e6)])
            slot_lists.append(slots)
            grad_lists.append(grad)
        apply_update(spec, tables, slot_lists, grad_lists, dims, [step] * len(dims))
        for t, dim in enumerate(dims):
            s, g = slot_lists[t][:-1], grad_lists[t][:-1]
            w_new, s_new = reference_update(
                spec, refs[t][s, :dim], refs[t][s, dim:], g.to(torch.float64), step
            )
            refs[t][s] = torch.cat([w_new, s_new], dim=1).to(dtype).to(torch.float64)
    tol = TOLERANCE[dtype]
    for t in range(len(dims)):
        torch.testing.assert_close(tables[t].to(torch.float64), refs[t], rtol=tol, atol=tol)


@pytest.mark.parametrize(
    ("case", "error", "match"),
    [
        ("width", ValueError, r"values\[0\] rows have 6 columns; dims\[0\]=4 needs 12"),
        ("dtype", TypeError, r"values\[0\] must be float32, float16 or bfloat16"),
        ("grads", ValueError, r"grads\[0\] must be \(2, 4\)"),
        ("slot", ValueError, r"slots\[0\]: 9 is out of range for 5 rows"),
        ("nan", ValueError, r"grads\[0\]: contains NaN or infinite values; no row was updated"),
        ("step", ValueError, r"steps\[0\]=0: Adam's step count must be >= 1"),
        ("lists", ValueError, "one entry per table"),
    ],
)
def test_bad_arguments_are_named(case, error, match):
    spec = Adam()
    values = torch.zeros(5, 12)
    slots = torch.tensor([0, 1])
    grads = torch.zeros(2, 4)
    dims, steps = [4], [1]
    if case == "width":
        values = torch.zeros(5, 6)
    elif case == "dtype":
        values = torch.zeros(5, 12, dtype=torch.float64)
    elif case == "grads":
        grads = torch.zeros(2, 5)
    elif case == "slot":
        slots = torch.tensor([0, 9])
    elif case == "nan":
        grads = torch.tensor([[0.0, 1.0, 2.0, 3.0], [0.0, float("inf"), 0.0, 0.0]])
    elif case == "step":
        steps = [0]
    elif case == "lists":
        dims = [4, 4]
    with pytest.raises(error, match=match):
        apply_update(spec, [values], [slots], [grads], dims, steps)


@pytest.mark.parametrize("bad", ["width", "slot", "nan"])
def test_a_bad_later_table_leaves_every_table_unchanged(bad):
    """Every table is checked before any row changes: table 0 is good, table 1 is not."""
    spec = Adagrad()
    good = torch.ones(4, 6)
    other = torch.ones(4, 6 if bad != "width" else 5)
    slots = [torch.tensor([0, 1]), torch.tensor([2, 7 if bad == "slot" else 3])]
    grads = [torch.ones(2, 3), torch.full((2, 3), float("nan") if bad == "nan" else 1.0)]
    with pytest.raises(ValueError, match=r"\[1\]"):
        apply_update(spec, [good, other], slots, grads, [3, 3])
    assert torch.equal(good, torch.ones(4, 6))
    assert torch.equal(other, torch.ones_like(other))


@pytest.mark.cuda
@pytest.mark.parametrize("bad", ["slot", "nan"])
def test_cuda_bad_data_is_caught_before_any_row_changes(bad):
    values = torch.ones(4, 6, device="cuda")
    slots = torch.tensor([0, 4 if bad == "slot" else 1], device="cuda")
    grads = torch.full((2, 3), float("nan") if bad == "nan" else 1.0, device="cuda")
    with pytest.raises(ValueError, match=r"slots\[0\]: a slot is out of range|grads\[0\]"):
        apply_update(Adagrad(), [values], [slots], [grads], [3])
    assert torch.equal(values.cpu(), torch.ones(4, 6))


@pytest.mark.cuda
@settings(max_examples=40, deadline=None)
@given(**update_cases(max_dim=200))
def test_cuda_update_equals_cpu_update(spec, dims, dtype, seed):
    """Same rows, slots and gradients: the CUDA kernel gives the CPU kernel's rows bit for bit
    (no contracted multiply-adds on either side, row-wise Adagrad's sum in the warp's order on
    both, FTRL's general power through double)."""
    gen = torch.Generator().manual_seed(seed)
    rows = 64
    cpu_tables, slot_lists, grad_lists = [], [], []
    for dim in dims:
        cpu_tables.append(first_rows(spec, rows, dim, dtype, gen))
        count = int(torch.randint(1, rows, (1,), generator=gen))
        slot_lists.append(torch.randperm(rows, generator=gen)[:count])
        grad_lists.append(torch.randn(count, dim, generator=gen))
    steps = [[step] * len(dims) for step in (1, 2, 3)]
    check_cuda_equals_cpu(spec, cpu_tables, slot_lists, grad_lists, dims, steps)


@settings(max_examples=30, deadline=None)
@given(
    lr=st.floats(0.01, 0.5),
    beta=st.sampled_from([0.0, 1.0]),
    l1=st.sampled_from([0.0, 0.01]),
    n0=st.sampled_from([0.1, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_fused_ftrl_sqrt_path_equals_its_general_path(lr, beta, l1, n0, seed):
    """learning_rate_power = -0.5 runs the square-root kernel; a power that differs from -0.5
    only in double (the kernel's float power is the same -0.5) runs the general pow path."""
    gen = torch.Generator().manual_seed(seed)
    dim = 16
    hyper = {"learning_rate": lr, "ftrl_beta": beta, "l1_reg": l1, "initial_accumulator_value": n0}
    specs = [FTRL(learning_rate_power=power, **hyper) for power in (-0.5, -0.5 - 1e-12)]
    tables = [
        torch.cat([torch.ones(8, dim), spec.initial_state(dim).repeat(8, 1)], dim=1)
        for spec in specs
    ]
    for step in range(1, 4):
        slots = torch.arange(8)
        grads = torch.randn(8, dim, generator=gen)
        for table, spec in zip(tables, specs, strict=True):
            apply_update(spec, [table], [slots], [grads], [dim], [step])
    torch.testing.assert_close(tables[0], tables[1], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_set_skip_flag_changes_no_row(device):
    """``skip``: a device flag (the caller's NaN/inf test) read by the update itself."""
    values = torch.ones(4, 6, device=device)
    slots, grads = torch.tensor([0, 2], device=device), torch.ones(2, 3, device=device)
    skip = torch.tensor(True, device=device)
    apply_update(Adagrad(), [values], [slots], [grads], [3], check=False, skip=skip)
    assert torch.equal(values.cpu(), torch.ones(4, 6))
    apply_update(Adagrad(), [values], [slots], [grads], [3], check=False, skip=~skip)
    assert not torch.equal(values.cpu(), torch.ones(4, 6))
    with pytest.raises(TypeError, match="skip must be bool"):
        apply_update(Adagrad(), [values], [slots], [grads], [3], skip=skip.int())


@pytest.mark.cuda
def test_cuda_update_of_many_tables_of_mixed_dtypes_equals_cpu():
    """40 tables in runs of dtypes: launches of up to 32 tables of one dtype each."""
    gen = torch.Generator().manual_seed(5)
    spec = Adam(learning_rate=0.05)
    dtypes = [torch.float32] * 35 + [torch.bfloat16] * 3 + [torch.float32] * 2
    dims = [1 + t % 7 for t in range(40)]
    cpu_tables = [first_rows(spec, 16, d, dt, gen) for d, dt in zip(dims, dtypes, strict=True)]
    slot_lists = [torch.randperm(16, generator=gen)[: 1 + t % 9] for t in range(40)]
    slot_lists[7] = slot_lists[7][:0]  # a table without rows this step
    grad_lists = [
        torch.randn(s.numel(), d, generator=gen) for s, d in zip(slot_lists, dims, strict=True)
    ]
    check_cuda_equals_cpu(spec, cpu_tables, slot_lists, grad_lists, dims, [[3] * 40])


@pytest.mark.cuda
@pytest.mark.parametrize(
    "spec",
    [
        SGD(learning_rate=0.1),
        Adam(learning_rate=0.01, weight_decay=0.01),
        Adagrad(learning_rate=0.1, initial_accumulator_value=0.1),
        RowWiseAdagrad(learning_rate=0.1),
        FTRL(learning_rate=0.1, l1_reg=0.01, l2_reg=0.1, initial_accumulator_value=0.1),
    ],
    ids=lambda s: type(s).__name__,
)
@pytest.mark.parametrize(
    "dims", [[128], [4, 64, 256], [128, 130]], ids=["128", "aligned", "one-misaligned"]
)
def test_cuda_float4_update_equals_cpu(spec, dims):
    """float32 tables with dims (and widths) multiples of 4 take the kernel's float4 path; a
    launch with one table of dim 130 takes the scalar path for all. Either equals the CPU bit
    for bit, and a grads tensor at an odd offset (not 16-byte aligned) too."""
    gen = torch.Generator().manual_seed(11)
    rows = 300
    cpu_tables = [first_rows(spec, rows, d, torch.float32, gen) for d in dims]
    slot_lists = [torch.randperm(rows, generator=gen)[:257] for _ in dims]
    grad_lists = [torch.randn(257, d, generator=gen) for d in dims]
    gpu_tables = [t.cuda() for t in cpu_tables]
    for step in (1, 2):
        apply_update(spec, cpu_tables, slot_lists, grad_lists, dims, [step] * len(dims))
        shifted = [torch.randn(g.numel() + 1, device="cuda")[1:].view_as(g) for g in grad_lists]
        for s, g in zip(shifted, grad_lists, strict=True):
            s.copy_(g)
        grads = shifted if step == 2 else [g.cuda() for g in grad_lists]
        apply_update(
            spec, gpu_tables, [s.cuda() for s in slot_lists], grads, dims, [step] * len(dims)
        )
    for a, b in zip(cpu_tables, gpu_tables, strict=True):
        torch.testing.assert_close(b.cpu(), a, rtol=0, atol=0)
