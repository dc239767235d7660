"""gather_table_rows and segment_sum_rows against pure-PyTorch references (CPU), and CUDA ==
CPU bit for bit (marker ``cuda``)."""

from __future__ import annotations

import pytest
import torch
from demb_kernels.lookup import (
    SEGMENT_CHUNK,
    gather_table_rows,
    plan_differs,
    segment_plan,
    segment_single_rows,
    segment_sum_rows,
)
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def tables_case(gen, num_tables, dim, unique, n, dtype, extra_width):
    values = [
        torch.randn(
            int(torch.randint(1, 40, (1,), generator=gen)), dim + extra_width, generator=gen
        ).to(dtype)
        for _ in range(num_tables)
    ]
    tables = torch.randint(0, num_tables, (unique,), generator=gen)
    rows = torch.tensor([v.shape[0] for v in values])
    slots = (torch.rand(unique, generator=gen) * rows[tables]).long()
    slots[torch.rand(unique, generator=gen) < 0.2] = -1
    inverse = (
        torch.randint(0, max(unique, 1), (n,), generator=gen)
        if unique
        else torch.zeros(0, dtype=torch.long)
    )
    return values, slots, tables, inverse


def gather_reference(values, slots, tables, inverse, dim):
    out = torch.zeros(inverse.numel(), dim)
    for i, u in enumerate(inverse.tolist()):
        s, t = int(slots[u]), int(tables[u])
        if s >= 0:
            out[i] = values[t][s, :dim].float()
    return out


@settings(max_examples=60, deadline=None)
@given(
    num_tables=st.integers(1, 5),
    dim=st.integers(1, 300),
    unique=st.integers(0, 30),
    n=st.integers(0, 80),
    dtype=st.sampled_from(DTYPES),
    extra=st.sampled_from([0, 3, 16]),
    seed=st.integers(0, 2**31),
)
def test_gather_table_rows_matches_the_reference(num_tables, dim, unique, n, dtype, extra, seed):
    gen = torch.Generator().manual_seed(seed)
    values, slots, tables, inverse = tables_case(
        gen, num_tables, dim, unique, n if unique else 0, dtype, extra
    )
    got = gather_table_rows(values, slots, tables, inverse, dim)
    assert got.dtype == torch.float32
    assert torch.equal(got, gather_reference(values, slots, tables, inverse, dim))
    every = torch.arange(unique)
    one_each = gather_table_rows(values, slots, tables, None, dim)  # no inverse: row u is key u
    assert torch.equal(one_each, gather_reference(values, slots, tables, every, dim))


def segments_case(gen, n, unique, d):
    grads = torch.randn(n, d, generator=gen)
    order = torch.randperm(n, generator=gen)
    cuts = torch.sort(torch.randint(0, n + 1, (unique - 1,), generator=gen)).values
    starts = torch.cat([torch.zeros(1, dtype=torch.long), cuts])
    return grads, order, starts


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 300),
    unique=st.integers(1, 12),
    d=st.integers(1, 200),
    seed=st.integers(0, 2**31),
)
def test_segment_sum_rows_matches_a_float64_sum(n, unique, d, seed):
    gen = torch.Generator().manual_seed(seed)
    grads, order, starts = segments_case(gen, n, unique, d)
    got, nonfinite = segment_sum_rows(grads, order, starts)
    assert not nonfinite
    ends = torch.cat([starts[1:], torch.tensor([n])])
    want = torch.stack(
        [
            grads[order[b:e]].to(torch.float64).sum(0)
            for b, e in zip(starts.tolist(), ends.tolist(), strict=True)
        ]
    )
    torch.testing.assert_close(got.to(torch.float64), want, rtol=1e-5, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 200),
    unique=st.integers(1, 10),
    r=st.integers(1, 40),
    d=st.integers(1, 140),
    which=st.sampled_from(["rows", "scale", "both"]),
    seed=st.integers(0, 2**31),
)
def test_segment_sum_rows_of_scaled_rows_is_the_sum_of_their_products(n, unique, r, d, which, seed):
    """Entry p adds scale[p] * grads[rows[p]]: bit for bit the sum of those products made
    first (one float32 product each, then the same sums)."""
    gen = torch.Generator().manual_seed(seed)
    _, order, starts = segments_case(gen, n, unique, 1)
    grads = torch.randn(r if which != "scale" else n, d, generator=gen)
    rows = torch.randint(0, grads.shape[0], (n,), generator=gen) if which != "scale" else None
    scale = torch.rand(n, generator=gen) * 4 - 2 if which != "rows" else None
    products = grads if rows is None else grads[rows]
    if scale is not None:
        products = products * scale[:, None]
    got, _ = segment_sum_rows(grads, order, starts, rows=rows, scale=scale)
    want, _ = segment_sum_rows(products, order, starts)
    assert torch.equal(got, want)


