"""pool_table_rows (``demb::pool_table_rows``): each bag's rows summed from the tables by slot
in index order, equal bit for bit to a float32 reference that adds the same rows in the same
order (and close to ``torch.nn.functional.embedding_bag``); bad arguments are named and, on the
CPU, bad values too; on CUDA (marker ``cuda``) the kernel equals the CPU bit for bit, and
unchecked bad values add nothing."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
from demb_kernels.pooling import pool_cpu_build, pool_table_rows
from hypothesis import example, given, settings
from hypothesis import strategies as st


def pooled_reference(values, slots, offsets, feature_tables, batch_size, dim, mean, weights):
    """The rule in float32 tensor ops, one row at a time in index order."""
    features = feature_tables.numel()
    out = torch.zeros(batch_size, features * dim)
    for f in range(features):
        table = values[int(feature_tables[f])]
        for b in range(batch_size):
            q = f * batch_size + b
            begin, end = int(offsets[q]), int(offsets[q + 1])
            acc = torch.zeros(dim)
            for i in range(begin, end):
                s = int(slots[i])
                if s < 0:
                    continue
                row = table[s, :dim]
                acc = acc + (row * weights[i] if weights is not None else row)
            if mean and end > begin:
                acc = acc / torch.tensor(float(end - begin))
            out[b, f * dim : (f + 1) * dim] = acc
    return out


def pooled_case(gen, tables, features, batch_size, dim, extra, max_bag, missing=0.2):
    """Value buffers, slots (some -1), offsets, feature tables and weights of a random batch."""
    rows = [int(torch.randint(1, 40, (1,), generator=gen)) for _ in range(tables)]
    values = [torch.randn(r, dim + extra, generator=gen) for r in rows]
    feature_tables = torch.randint(0, tables, (features,), generator=gen)
    lengths = torch.randint(0, max_bag + 1, (features * batch_size,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(offsets[-1])
    table_of = feature_tables.repeat_interleave(
        offsets[::batch_size].diff() if n else torch.zeros(features, dtype=torch.int64)
    )
    limit = torch.tensor(rows)[table_of] if n else torch.zeros(0, dtype=torch.int64)
    slots = (torch.rand(n, generator=gen) * limit).long()
    slots[torch.rand(n, generator=gen) < missing] = -1
    weights = torch.randn(n, generator=gen)
    return values, slots, offsets, feature_tables, weights


@settings(max_examples=40, deadline=None)
@given(
    tables=st.integers(1, 3),
    features=st.integers(1, 4),
    batch_size=st.integers(1, 5),
    dim=st.one_of(st.integers(1, 20), st.integers(31, 70)),  # the CPU's 32-column blocks
    extra=st.sampled_from([0, 3]),
    max_bag=st.sampled_from([0, 3, 40]),
    mean=st.booleans(),
    weighted=st.booleans(),
    seed=st.integers(0, 2**31),
)
@example(tables=2, features=3, batch_size=4, dim=32, extra=0, max_bag=40, mean=False,
         weighted=False, seed=1)  # fmt: skip
@example(tables=3, features=4, batch_size=5, dim=70, extra=3, max_bag=40, mean=True,
         weighted=True, seed=2)  # fmt: skip
def test_cpu_pool_equals_the_reference(
    tables, features, batch_size, dim, extra, max_bag, mean, weighted, seed
):
    gen = torch.Generator().manual_seed(seed)
    values, slots, offsets, ftab, weights = pooled_case(
        gen, tables, features, batch_size, dim, extra, max_bag
    )
    w = weights if weighted else None
    out = pool_table_rows(values, slots, offsets, ftab, batch_size, dim, mean=mean, weights=w)
    want = pooled_reference(values, slots, offsets, ftab, batch_size, dim, mean, w)
    assert out.shape == (batch_size, features * dim)
    assert torch.equal(out, want)


# Cases of every column-block shape: whole 32-column blocks, a remainder, several blocks.
PORTABLE_CASES = [  # (tables, features, batch_size, dim, extra, max_bag, mean, weighted, seed)
    (2, 3, 4, 32, 0, 40, False, False, 1),
    (3, 4, 5, 70, 3, 40, True, True, 2),
    (1, 2, 3, 7, 0, 3, False, True, 3),
    (2, 2, 6, 64, 3, 12, True, False, 4),
]


def check_portable_cases() -> None:
    """Each of :data:`PORTABLE_CASES` pooled equal to the reference, bit for bit."""
    for tables, features, b, dim, extra, max_bag, mean, weighted, seed in PORTABLE_CASES:
        gen = torch.Generator().manual_seed(seed)
        values, slots, offsets, ftab, weights = pooled_case(
            gen, tables, features, b, dim, extra, max_bag
        )
        w = weights if weighted else None
        out = pool_table_rows(values, slots, offsets, ftab, b, dim, mean=mean, weights=w)
        assert torch.equal(out, pooled_reference(values, slots, offsets, ftab, b, dim, mean, w))


def test_the_cpu_kernel_runs_the_build_for_torchs_cpu_capability():
    """The AVX2 build where PyTorch's CPU capability is AVX2 or AVX512 on x86-64 Linux, else
    the portable one."""
    capability = torch.backends.cpu.get_cpu_capability()
    x86_linux = sys.platform.startswith("linux") and platform.machine() == "x86_64"
    want = "avx2" if x86_linux and capability in ("AVX2", "AVX512") else "portable"
    assert pool_cpu_build() == want


_PORTABLE_SCRIPT = """
import importlib.util, sys
import torch
from demb_kernels.pooling import pool_cpu_build
spec = importlib.util.spec_from_file_location("pool_rows_tests", sys.argv[1])
tests = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tests)
print(torch.backends.cpu.get_cpu_capability(), pool_cpu_build())
tests.check_portable_cases()
"""


def test_the_portable_build_equals_the_reference():
    """In a process where ``ATEN_CPU_CAPABILITY=default`` holds PyTorch to its baseline, the
    kernel runs its portable build (on a CPU with AVX2 too) and pools every case as the
    reference does; in this process, whichever build it runs, the same."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    run = subprocess.run(
        [sys.executable, "-c", _PORTABLE_SCRIPT, __file__],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[:2] == ["DEFAULT", "portable"]
    check_portable_cases()


