"""The table module against the pure-PyTorch reference (dict of float64 rows, embedding_bag,
autograd, float64 optimizer references): SUM / MEAN / NONE, mixed dims, weighted SUM, shared
tables, duplicate keys in a bag, keys first seen at later steps, every optimizer (with and
without gradient clipping), several steps; on the CPU and (marker ``cuda``) on a GPU."""

from __future__ import annotations

import pytest
import torch
from demb_optim import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad
from demb_torchrec import (
    DynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
)
from demb_torchrec.reference import ReferenceTables
from hypothesis import given, settings
from hypothesis import strategies as st

SPECS = [
    SGD(learning_rate=0.1),
    Adam(learning_rate=0.05, weight_decay=0.01),
    Adagrad(learning_rate=0.1, initial_accumulator_value=0.1),
    RowWiseAdagrad(learning_rate=0.1, initial_accumulator_value=0.2),
    FTRL(learning_rate=0.1, initial_accumulator_value=0.1, l1_reg=0.001),
    SGD(learning_rate=0.1, gradient_clipping=True, max_gradient=0.05),
    # A seeded accumulator: with 0, a key whose clipped gradients cancel exactly in float64
    # but leave a float32 residue of ~1e-9 moves by lr * g / (|g| + eps), about lr.
    Adagrad(
        learning_rate=0.1, initial_accumulator_value=0.1, gradient_clipping=True, max_gradient=0.05
    ),
    FTRL(
        learning_rate=0.1, initial_accumulator_value=0.1, gradient_clipping=True, max_gradient=0.05
    ),
]
INITS = [
    DynamicEmbInitializerArgs(),
    DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.1),
    DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.25),
    DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.TRUNCATED_NORMAL, std_dev=0.5),
]


def build(dims, ftm, mode, spec, init, device, dtype=torch.float32):
    options = [
        DynamicEmbTableOptions(
            dim=d,
            max_capacity=1024,
            bucket_capacity=128,
            embedding_dtype=dtype,
            initializer_args=init,
        )
        for d in dims
    ]
    module = DynamicEmbeddingTables(
        options, feature_table_map=ftm, pooling_mode=mode, device=device, optimizer=spec, seed=7
    )
    ref = ReferenceTables(dims, ftm, mode, spec, module.init_args, module.seeds)
    return module, ref


def random_batch(gen, features, batch, key_range, max_bag):
    lengths = torch.randint(0, max_bag + 1, (features * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    indices = torch.randint(0, key_range, (int(offsets[-1]),), generator=gen)
    return indices, offsets


def module_rows(module, t, keys):
    ids = torch.full((len(keys),), t, dtype=torch.int64, device=module.device)
    slots = module.tables.find(torch.tensor(keys, device=module.device), ids)
    assert bool((slots >= 0).all()), "a key the reference holds is missing from the table"
    return module.tables.read(t, slots).cpu().to(torch.float64)


def check_rows(module, ref, tol):
    for t, rows in enumerate(ref.rows):
        if not rows:
            continue
        keys = sorted(rows)
        got = module_rows(module, t, keys)
        want = torch.stack([torch.cat(rows[k]) for k in keys])
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def run_steps(module, ref, gen, steps, weighted, key_range, max_bag, tol):
    features = len(module.feature_table_map)
    device = module.device
    for _ in range(steps):
        indices, offsets = random_batch(gen, features, 3, key_range, max_bag)
        weights = torch.rand(indices.numel(), generator=gen) if weighted else None
        out = module(
            indices.to(device),
            offsets.to(device),
            pooling_weights=None if weights is None else weights.to(device),
        )
        grad_out = torch.randn(out.shape, generator=gen)
        want = ref.forward(indices, offsets, weights, grad_out)
        torch.testing.assert_close(out.detach().cpu().to(torch.float64), want, rtol=tol, atol=tol)
        out.backward(grad_out.to(device))
        # keys first seen later: the key range widens every step
        key_range += 5
    check_rows(module, ref, tol)


@settings(max_examples=30, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    init=st.sampled_from(INITS),
    mode=st.sampled_from(list(DynamicEmbPoolingMode)),
    dims=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    shared=st.booleans(),
    weighted=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_module_matches_the_reference_on_cpu(spec, init, mode, dims, shared, weighted, seed):
    if mode is DynamicEmbPoolingMode.NONE:
        dims = [dims[0]] * len(dims)
    ftm = list(range(len(dims))) + ([0] if shared else [])
    weighted = weighted and mode is DynamicEmbPoolingMode.SUM
    module, ref = build(dims, ftm, mode, spec, init, "cpu")
    gen = torch.Generator().manual_seed(seed)
    run_steps(module, ref, gen, steps=4, weighted=weighted, key_range=6, max_bag=4, tol=1e-4)


_POOLED = [DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN]


@pytest.mark.parametrize("mode", _POOLED)
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-clip{s.gradient_clipping}")
def test_pooled_tables_of_one_dim_match_the_reference_on_cpu(mode, spec):
    """Pooled tables of one dim (their backward sums each key's bag gradients directly), a
    feature sharing a table, weights with SUM."""
    module, ref = build([6, 6, 6], [0, 1, 2, 0], mode, spec, INITS[0], "cpu")
    gen = torch.Generator().manual_seed(5)
    weighted = mode is DynamicEmbPoolingMode.SUM
    run_steps(module, ref, gen, steps=4, weighted=weighted, key_range=12, max_bag=5, tol=1e-4)


_CUDA_CASES = [(DynamicEmbPoolingMode.NONE, [8, 8])] + [
    (m, d) for m in _POOLED for d in ([8, 8], [8, 3])
]


@pytest.mark.cuda
@pytest.mark.parametrize(("mode", "dims"), _CUDA_CASES, ids=lambda x: str(x))
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.kind}-clip{s.gradient_clipping}")
def test_module_matches_the_reference_on_cuda(mode, dims, spec):
    module, ref = build(dims, [0, 1, 0], mode, spec, INITS[0], "cuda")
    gen = torch.Generator().manual_seed(3)
    weighted = mode is DynamicEmbPoolingMode.SUM
    run_steps(module, ref, gen, steps=5, weighted=weighted, key_range=40, max_bag=6, tol=1e-4)


def test_duplicate_keys_in_one_bag_sum_their_gradients():
    module, _ = build([4], [0], DynamicEmbPoolingMode.SUM, SGD(learning_rate=0.5), INITS[2], "cpu")
    indices = torch.tensor([5, 5, 5, 9])
    offsets = torch.tensor([0, 3, 4])
    out = module(indices, offsets)
    torch.testing.assert_close(out, torch.tensor([[0.75] * 4, [0.25] * 4]))
    out.backward(torch.ones_like(out))
    got = module_rows(module, 0, [5, 9])
    torch.testing.assert_close(
        got, torch.tensor([[0.25 - 1.5] * 4, [0.25 - 0.5] * 4], dtype=torch.float64)
    )