def singles_case(gen, lengths, d):
    """Segments of the given lengths (0, 1 and more) over shuffled rows of ``(N, d)`` grads."""
    n = sum(lengths)
    lens = torch.tensor(lengths, dtype=torch.long)
    starts = torch.cumsum(lens, 0) - lens
    return torch.randn(n, d, generator=gen), torch.randperm(n, generator=gen), starts


@settings(max_examples=50, deadline=None)
@given(
    lengths=st.lists(st.sampled_from([0, 1, 1, 1, 2, 5, 33, 70]), min_size=1, max_size=40),
    d=st.integers(1, 140),
    seed=st.integers(0, 2**31),
)
def test_skip_single_leaves_the_keys_of_one_entry_to_their_grads_rows(lengths, d, seed):
    """segment_single_rows names each one-entry segment's grads row (a Python model); with
    skip_single the other rows are the full sums bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    grads, order, starts = singles_case(gen, lengths, d)
    singles = segment_single_rows(order, starts)
    want = [int(order[b]) if k == 1 else -1 for b, k in zip(starts.tolist(), lengths, strict=True)]
    assert singles.tolist() == want
    full, _ = segment_sum_rows(grads, order, starts)
    got, bad = segment_sum_rows(grads, order, starts, skip_single=True)
    several = singles < 0
    assert torch.equal(got[several], full[several])
    assert torch.equal(full[~several], grads[singles[~several]])  # what the update reads
    assert not bad


def test_skip_single_still_flags_a_skipped_row():
    gen = torch.Generator().manual_seed(3)
    grads, order, starts = singles_case(gen, [2, 1, 3, 1], 5)
    grads[order[2], 4] = float("nan")  # key 1's only entry
    assert segment_sum_rows(grads, order, starts, skip_single=True)[1]
    grads[order[2], 4] = 0.0
    grads[order[6], 1] = float("inf")  # key 3's only entry
    assert segment_sum_rows(grads, order, starts, skip_single=True)[1]
    grads[order[6], 1] = 0.0
    assert not segment_sum_rows(grads, order, starts, skip_single=True)[1]


def plan_reference(starts: list[int], n: int) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Chunk offsets, then (first row, length, destination) per chunk, in plain Python."""
    offsets, chunks = [0], []
    ends = [*starts[1:], n] if starts else []
    for u, (b, e) in enumerate(zip(starts, ends, strict=True)):
        first = offsets[-1]
        cuts = list(range(b, e, SEGMENT_CHUNK))
        for i, c in enumerate(cuts):
            dest = u if len(cuts) == 1 else ~(first + i)
            chunks.append((c, min(c + SEGMENT_CHUNK, e) - c, dest))
        offsets.append(first + len(cuts))
    return offsets, chunks


def unpack_plan(plan: torch.Tensor, unique: int, n: int) -> tuple[list[int], list[tuple]]:
    m = unique + n // SEGMENT_CHUNK + 1
    assert plan.shape == (unique + 1 + 3 * m,)
    p = plan.cpu().tolist()
    offsets = p[: unique + 1]
    cols = [p[unique + 1 + k * m : unique + 1 + (k + 1) * m] for k in range(3)]
    return offsets, list(zip(*(c[: offsets[-1]] for c in cols), strict=True))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 400), unique=st.integers(0, 12), seed=st.integers(0, 2**31))
def test_segment_plan_matches_a_python_model_and_sums_the_same(n, unique, seed):
    gen = torch.Generator().manual_seed(seed)
    if unique == 0:
        grads, order, starts = (
            torch.randn(n, 5),
            torch.randperm(n),
            torch.zeros(0, dtype=torch.long),
        )
    else:
        grads, order, starts = segments_case(gen, n, unique, 5)
    plan = segment_plan(starts, n)
    assert unpack_plan(plan, unique, n) == plan_reference(starts.tolist(), n)
    if n:
        with_plan = segment_sum_rows(grads, order, starts, plan=plan)
        without = segment_sum_rows(grads, order, starts)
        assert torch.equal(with_plan[0], without[0])


