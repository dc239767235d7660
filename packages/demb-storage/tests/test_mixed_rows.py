"""Rows of a batch spanning several tables (demb_storage.mixed_rows) against plain indexing of
each table's buffer: the fused gather (one dtype, every buffer wide enough) and the per-table
fallback read the same rows, bit for bit in float16 and bfloat16 too; a write lands each row
in its own table's buffer and skips slot -1 (on CUDA as well, on a GPU machine)."""

from __future__ import annotations

import pytest
import torch
from demb_storage import TableConfigError
from demb_storage.mixed_rows import read_mixed, write_mixed

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _buffers(
    widths: list[int], dtypes: list[torch.dtype], device: str, rows: int = 50
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [
        torch.randn((rows, w), generator=gen).to(dtype).to(device)
        for w, dtype in zip(widths, dtypes, strict=True)
    ]


def _batch(tables: list[int], n: int, rows: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    ids = torch.tensor(tables)[torch.randint(0, len(tables), (n,), generator=gen)]
    slots = torch.randint(-1, rows, (n,), generator=gen)
    return ids, slots


def _expected(values: list[torch.Tensor], ids: torch.Tensor, slots: torch.Tensor, width: int):
    out = torch.zeros((ids.shape[0], width), dtype=values[int(ids[0])].dtype)
    for i, (t, s) in enumerate(zip(ids.tolist(), slots.tolist(), strict=True)):
        if s >= 0:
            out[i] = values[t][s, :width].cpu()
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape",
    [
        "fused",  # every buffer of the dtype and at least as wide: one gather_table_rows
        "a narrower table",  # a table outside the batch is narrower: one gather a table
        "another dtype",  # a table outside the batch has another dtype
    ],
)
def test_read_equals_indexing_each_table(device: str, dtype: torch.dtype, shape: str):
    widths, dtypes = [12, 12, 12, 12], [dtype] * 4
    if shape == "a narrower table":
        widths[3] = 4
    if shape == "another dtype":
        dtypes[3] = torch.float64
    values = _buffers(widths, dtypes, device)
    ids, slots = _batch([0, 1, 2], 300)
    got = read_mixed(values, ids.to(device), slots.to(device), (0, 1, 2))
    assert got.dtype == dtype
    assert got.device.type == device
    assert torch.equal(got.cpu(), _expected(values, ids, slots, 12))


@pytest.mark.parametrize("device", DEVICES)
def test_one_table_reads_its_buffer(device: str):
    values = _buffers([8, 8], [torch.float32] * 2, device)
    ids, slots = _batch([1], 40)
    got = read_mixed(values, ids.to(device), slots.to(device), (1,))
    assert torch.equal(got.cpu(), _expected(values, ids, slots, 8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tables", [(0, 2), (1,)])
def test_write_lands_each_row_in_its_table_and_skips_slot_minus_one(device: str, tables):
    values = _buffers([6, 6, 6], [torch.float16] * 3, device)
    before = [v.clone() for v in values]
    n = 40
    ids = torch.tensor(tables)[torch.arange(n) % len(tables)]
    slots = torch.randperm(50)[:n]  # distinct slots a table
    slots[::7] = -1
    rows = torch.randn((n, 6), dtype=torch.float64)  # converted to the buffers' float16
    write_mixed(values, ids.to(device), slots.to(device), rows.to(device), tables)
    for t in range(3):
        want = before[t].cpu().clone()
        for i in range(n):
            if int(ids[i]) == t and int(slots[i]) >= 0:
                want[int(slots[i])] = rows[i].to(torch.float16)
        assert torch.equal(values[t].cpu(), want), t


def test_no_table_is_a_named_error():
    values = _buffers([4], [torch.float32], "cpu")
    empty = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(TableConfigError, match="tables"):
        read_mixed(values, empty, empty, ())
    with pytest.raises(TableConfigError, match="tables"):
        write_mixed(values, empty, empty, torch.zeros((0, 4)), ())
