"""The table module against FBGEMM's CPU TBE (what TorchRec's fused static tables run), same
initial rows copied in: outputs and updated rows agree after 10 steps for SGD, Adagrad and
row-wise Adagrad, SUM and MEAN over mixed dims, and NONE (sequence). FBGEMM's CPU TBE has no
Adam ("Optimizer adam is not supported in CPU mode"): Adam's twin is TorchRec's unsharded
collection with sparse gradients and torch.optim.SparseAdam (and the float64 reference tests).
Two features sharing one table are compared for SGD only: FBGEMM's CPU TBE fails on them with
row-wise Adagrad and NONE pooling ("num of rows processed by adagrad: 0 does not match c_block
size", "Index 11 is out of bounds") and with exact Adagrad updates a key seen by both features
differently from one update with the key's summed gradient (what demb and FBGEMM's GPU kernels
do); the float64 reference tests cover shared tables for every optimizer."""

from __future__ import annotations

import warnings

import pytest
import torch
from demb_optim import SGD, Adagrad, OptimizerSpec, RowWiseAdagrad
from demb_torchrec import DynamicEmbeddingTables, DynamicEmbPoolingMode, DynamicEmbTableOptions
from hypothesis import given, settings
from hypothesis import strategies as st

training = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_training")
common = pytest.importorskip("fbgemm_gpu.split_table_batched_embeddings_ops_common")
configs = pytest.importorskip("fbgemm_gpu.split_embedding_configs")

ROWS = 50
BATCH = 4
KINDS = {
    SGD: configs.EmbOptimType.EXACT_SGD,
    Adagrad: configs.EmbOptimType.EXACT_ADAGRAD,
    RowWiseAdagrad: configs.EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}
POOLING = {
    DynamicEmbPoolingMode.SUM: common.PoolingMode.SUM,
    DynamicEmbPoolingMode.MEAN: common.PoolingMode.MEAN,
    DynamicEmbPoolingMode.NONE: common.PoolingMode.NONE,
}


def fbgemm_tbe(spec: OptimizerSpec, dims, ftm, mode):
    extra = {"eps": spec.eps} if hasattr(spec, "eps") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tbe = training.SplitTableBatchedEmbeddingBagsCodegen(
            [(ROWS, d, training.EmbeddingLocation.HOST, training.ComputeDevice.CPU) for d in dims],
            feature_table_map=ftm,
            optimizer=KINDS[type(spec)],
            learning_rate=spec.learning_rate,
            pooling_mode=POOLING[mode],
            **extra,
        )
    seed = getattr(spec, "initial_accumulator_value", 0.0)
    for states in tbe.split_optimizer_states():
        for state in states:
            state.fill_(seed)
    return tbe


def copy_into_module(module, tbe, spec):
    for t, weight in enumerate(tbe.split_embedding_weights()):
        keys = torch.arange(ROWS)
        ids = torch.full((ROWS,), t)
        scores = torch.zeros(module.tables.index.scores.shape[0], ROWS, dtype=torch.int64)
        state = spec.initial_state(module.dims[t]).repeat(ROWS, 1)
        rows = torch.cat([weight.detach().clone(), state], dim=1)
        module.tables.insert_or_assign(
            keys, ids, scores, [rows if u == t else None for u in range(module.num_tables)]
        )


