"""The pooled eval forward (SUM / MEAN without dedup, bags pooled straight from the tables, on
the CPU and on CUDA) against bags summed in Python
from the tables' exported rows, for mixed dims, features sharing a table, missing keys (zero
rows that count in a MEAN), empty bags and SUM weights; it inserts nothing and touches no score;
a non-zero eval initializer or a low-precision table takes the general path, which agrees."""

from __future__ import annotations

import pytest
import torch
from demb_torchrec import (
    DynamicEmbeddingTables,
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbPoolingMode,
    DynamicEmbTableOptions,
)
from demb_torchrec._direct import EvalPooledFromTables

SUM, MEAN = DynamicEmbPoolingMode.SUM, DynamicEmbPoolingMode.MEAN
NORMAL = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=1.0)
FTM = [0, 1, 0]  # features 0 and 2 share table 0
DIMS = (4, 8)
BATCH = 5


def _module(mode, device, dtype=torch.float32, eval_init=None):
    extra = {} if eval_init is None else {"eval_initializer_args": eval_init}
    opts = [
        DynamicEmbTableOptions(
            dim=d, max_capacity=256, initializer_args=NORMAL, embedding_dtype=dtype, **extra
        )
        for d in DIMS
    ]
    return DynamicEmbeddingTables(
        opts, feature_table_map=FTM, pooling_mode=mode, device=device, optimizer="adam"
    )


def _batch(gen, device):
    lengths = torch.randint(0, 4, (len(FTM) * BATCH,), generator=gen)
    lengths[1] = 0  # an empty bag
    keys = torch.randint(0, 40, (int(lengths.sum()),), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return keys.to(device), offsets.to(device)


def _reference(module, keys, offsets, mode, weights):
    rows = []
    for t in range(len(DIMS)):
        ex = module.tables.export(t)
        rows.append(
            dict(zip(ex.keys.tolist(), ex.values[:, : DIMS[t]].double().cpu(), strict=True))
        )
    keys, offsets = keys.cpu().tolist(), offsets.cpu().tolist()
    out = torch.zeros(BATCH, sum(DIMS[t] for t in FTM), dtype=torch.float64)
    col = 0
    for f, t in enumerate(FTM):
        for b in range(BATCH):
            lo, hi = offsets[f * BATCH + b], offsets[f * BATCH + b + 1]
            acc = torch.zeros(DIMS[t], dtype=torch.float64)
            for i in range(lo, hi):
                w = 1.0 if weights is None else float(weights[i])
                acc += w * rows[t].get(keys[i], torch.zeros(DIMS[t], dtype=torch.float64))
            if mode is MEAN and hi > lo:
                acc /= hi - lo
            out[b, col : col + DIMS[t]] = acc
        col += DIMS[t]
    return out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(("mode", "weighted"), [(SUM, False), (SUM, True), (MEAN, False)])
def test_eval_pools_straight_from_the_tables(device, mode, weighted):
    gen = torch.Generator().manual_seed(5)
    module = _module(mode, device)
    module(*_batch(gen, device))  # training: inserts some keys
    module.eval()
    assert isinstance(module._eval_path, EvalPooledFromTables)
    before = [module.tables.export(t) for t in range(len(DIMS))]
    for _ in range(3):
        keys, offsets = _batch(gen, device)
        weights = torch.rand(keys.numel(), generator=gen).to(device) if weighted else None
        got = module(keys, offsets, weights)
        want = _reference(module, keys, offsets, mode, None if weights is None else weights.cpu())
        torch.testing.assert_close(got.double().cpu(), want, rtol=1e-6, atol=1e-6)
    for t, ex in enumerate(before):  # nothing inserted, no score touched
        after = module.tables.export(t)
        assert torch.equal(after.keys, ex.keys)
        assert torch.equal(after.scores, ex.scores)


@pytest.mark.parametrize(
    ("dtype", "eval_init"),
    [
        (torch.float16, None),
        (
            torch.float32,
            DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=3.0),
        ),
    ],
)
def test_other_tables_take_the_general_path(dtype, eval_init):
    gen = torch.Generator().manual_seed(9)
    module = _module(MEAN, "cpu", dtype, eval_init)
    module(*_batch(gen, "cpu"))
    module.eval()
    assert not isinstance(module._eval_path, EvalPooledFromTables)
    keys, offsets = _batch(gen, "cpu")
    got = module(keys, offsets)
    if eval_init is None:  # zeros for missing keys: the straight path's answer, to fp16
        want = _reference(module, keys, offsets, MEAN, None)
        torch.testing.assert_close(got.double(), want, rtol=1e-3, atol=1e-3)
    else:  # a missing key reads 3.0 in every column
        assert (got == 3.0).any()