def test_a_plan_of_other_starts_is_refused():
    grads, order = torch.randn(100, 3), torch.randperm(100)
    starts = torch.tensor([0, 10, 50])
    other = segment_plan(torch.tensor([0, 40, 50]), 100)
    with pytest.raises(ValueError, match="plan: not segment_plan"):
        segment_sum_rows(grads, order, starts, plan=other)
    with pytest.raises(ValueError, match="plan must be"):
        segment_sum_rows(grads, order, starts, plan=segment_plan(starts, 64))
    with pytest.raises(TypeError, match="plan must be int64"):
        segment_sum_rows(grads, order, starts, plan=segment_plan(starts, 100).int())
    with pytest.raises(ValueError, match="starts: must begin at 0"):
        segment_plan(torch.tensor([3, 10]), 100)
    with pytest.raises(ValueError, match="n: -1"):
        segment_plan(starts, -1)


def test_plan_differs_looks_at_the_live_entries_only():
    starts = torch.tensor([0, 10, 50])
    plan = segment_plan(starts, 100)
    assert not plan_differs(plan, starts, 100)
    assert plan_differs(segment_plan(torch.tensor([0, 40, 50]), 100), starts, 100)
    chunks = int(plan[3])
    m = (plan.numel() - 4) // 3
    edited = plan.clone()
    edited[4 + m + chunks] = 99  # a length past the last chunk: never read
    assert not plan_differs(edited, starts, 100)
    edited[4 + m + chunks - 1] = 99  # the last chunk's length
    assert plan_differs(edited, starts, 100)
    assert not plan_differs(plan[:-1], starts, 100)  # another size: the op's error, not this


def test_segment_sum_rows_adds_chunks_in_a_fixed_order():
    """A segment longer than one chunk: its chunk sums, each in row order, then added in chunk
    order (what the CUDA kernel does too)."""
    gen = torch.Generator().manual_seed(0)
    n = 3 * SEGMENT_CHUNK + 5
    grads = torch.randn(n, 7, generator=gen) * 1e3
    order = torch.randperm(n, generator=gen)
    got, _ = segment_sum_rows(grads, order, torch.tensor([0]))
    total = torch.zeros(7)
    for c in range(0, n, SEGMENT_CHUNK):
        partial = torch.zeros(7)
        for k in range(c, min(c + SEGMENT_CHUNK, n)):
            partial = partial + grads[order[k]]
        total = total + partial
    assert torch.equal(got[0], total)


def test_segment_sum_rows_flags_nan_and_infinity():
    grads = torch.ones(6, 3)
    starts = torch.tensor([0, 2, 5])
    assert not segment_sum_rows(grads, torch.arange(6), starts)[1]
    grads[4, 1] = float("-inf")
    assert segment_sum_rows(grads, torch.arange(6), starts)[1]


def test_bad_arguments_are_named():
    values = [torch.zeros(4, 3)]
    with pytest.raises(ValueError, match="slots: 9 is out of range for table 0 of 4 rows"):
        gather_table_rows(values, torch.tensor([9]), torch.tensor([0]), torch.tensor([0]), 3)
    with pytest.raises(ValueError, match="inverse: 2 is out of range for 1 unique keys"):
        gather_table_rows(values, torch.tensor([0]), torch.tensor([0]), torch.tensor([2]), 3)
    with pytest.raises(ValueError, match="width >= 5"):
        gather_table_rows(values, torch.tensor([0]), torch.tensor([0]), torch.tensor([0]), 5)
    with pytest.raises(TypeError, match="one dtype for all tables"):
        gather_table_rows(
            [values[0], torch.zeros(2, 3, dtype=torch.float16)],
            torch.tensor([0]),
            torch.tensor([0]),
            torch.tensor([0]),
            3,
        )
    with pytest.raises(ValueError, match="starts: must begin at 0"):
        segment_sum_rows(torch.zeros(3, 2), torch.arange(3), torch.tensor([1]))
    with pytest.raises(ValueError, match="order: 5 is out of range"):
        segment_sum_rows(torch.zeros(3, 2), torch.tensor([0, 1, 5]), torch.tensor([0]))
    two = (torch.zeros(4, 2), torch.arange(3), torch.tensor([0]))
    with pytest.raises(ValueError, match="rows: 9 is out of range for 4 grads rows"):
        segment_sum_rows(*two, rows=torch.tensor([0, 9, 1]))
    with pytest.raises(ValueError, match=r"rows must be \(3,\)"):
        segment_sum_rows(*two, rows=torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="scale must be float32"):
        segment_sum_rows(*two, rows=torch.tensor([0, 1, 2]), scale=torch.ones(3).double())
    with pytest.raises(ValueError, match="order must have one entry per grads row"):
        segment_sum_rows(*two, scale=torch.ones(3))
    with pytest.raises(ValueError, match="skip_single: only for unscaled sums"):
        segment_sum_rows(*two, rows=torch.tensor([0, 1, 2]), skip_single=True)
    with pytest.raises(TypeError, match="starts must be int64"):
        segment_single_rows(torch.arange(3), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="starts: must begin at 0"):
        segment_single_rows(torch.arange(3), torch.tensor([1]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "extra"), [(130, 7), (128, 0), (128, 12), (64, 4), (256, 0)])
