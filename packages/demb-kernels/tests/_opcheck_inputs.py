"""Small realistic inputs of the ``demb`` ops, built as the wrappers build them (the opcheck
cases' shared parts; ``test_opcheck.py`` runs them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from demb_kernels import table as tbl
from demb_kernels.table import ScorePolicy, TableIndex

UTILS = (
    "test_schema",
    "test_autograd_registration",
    "test_faketensor",
    "test_aot_dispatch_dynamic",
)
NO_AOT = UTILS[:3]

T, F, B, D, W = 2, 3, 4, 4, 12  # tables, features, batch size, embedding dim, row width
SGD = [0.1] + [0.0] * 8  # optimizer_update's nine floats
ADAM = [0.1, 1e-8, 0.9, 0.999, 0.01, 0.0, 0.0, 0.0, 0.0]

Args = tuple[tuple[object, ...], dict[str, object]]


@dataclass(frozen=True)
class Case:
    op: str
    name: str
    make: Callable[[torch.device], Args]
    utils: tuple[str, ...] = UTILS
    devices: tuple[str, ...] = ("cpu", "cuda")
    tolerance: tuple[float, float] | None = None  # (rtol, atol) of the aot comparison
    cuda_utils: tuple[str, ...] | None = None  # where the CUDA kernel needs others than utils


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def index(dev, policies=(ScorePolicy.TIMESTAMP, ScorePolicy.LFU)) -> TableIndex:
    """Two tables of 64 and 32 slots (buckets of 16) holding keys 1..20: key k in table k % 2."""
    idx = TableIndex.create([64, 32], [16, 16], list(policies), dev)
    keys = torch.arange(1, 21, device=dev)
    tbl.find_or_insert(idx, keys, keys % 2, torch.tensor([5, 5], device=dev))
    return idx


def full_index(dev) -> TableIndex:
    """Two tables of one bucket (16 slots) each, full: keys 1..32, key k in table k % 2."""
    idx = TableIndex.create([16, 16], [16, 16], [ScorePolicy.TIMESTAMP, ScorePolicy.LFU], dev)
    keys = torch.arange(1, 33, device=dev)
    tbl.find_or_insert(idx, keys, keys % 2, torch.tensor([5, 5], device=dev))
    return idx


def values(dev, dtype=torch.float32, width=W) -> list[torch.Tensor]:
    """The two tables' value rows, one per slot."""
    gen = _gen(1)
    return [torch.randn(rows, width, generator=gen).to(dev, dtype) for rows in (64, 32)]


MISSES = [3, 4, 100, 101, 5, 7, 3]  # 100 and 101 are not in the index; 3 twice
HITS = [3, 4, 5, 6, 3]


def keys(dev, ks=MISSES) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of keys and their tables (key k in table k % 2, as :func:`index` put them)."""
    k = torch.tensor(ks, device=dev)
    return k, k % 2


def batch(dev, seed=2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A TBE-layout batch: F features of B bags (0 to 3 keys, some repeated), feature-major;
    features 1 and 2 share table 1."""
    gen = _gen(seed)
    lengths = torch.randint(0, 4, (F * B,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    indices = torch.randint(0, 30, (int(offsets[-1]),), generator=gen)
    return indices.to(dev), offsets.to(dev), torch.tensor([0, 1, 1], device=dev)


def distinct_batch(dev, hit: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch whose (table, key) pairs are all distinct (U == N: every row of dedup_launch's
    full-size outputs is meaningful), all in :func:`index` when ``hit``."""
    lengths = torch.tensor([1, 0, 2, 1, 1, 1, 0, 2, 2, 0, 1, 1])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    table0 = [2, 4, 6, 8]  # feature 0's four keys, then features 1 and 2's eight (table 1)
    table1 = [1, 3, 5, 7, 9, 11, 13, 15] if hit else [1, 3, 105, 7, 9, 111, 13, 15]
    indices = torch.tensor(table0 + table1)
    return indices.to(dev), offsets.to(dev), torch.tensor([0, 1, 1], device=dev)


def segments(dev, seed=3, single=True):
    """order and starts of 30 entries over 9 unique keys (as dedup_batch gives them): with
    ``single`` keys 2, 5 and 8 have one entry, else every key has several."""
    gen = _gen(seed)
    several = torch.tensor([u for u in range(9) if not single or u % 3 != 2])
    extra = several[torch.randint(0, several.numel(), (21,), generator=gen)]
    inverse = torch.cat([torch.arange(9), extra] if single else [several, several, extra[:12]])
    inverse = inverse[torch.randperm(inverse.numel(), generator=gen)]
    order = torch.argsort(inverse, stable=True)
    counts = torch.bincount(inverse, minlength=9)
    starts = torch.cumsum(counts, 0) - counts
    return inverse.to(dev), order.to(dev), starts.to(dev)


def table_args(ix: TableIndex) -> tuple[torch.Tensor, ...]:
    """The six index tensors every table op starts with."""
    return ix._tensors()


def scores(dev) -> torch.Tensor:
    return torch.tensor([9, 9], device=dev)


def counts(dev, n) -> torch.Tensor:
    return torch.arange(1, n + 1, device=dev)