def test_pool_is_close_to_embedding_bag():
    """Against torch's embedding_bag, missing keys as zero-weight rows (a MEAN counts them)."""
    gen = torch.Generator().manual_seed(5)
    values, slots, offsets, ftab, weights = pooled_case(gen, 2, 3, 4, 8, 2, 6)
    b = 4
    for mean in (False, True):
        for w in (None, weights):
            out = pool_table_rows(values, slots, offsets, ftab, b, 8, mean=mean, weights=w)
            keep = (slots >= 0).float()
            per = keep if w is None else w * keep
            parts = []
            for f in range(3):
                lo, hi = int(offsets[f * b]), int(offsets[(f + 1) * b])
                bags = offsets[f * b : (f + 1) * b + 1] - lo
                pooled = torch.nn.functional.embedding_bag(
                    slots[lo:hi].clamp_min(0),
                    values[int(ftab[f])][:, :8],
                    bags,
                    mode="sum",
                    per_sample_weights=per[lo:hi],
                    include_last_offset=True,
                )
                if mean:
                    pooled = pooled / bags.diff().clamp_min(1)[:, None]
                parts.append(pooled)
            torch.testing.assert_close(out, torch.cat(parts, dim=1))


def test_pool_names_bad_arguments_and_values():
    gen = torch.Generator().manual_seed(2)
    values, slots, offsets, ftab, weights = pooled_case(gen, 2, 2, 3, 4, 0, 4, missing=0.0)
    args = (values, slots, offsets, ftab, 3, 4)
    with pytest.raises(TypeError, match="float32 rows only"):
        pool_table_rows([v.half() for v in values], *args[1:])
    with pytest.raises(TypeError, match="values must be float32, float16 or bfloat16"):
        pool_table_rows([v.double() for v in values], *args[1:])
    with pytest.raises(TypeError, match="slots must be int64"):
        pool_table_rows(values, slots.int(), *args[2:])
    with pytest.raises(ValueError, match="offsets: 7 entries for 2 features"):
        pool_table_rows(values, slots, offsets, ftab, 4, 4)
    with pytest.raises(ValueError, match="weights must be"):
        pool_table_rows(*args, weights=weights[:-1])
    with pytest.raises(TypeError, match="weights must be float32"):
        pool_table_rows(*args, weights=weights.double())
    with pytest.raises(ValueError, match="width >= 5"):
        pool_table_rows(values, slots, offsets, ftab, 3, 5)
    with pytest.raises(ValueError, match="batch_size=0"):
        pool_table_rows(values, slots, offsets, ftab, 0, 4)
    bad_tables = ftab.clone()
    bad_tables[0] = 2
    with pytest.raises(ValueError, match="feature_tables: 2 is out of range for 2 tables"):
        pool_table_rows(values, slots, offsets, bad_tables, 3, 4)
    bad = slots.clone()
    bad[-1] = values[int(ftab[-1])].shape[0]
    with pytest.raises(ValueError, match=rf"slots: .* is out of range for table {int(ftab[-1])}"):
        pool_table_rows(values, bad, offsets, ftab, 3, 4)
    down = offsets.clone()
    down[1], down[2] = down[2] + 1, down[2]
    with pytest.raises(ValueError, match="offsets: decrease at"):
        pool_table_rows(values, slots, down, ftab, 3, 4)
    short = offsets.clone()
    short[-1] -= 1
    with pytest.raises(ValueError, match="offsets: must start at 0 and end at"):
        pool_table_rows(values, slots, short, ftab, 3, 4)