def test_cuda_equals_cpu_bit_for_bit(dtype, dim, extra):
    """Every CUDA path: 16-byte moves (float32, dim and width multiples of 4; 4 rows per warp
    up to dim 128, tails of rows and keys included) and scalar moves."""
    gen = torch.Generator().manual_seed(1)
    values, slots, tables, inverse = tables_case(gen, 5, dim, 2001, 50_001, dtype, extra)
    on_gpu = ([v.cuda() for v in values], slots.cuda(), tables.cuda())
    cpu = gather_table_rows(values, slots, tables, inverse, dim)
    gpu = gather_table_rows(*on_gpu, inverse.cuda(), dim)
    assert torch.equal(gpu.cpu(), cpu)
    one_each = gather_table_rows(*on_gpu, None, dim)
    assert torch.equal(one_each.cpu(), gather_table_rows(values, slots, tables, None, dim))
    # hot segments: one key with 20,000 of 60,000 rows and three of 2,000 beside it (folded by
    # one block of the finish pass, one after the other), many small ones, empty ones
    grads = torch.randn(60_000, dim, generator=gen)
    order = torch.randperm(60_000, generator=gen)
    hot = [0, 20_000, 20_000, 20_001, 22_001, 24_001]
    starts = torch.cat([torch.tensor(hot), torch.arange(26_001, 60_000, 7)])
    cpu_sum, cpu_bad = segment_sum_rows(grads, order, starts)
    gpu_sum, gpu_bad = segment_sum_rows(grads.cuda(), order.cuda(), starts.cuda())
    assert torch.equal(gpu_sum.cpu(), cpu_sum)
    gpu_plan = segment_plan(starts.cuda(), 60_000)
    assert unpack_plan(gpu_plan, starts.numel(), 60_000) == unpack_plan(
        segment_plan(starts, 60_000), starts.numel(), 60_000
    )
    planned, _ = segment_sum_rows(grads.cuda(), order.cuda(), starts.cuda(), plan=gpu_plan)
    assert torch.equal(planned.cpu(), cpu_sum)
    other = segment_plan(torch.cat([starts[:1], starts[2:]]).cuda(), 60_000)
    other = torch.cat([other, other.new_zeros(gpu_plan.numel() - other.numel())])
    with pytest.raises(ValueError, match="plan: not segment_plan"):
        segment_sum_rows(grads.cuda(), order.cuda(), starts.cuda(), plan=other)
    assert not cpu_bad
    assert not gpu_bad
    # each entry a row of a smaller grads, scaled (a pooled output's gradient)
    bag_grads = torch.randn(9_001, dim, generator=gen)
    rows = torch.randint(0, 9_001, (60_000,), generator=gen)
    scale = torch.rand(60_000, generator=gen) + 0.5
    cpu_bags, _ = segment_sum_rows(bag_grads, order, starts, rows=rows, scale=scale)
    gpu_bags, _ = segment_sum_rows(
        bag_grads.cuda(), order.cuda(), starts.cuda(), plan=gpu_plan, rows=rows.cuda(),
        scale=scale.cuda(),
    )  # fmt: skip
    assert torch.equal(gpu_bags.cpu(), cpu_bags)
    only_rows, _ = segment_sum_rows(bag_grads.cuda(), order.cuda(), starts.cuda(), rows=rows.cuda())
    assert torch.equal(only_rows.cpu(), segment_sum_rows(bag_grads, order, starts, rows=rows)[0])
    with pytest.raises(ValueError, match="rows: out of range for 9001 grads rows"):
        segment_sum_rows(bag_grads.cuda(), order.cuda(), starts.cuda(), rows=rows.cuda() + 9_000)
    # keys of one entry: named, skipped by the sums (the others bit for bit), still checked
    singles = torch.tensor([0, 1, 1, 1, 2, 1, 40, 1, 0, 1, 3] * 500)
    s_grads, s_order, s_starts = singles_case(gen, singles.tolist(), dim)
    on_gpu = (s_grads.cuda(), s_order.cuda(), s_starts.cuda())
    gpu_singles = segment_single_rows(on_gpu[1], on_gpu[2])
    assert torch.equal(gpu_singles.cpu(), segment_single_rows(s_order, s_starts))
    several = (gpu_singles < 0).cpu()
    s_cpu, _ = segment_sum_rows(s_grads, s_order, s_starts, skip_single=True)
    s_plan = segment_plan(on_gpu[2], s_order.numel())
    for plan in (None, s_plan):
        s_gpu, s_bad = segment_sum_rows(*on_gpu, plan=plan, skip_single=True)
        assert torch.equal(s_gpu.cpu()[several], s_cpu[several])
        assert not s_bad
    bad = s_grads.clone()
    bad[s_order[int(s_starts[1])], 0] = float("nan")  # a one-entry key
    assert bool(segment_sum_rows(bad.cuda(), *on_gpu[1:], skip_single=True)[1])
    # a NaN in a one-chunk segment, an infinity in a hot one: both flagged
    for row in (int(order[30_000]), int(order[23_000])):
        bad = grads.clone()
        bad[row, 3] = float("nan") if row == int(order[30_000]) else float("inf")
        assert bool(segment_sum_rows(bad.cuda(), order.cuda(), starts.cuda())[1])
        assert bool(segment_sum_rows(bad, order, starts)[1])


