"""The float64 references and the fused CPU update of SGD, Adagrad and row-wise Adagrad agree
with FBGEMM's CPU TBE (the static tables TorchRec users compare against) over 10 steps, rows
first touched at different steps, with and without gradient clipping (per occurrence, before
duplicates are summed) and a seeded accumulator. FBGEMM's CPU TBE has no Adam ("Optimizer adam
is not supported in CPU mode"), so Adam is compared with torch's AdamW instead."""

from __future__ import annotations

import warnings

import pytest
import torch
from demb_optim import (
    SGD,
    Adagrad,
    OptimizerSpec,
    RowWiseAdagrad,
    apply_update,
    clip_gradient,
    reduce_gradients,
    reference_update,
)
from hypothesis import given, settings
from hypothesis import strategies as st

training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs")

ROWS = 40
STEPS = 10
BAGS = 6


def bag_gradients(gen: torch.Generator, dim: int) -> torch.Tensor:
    """``(BAGS, dim)`` output gradients of one step: each column one sign in every bag (random
    per column), magnitudes in [0.001, ~1]. Clipped occurrences of opposite signs would cancel
    to a rounding residue of about 1e-9 in float32 and 1e-17 in float64, which Adagrad with a
    zero accumulator turns into updates of about ``lr * r / (r + eps)``: 0.2 apart."""
    signs = torch.randint(0, 2, (dim,), generator=gen) * 2 - 1
    return (torch.randn(BAGS, dim, generator=gen).abs() * 0.2 + 1e-3) * signs


def fbgemm_table(spec: OptimizerSpec, dim: int, weight: torch.Tensor):
    kinds = {
        SGD: configs.EmbOptimType.EXACT_SGD,
        Adagrad: configs.EmbOptimType.EXACT_ADAGRAD,
        RowWiseAdagrad: configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    }
    extra = {"eps": spec.eps} if hasattr(spec, "eps") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbe = training.SplitTableBatchedEmbeddingBagsCodegen(
            [(ROWS, dim, training.EmbeddingLocation.HOST, training.ComputeDevice.CPU)],
            optimizer=kinds[type(spec)],
            learning_rate=spec.learning_rate,
            gradient_clipping=spec.gradient_clipping,
            max_gradient=spec.max_gradient,
            **extra,
        )
    tbe.split_embedding_weights()[0].copy_(weight)
    seed = getattr(spec, "initial_accumulator_value", 0.0)
    for state in tbe.split_optimizer_states()[0] if tbe.split_optimizer_states() else []:
        state.fill_(seed)
    return tbe


def fbgemm_state(spec: OptimizerSpec, tbe) -> torch.Tensor:
    states = tbe.split_optimizer_states()
    if isinstance(spec, SGD):
        return torch.zeros(ROWS, 0, dtype=torch.float64)
    acc = states[0][0].reshape(ROWS, -1).to(torch.float64)
    if isinstance(spec, RowWiseAdagrad):
        return torch.cat([acc, torch.zeros(ROWS, 3, dtype=torch.float64)], dim=1)
    return acc


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from([SGD, Adagrad, RowWiseAdagrad]),
    dim=st.sampled_from([4, 8, 16, 36]),  # FBGEMM needs multiples of 4
    lr=st.floats(0.01, 0.5),
    clip=st.booleans(),
    seed_acc=st.sampled_from([0.0, 0.1, 1.0]),
    seed=st.integers(0, 2**31),
)
def test_reference_equals_fbgemm_cpu_tbe(kind, dim, lr, clip, seed_acc, seed):
    args = {"learning_rate": lr, "gradient_clipping": clip, "max_gradient": 0.05}
    if kind is not SGD:
        args["initial_accumulator_value"] = seed_acc
    spec = kind(**args)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(ROWS, dim, generator=gen)
    tbe = fbgemm_table(spec, dim, weight)
    ref_w = weight.to(torch.float64)
    ref_s = spec.initial_state(dim, torch.float32).to(torch.float64).repeat(ROWS, 1)
    # the fused CPU update on a value buffer [embedding | state]
    fused = torch.cat([weight, spec.initial_state(dim).repeat(ROWS, 1)], dim=1).contiguous()
    for step in range(1, STEPS + 1):
        # rows [0, 4 * step) may appear: later rows are first touched at later steps
        n = int(torch.randint(1, 12, (1,), generator=gen))
        indices = torch.randint(0, 4 * step, (n,), generator=gen)
        cuts = torch.sort(torch.randint(0, n + 1, (BAGS - 1,), generator=gen)).values
        offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])
        grad_out = bag_gradients(gen, dim)
        tbe(indices, offsets).backward(grad_out)
        bag_of = torch.repeat_interleave(torch.arange(BAGS), offsets.diff())
        rows, inverse = torch.unique(indices, return_inverse=True)
        grad = torch.zeros(rows.numel(), dim, dtype=torch.float64)
        per_occurrence = clip_gradient(spec, grad_out[bag_of].to(torch.float64))
        grad.index_add_(0, inverse, per_occurrence)
        # the fused path: float32 occurrences clipped and summed by reduce_gradients
        reduced = reduce_gradients(spec, grad_out[bag_of], inverse, rows.numel())
        apply_update(spec, [fused], [rows], [reduced], [dim], [step])
        new_w, new_s = reference_update(spec, ref_w[rows], ref_s[rows], grad, step)
        ref_w[rows] = new_w
        ref_s[rows] = new_s
    got = tbe.split_embedding_weights()[0].to(torch.float64)
    torch.testing.assert_close(got, ref_w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fbgemm_state(spec, tbe), ref_s, rtol=1e-5, atol=1e-6)
    # and the fused update agrees with FBGEMM directly (weights and state)
    torch.testing.assert_close(fused[:, :dim].to(torch.float64), got, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        fused[:, dim:].to(torch.float64), fbgemm_state(spec, tbe), rtol=1e-5, atol=1e-6
    )