def test_empty_batch_pools_zeros():
    values = [torch.randn(5, 4)]
    empty = torch.zeros(0, dtype=torch.int64)
    out = pool_table_rows(
        values, empty, torch.zeros(7, dtype=torch.int64), torch.tensor([0, 0]), 3, 4
    )
    assert torch.equal(out, torch.zeros(3, 8))


def pool_on_cuda(values, slots, offsets, feature_tables, batch_size, dim, mean, weights=None):
    """pool_table_rows of these arguments, each tensor copied to CUDA."""
    return pool_table_rows(
        [v.cuda() for v in values],
        slots.cuda(),
        offsets.cuda(),
        feature_tables.cuda(),
        batch_size,
        dim,
        mean=mean,
        weights=None if weights is None else weights.cuda(),
    )


@pytest.mark.cuda
@pytest.mark.parametrize(("dim", "extra"), [(128, 0), (64, 4), (256, 0), (33, 2), (130, 2)])
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("max_bag", [45, 2])
def test_cuda_pool_equals_cpu(dim, extra, mean, weighted, max_bag):
    """Every CUDA path (float4 columns, scalar columns, several column blocks), bags longer
    than a warp, many short and empty bags (a warp's walk through more than 32 bags), missing
    keys: equal to the CPU bit for bit."""
    gen = torch.Generator().manual_seed(dim + 7 * extra + max_bag)
    values, slots, offsets, ftab, weights = pooled_case(gen, 3, 4, 300, dim, extra, max_bag)
    w = weights if weighted else None
    cpu = pool_table_rows(values, slots, offsets, ftab, 300, dim, mean=mean, weights=w)
    gpu = pool_on_cuda(values, slots, offsets, ftab, 300, dim, mean=mean, weights=w)
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.cuda
def test_cuda_reads_unchecked_bad_values_as_missing():
    """A slot out of range and a feature's table out of range add nothing on CUDA (the CPU
    raises for them); a MEAN still counts such an index in its bag's length."""
    gen = torch.Generator().manual_seed(11)
    values, slots, offsets, ftab, _ = pooled_case(gen, 2, 3, 50, 16, 0, 6, missing=0.0)
    bad = slots.clone()
    bad[::5] = 10_000
    bad_tables = ftab.clone()
    bad_tables[1] = 7
    want_slots = bad.clone()
    want_slots[::5] = -1
    lo, hi = int(offsets[50]), int(offsets[100])
    want_slots[lo:hi] = -1  # feature 1 reads nothing
    for mean in (False, True):
        cpu = pool_table_rows(values, want_slots, offsets, ftab, 50, 16, mean=mean)
        gpu = pool_on_cuda(values, bad, offsets, bad_tables, 50, 16, mean=mean)
        assert torch.equal(gpu.cpu(), cpu)