@settings(max_examples=10, deadline=None)
@given(
    kind=st.sampled_from(list(KINDS)),
    mode=st.sampled_from(list(DynamicEmbPoolingMode)),
    lr=st.floats(0.01, 0.3),
    acc=st.sampled_from([0.0, 0.1]),
    seed=st.integers(0, 2**31),
)
def test_module_agrees_with_fbgemm_cpu_tbe_over_10_steps(kind, mode, lr, acc, seed):
    dims, ftm = ([8, 8], [0, 1]) if mode is DynamicEmbPoolingMode.NONE else ([8, 4, 12], [0, 1, 2])
    if kind is SGD and mode is not DynamicEmbPoolingMode.NONE:
        ftm = [0, 1, 2, 0]
    spec = (
        kind(learning_rate=lr)
        if kind is SGD
        else kind(learning_rate=lr, initial_accumulator_value=acc)
    )
    tbe = fbgemm_tbe(spec, dims, ftm, mode)
    options = [DynamicEmbTableOptions(dim=d, max_capacity=256, bucket_capacity=128) for d in dims]
    module = DynamicEmbeddingTables(
        options, feature_table_map=ftm, pooling_mode=mode, device="cpu", optimizer=spec
    )
    copy_into_module(module, tbe, spec)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(10):
        lengths = torch.randint(0, 5, (len(ftm) * BATCH,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        indices = torch.randint(0, ROWS, (int(offsets[-1]),), generator=gen)
        want = tbe(indices, offsets)
        got = module(indices, offsets)
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-5)
        grad = torch.randn(want.shape, generator=gen)
        want.backward(grad)
        got.backward(grad)
    for t, weight in enumerate(tbe.split_embedding_weights()):
        slots = module.tables.find(torch.arange(ROWS), torch.full((ROWS,), t))
        rows = module.tables.read(t, slots)[:, : dims[t]]
        torch.testing.assert_close(rows, weight.detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", list(DynamicEmbPoolingMode))
def test_module_agrees_with_torchrec_tables_under_sparse_adam_over_10_steps(mode):
    """Adam's twin (FBGEMM's CPU TBE has none): TorchRec's unsharded EmbeddingBagCollection
    (SUM, MEAN; mixed dims) or EmbeddingCollection (NONE), its modules set to sparse gradients,
    trained by ``torch.optim.SparseAdam``, the same sparse Adam (only the batch's rows move; bias
    correction by the table's step count), from the same rows, fed the same batches."""
    from demb_optim import Adam
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        KeyedJaggedTensor,
        PoolingType,
    )

    none = mode is DynamicEmbPoolingMode.NONE
    dims = [8, 8] if none else [8, 4, 12]
    names = [f"f{t}" for t in range(len(dims))]
    if none:
        static: torch.nn.Module = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=f"t{t}", embedding_dim=d, num_embeddings=ROWS, feature_names=[n]
                )
                for t, (d, n) in enumerate(zip(dims, names, strict=True))
            ]
        )
    else:
        pooling = PoolingType.SUM if mode is DynamicEmbPoolingMode.SUM else PoolingType.MEAN
        static = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=f"t{t}", embedding_dim=d, num_embeddings=ROWS, feature_names=[n],
                    pooling=pooling,
                )
                for t, (d, n) in enumerate(zip(dims, names, strict=True))
            ]
        )  # fmt: skip
    for m in static.modules():
        if isinstance(m, torch.nn.Embedding | torch.nn.EmbeddingBag):
            m.sparse = True
    weights = list(static.parameters())
    optimizer = torch.optim.SparseAdam(weights, lr=0.05, eps=1e-8)
    spec = Adam(learning_rate=0.05)
    options = [DynamicEmbTableOptions(dim=d, max_capacity=256, bucket_capacity=128) for d in dims]
    module = DynamicEmbeddingTables(options, pooling_mode=mode, device="cpu", optimizer=spec)

    class Weights:  # copy_into_module reads split_embedding_weights()
        @staticmethod
        def split_embedding_weights() -> list[torch.Tensor]:
            return weights

    copy_into_module(module, Weights, spec)
    gen = torch.Generator().manual_seed(11)
    for _ in range(10):
        lengths = torch.randint(0, 5, (len(dims) * BATCH,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
        indices = torch.randint(0, ROWS, (int(offsets[-1]),), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=names, values=indices, lengths=lengths)
        out = static(kjt)
        want = torch.cat([out[n].values() for n in names]) if none else out.values()
        got = module(indices, offsets)
        # Adam's step is lr * m / sqrt(v): the rounding of a small gradient is amplified
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-5, atol=1e-4)
        grad = torch.randn(want.shape, generator=gen)
        want.backward(grad)
        got.backward(grad)
        optimizer.step()
        optimizer.zero_grad()
    for t, weight in enumerate(weights):
        slots = module.tables.find(torch.arange(ROWS), torch.full((ROWS,), t))
        rows = module.tables.read(t, slots)[:, : dims[t]]
        torch.testing.assert_close(rows, weight.detach(), rtol=1e-5, atol=1e-4)
