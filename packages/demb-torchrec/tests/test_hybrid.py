"""Hybrid tables (``caching=False`` with a device budget below the table's value bytes): one
index, the first rows' values in device memory and the others in host memory. On the CPU both
are the host's memory, so a hybrid table trains exactly like an all-device one (checked here
with its bookkeeping); on a GPU (marker ``cuda``) the split is real."""

from __future__ import annotations

import pytest
import torch
from demb_storage import TableConfigError
from demb_torchrec import (
    DynamicEmbeddingTables,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    table_memory,
)
from demb_torchrec.stats import table_placement

DIM = 8
ROW = (DIM + 2 * DIM) * 4  # Adam: embedding and two state columns, float32
ALL = 4096 * ROW  # a budget that holds the whole table (max_capacity 4096): all-device


def _module(
    budget: int,
    device: str = "cpu",
    init: int = 4096,
    optimizer: str = "adam",
    pooling: DynamicEmbPoolingMode = DynamicEmbPoolingMode.SUM,
) -> DynamicEmbeddingTables:
    options = DynamicEmbTableOptions(
        dim=DIM, max_capacity=4096, init_capacity=init, local_hbm_for_values=budget,
        score_strategy=DynamicEmbScoreStrategy.STEP,
    )  # fmt: skip
    return DynamicEmbeddingTables(
        [options], table_names=["user"], device=device, optimizer=optimizer,
        pooling_mode=pooling, learning_rate=0.05,
    )  # fmt: skip


def _train(modules: list[DynamicEmbeddingTables], device: str = "cpu") -> None:
    gen = torch.Generator().manual_seed(0)
    every = 1 if modules[0].pooling_mode is DynamicEmbPoolingMode.NONE else 4
    for step in range(8):
        indices = torch.randint(0, 3000, (512,), generator=gen).to(device)
        offsets = torch.arange(0, 513, every, device=device)
        outs = [m(indices, offsets) for m in modules]
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], rtol=0, atol=0, msg=f"step {step}")
        grad = torch.randn(outs[0].shape, generator=gen).to(device)
        for out in outs:
            out.backward(grad)


def _rows(m: DynamicEmbeddingTables) -> tuple[torch.Tensor, torch.Tensor]:
    ex = m.tables.export(0)
    order = torch.argsort(ex.keys)
    return ex.keys[order].cpu(), ex.values[order].cpu()


@pytest.mark.parametrize(
    ("budget", "rows"), [(0, 0), (1, 0), (100 * ROW, 100), (1024 * ROW + ROW - 1, 1024)]
)
def test_a_hybrid_table_trains_like_an_all_device_one(budget: int, rows: int):
    """0 (the default) and 1 byte (below one row): every value in host memory (the spec)."""
    whole, hybrid = _module(ALL), _module(budget, init=1024)  # the hybrid one grows too
    assert whole.tables.configs[0].device_rows is None
    assert hybrid.tables.configs[0].device_rows == rows
    _train([whole, hybrid])
    assert hybrid.tables.capacity(0) > 1024  # it grew; still hybrid
    assert hybrid.tables.configs[0].device_rows == rows
    for a, b in zip(_rows(whole), _rows(hybrid), strict=True):
        assert torch.equal(a, b)
    text = table_placement(hybrid)["model"]["user"]
    if rows:
        assert f"the values of its first {rows} rows in cpu memory" in text
    else:
        assert text.startswith("all values in host memory")
    assert table_placement(whole)["model"]["user"].startswith("all values in cpu memory")


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("pooling", [DynamicEmbPoolingMode.NONE, DynamicEmbPoolingMode.SUM])
def test_optimizers_and_pooling(optimizer: str, pooling: DynamicEmbPoolingMode):
    whole = _module(ALL, optimizer=optimizer, pooling=pooling)
    hybrid = _module(100 * ROW, init=1024, optimizer=optimizer, pooling=pooling)
    assert hybrid.tables.configs[0].device_rows is not None
    _train([whole, hybrid])
    for a, b in zip(_rows(whole), _rows(hybrid), strict=True):
        assert torch.equal(a, b)


def test_a_budget_that_holds_the_table_is_all_device_and_a_huge_one_is_refused():
    assert _module(4096 * ROW).tables.configs[0].device_rows is None
    with pytest.raises(TableConfigError, match=r"user\.local_hbm_for_values.*bytes of memory"):
        _module(1 << 62)


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [0, 1000])
def test_a_hybrid_table_on_a_gpu_splits_its_rows_and_trains_like_an_all_device_one(rows: int):
    whole, hybrid = _module(ALL, "cuda"), _module(rows * ROW, "cuda", init=1024)
    values = hybrid.tables.values[0]
    assert values.is_cuda
    _train([whole, hybrid], "cuda")
    for a, b in zip(_rows(whole), _rows(hybrid), strict=True):
        assert torch.equal(a, b)
    used = table_memory(hybrid)["model"]["user"]
    assert used.host == (hybrid.tables.capacity(0) - rows) * ROW
    assert used.device >= rows * ROW  # and the index


def test_checkpoints_and_deltas_of_a_hybrid_table(tmp_path):
    """A hybrid table is one index: it dumps, loads and replays deltas slot for slot like an
    all-device table (into a hybrid or an all-device one of the same capacity)."""
    from demb_torchrec import (
        DynamicEmbDump,
        DynamicEmbLoad,
        get_score,
        incremental_dump,
        replay_increment,
    )

    sgd = {"optimizer": "sgd"}  # (a load restores rows, not Adam's step counts)
    source, replica, restored = (
        _module(100 * ROW, **sgd),
        _module(ALL, **sgd),
        _module(100 * ROW, **sgd),
    )
    _train([source])
    DynamicEmbDump(str(tmp_path / "ckpt"), source, optim=True)
    DynamicEmbLoad(str(tmp_path / "ckpt"), replica, optim=True)
    DynamicEmbLoad(str(tmp_path / "ckpt"), restored, optim=True)
    threshold = get_score(source)
    indices = torch.arange(2900, 3100)
    source(indices, torch.arange(0, 201, 4)).sum().backward()
    replay_increment(replica, incremental_dump(source, threshold))
    for a, b in zip(_rows(source), _rows(replica), strict=True):
        assert torch.equal(a, b)
    restored(indices, torch.arange(0, 201, 4)).sum().backward()
    for a, b in zip(_rows(source), _rows(restored), strict=True):
        assert torch.equal(a, b)
