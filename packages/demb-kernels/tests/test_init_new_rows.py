"""init_new_rows (several tables' new rows initialized in one call, gated by find_or_insert's
status): equal to init_rows called per table on the entries with a new row, bit for bit, for
mixed dims, widths, dtypes, modes and states; other rows untouched; bad input; and (marked
`cuda`) CUDA == CPU, including more tables than one launch takes."""

from __future__ import annotations

import pytest
import torch
from demb_kernels.init_rows import (
    INIT_MODES,
    NewRowsSpec,
    init_new_rows,
    init_rows,
    new_rows_args,
)
from demb_kernels.table import InsertStatus
from hypothesis import given, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
PARAMS = {
    "uniform": {"lower": -0.5, "upper": 0.25},
    "normal": {"mean": 0.1, "std_dev": 2.0},
    "truncated_normal": {"mean": 0.0, "std_dev": 1.0, "lower": -0.3, "upper": 0.7},
    "constant": {"value": 1.5},
    "debug": {},
}


class Case:
    """T tables, their buffers (random contents) and n entries with statuses."""

    def __init__(self, seed: int, tables: int, n: int, device: str = "cpu") -> None:
        g = torch.Generator().manual_seed(seed)
        self.dims, self.specs, self.states, self.values = [], [], [], []
        for t in range(tables):
            dim = int(torch.randint(1, 40, (1,), generator=g))
            extra = int(torch.randint(0, 3, (1,), generator=g)) * dim
            rows = int(torch.randint(1, 50, (1,), generator=g))
            dtype = DTYPES[t % 3]
            mode = INIT_MODES[(seed + t) % len(INIT_MODES)]
            self.dims.append(dim)
            self.specs.append(NewRowsSpec(seed=seed * 7919 + t, mode=mode, **PARAMS[mode]))
            with_state = extra and t % 2 == 0
            self.states.append(torch.randn(extra, generator=g) if with_state else None)
            self.values.append(torch.randn(rows, dim + extra, generator=g).to(dtype))
        self.tables = torch.randint(0, tables, (n,), generator=g)
        rows_of = torch.tensor([v.shape[0] for v in self.values])
        self.slots = (torch.rand(n, generator=g) * rows_of[self.tables]).long()
        self.slots[torch.rand(n, generator=g) < 0.1] = -1
        self.keys = torch.randint(-(2**63), 2**63 - 1, (n,), generator=g)
        self.status = torch.randint(0, 4, (n,), generator=g)
        # one entry per (table, slot): as find_or_insert gives slots
        seen: set[tuple[int, int]] = set()
        for i in range(n):
            pair = (int(self.tables[i]), int(self.slots[i]))
            if pair[1] >= 0 and pair in seen:
                self.slots[i] = -1
            seen.add(pair)
        self.device = device

    def on(self, device: str, dims: list[int] | None = None, specs: list | None = None) -> dict:
        states = [None if s is None else s.to(device) for s in self.states]
        return {
            "values": [v.clone().to(device) for v in self.values],
            "slots": self.slots.to(device),
            "keys": self.keys.to(device),
            "tables": self.tables.to(device),
            "status": self.status.to(device),
            "args": new_rows_args(dims or self.dims, specs or self.specs, states),
        }


def expected(case: Case) -> list[torch.Tensor]:
    """init_rows per table on the entries with a new row."""
    new = (case.status == InsertStatus.INSERTED) | (case.status == InsertStatus.EVICTED)
    out = [v.clone() for v in case.values]
    for t, buf in enumerate(out):
        mine = new & (case.tables == t)
        spec = case.specs[t]._asdict()  # init_rows' keyword arguments
        init_rows(
            buf, case.slots[mine], case.keys[mine], case.dims[t], **spec, state=case.states[t]
        )
    return out


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), tables=st.integers(1, 6), n=st.integers(0, 200))
def test_cpu_equals_init_rows_per_table(seed, tables, n):
    case = Case(seed, tables, n)
    args = case.on("cpu")
    init_new_rows(**args)
    for t, (got, want) in enumerate(zip(args["values"], expected(case), strict=True)):
        assert torch.equal(got, want), f"table {t}"


def test_only_new_rows_change():
    case = Case(3, 2, 100)
    case.status[:] = InsertStatus.HIT
    case.status[5] = InsertStatus.FAILED
    args = case.on("cpu")
    init_new_rows(**args)
    for got, before in zip(args["values"], case.values, strict=True):
        assert torch.equal(got, before)


def test_out_of_range_entries_raise_before_any_row_changes():
    case = Case(4, 2, 50)
    case.status[:] = InsertStatus.INSERTED
    case.slots[-1] = case.values[int(case.tables[-1])].shape[0]  # one past the end
    args = case.on("cpu")
    with pytest.raises(ValueError, match=r"slots\[49\]"):
        init_new_rows(**args)
    for got, before in zip(args["values"], case.values, strict=True):
        assert torch.equal(got, before)
    case.slots[-1] = 0
    case.tables[-1] = 2
    with pytest.raises(ValueError, match=r"tables\[49\]=2 is out of range for 2 tables"):
        init_new_rows(**case.on("cpu"))
    case.status[-1] = InsertStatus.HIT  # an entry without a new row is not looked at
    init_new_rows(**case.on("cpu"))


def test_bad_arguments_are_rejected():
    case = Case(5, 2, 10)
    args = case.on("cpu")
    with pytest.raises(ValueError, match="dims, specs and states: 1, 2 and 2 entries"):
        case.on("cpu", dims=case.dims[:1])
    with pytest.raises(ValueError, match="mode='gaussian'"):
        case.on("cpu", specs=[case.specs[0]._replace(mode="gaussian")] * 2)
    with pytest.raises(ValueError, match="dims: 1 entries for 2 tables"):
        init_new_rows(**{**args, "args": args["args"]._replace(dims=[1])})
    with pytest.raises(ValueError, match="status must be 1-D with one entry per slot"):
        init_new_rows(**{**args, "status": args["status"][:3]})
    with pytest.raises(TypeError, match="tables must be int64"):
        init_new_rows(**{**args, "tables": args["tables"].int()})
    case.dims[0] = 0
    with pytest.raises(ValueError, match="dim=0"):
        init_new_rows(**case.on("cpu"))


@pytest.mark.cuda
@pytest.mark.parametrize(("tables", "n"), [(1, 5000), (5, 20_000), (40, 20_000)])
def test_cuda_equals_cpu(tables, n):
    case = Case(11 + tables, tables, n)
    cpu, gpu = case.on("cpu"), case.on("cuda")
    init_new_rows(**cpu)
    init_new_rows(**gpu)
    for t, (c, g) in enumerate(zip(cpu["values"], gpu["values"], strict=True)):
        assert torch.equal(g.cpu(), c), f"table {t}"