@pytest.mark.cuda
@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(
        st.one_of(st.integers(0, 70), st.sampled_from([1, 1, 31, 32, 33, 64, 65, 1025, 1100])),
        min_size=1,
        max_size=150,
    ),
    dim=st.sampled_from([4, 64, 128]),
    mode=st.sampled_from(["plain", "skip_single", "scaled"]),
    seed=st.integers(0, 2**31),
)
def test_window_sums_equal_the_cpu_bit_for_bit(lengths, dim, mode, seed):
    """CUDA rows of at most 128 floats are summed by windows of ``order`` (no plan): segments
    of every length starting anywhere in a window (chunks crossing windows, several chunks
    finished from partial rows, hot ones by a block, empty ones zero), scaled or not, give
    the CPU's floats; a NaN anywhere is flagged."""
    gen = torch.Generator().manual_seed(seed)
    grads, order, starts = singles_case(gen, lengths, dim)
    kw: dict[str, object] = {}
    if mode == "skip_single":
        kw["skip_single"] = True
    elif mode == "scaled":
        bags = max(order.numel() // 3, 1)
        grads = torch.randn(bags, dim, generator=gen)
        kw["rows"] = torch.randint(0, bags, (order.numel(),), generator=gen)
        kw["scale"] = torch.rand(order.numel(), generator=gen) + 0.5
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    cpu, cpu_bad = segment_sum_rows(grads, order, starts, **kw)
    gpu, gpu_bad = segment_sum_rows(grads.cuda(), order.cuda(), starts.cuda(), **on_gpu)
    kept = (
        torch.tensor(lengths) != 1
        if mode == "skip_single"
        else torch.ones(len(lengths), dtype=torch.bool)
    )
    assert torch.equal(gpu.cpu()[kept], cpu[kept])
    assert not bool(gpu_bad)
    assert not bool(cpu_bad)
    if order.numel():
        bad = grads.clone()
        bad[int(torch.randint(0, grads.shape[0], (1,), generator=gen)), dim - 1] = float("nan")
        flagged = segment_sum_rows(bad.cuda(), order.cuda(), starts.cuda(), **on_gpu)[1]
        assert bool(flagged) == bool(segment_sum_rows(bad, order, starts, **kw)[1])
