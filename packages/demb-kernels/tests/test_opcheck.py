"""``torch.library.opcheck`` of every op of the ``demb`` torch library.

Each op registered in the library has cases here (:func:`test_every_op_has_a_case` fails for a
new op without one), small realistic inputs built as the wrappers build them. A case runs
opcheck's default test utils: ``test_schema`` (the schema declares every argument the kernel
writes, ``(a!)``, and the aliases it returns), ``test_autograd_registration``,
``test_faketensor`` (the fake kernel's shapes, dtypes and devices are the real kernel's) and
``test_aot_dispatch_dynamic`` (traced with dynamic shapes under functionalization, the op gives
eager's results); a case that leaves one out says why beside it. The cases run on the CPU and
(marker ``cuda``) on a GPU; the two CUDA-only ops run their fakes on a CPU machine.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from demb_kernels import table as tbl
from demb_kernels.launched import dedup_launch
from demb_kernels.lookup import dedup_batch, index_tables
from demb_kernels.table import ScorePolicy, TableIndex
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

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


def registered_ops() -> set[str]:
    return {
        s.name.removeprefix("demb::")
        for s in torch._C._jit_get_all_schemas()
        if s.name.startswith("demb::")
    }


# --- inputs --------------------------------------------------------------------------------


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


# --- cases, per op -------------------------------------------------------------------------


def _hash64(dtype):
    def make(dev):
        return (torch.tensor([0, 1, -1, 2**31 - 1, -(2**31)], dtype=dtype, device=dev),), {}

    return make


def _route(dev):
    return (torch.arange(-3, 29, device=dev), 4, "continuous", 8), {}


def _route_hash(dev):
    return (torch.tensor([5, -7, 2**40, 9], device=dev), 3, "hash_roundrobin", 0), {}


def _bucketize_roundrobin(dev):
    lengths = torch.tensor([2, 1, 0, 3], device=dev)
    weights = torch.rand(6, generator=_gen(4)).to(dev)
    return (lengths, torch.arange(6, device=dev), weights, 2, "roundrobin", None), {}


def _bucketize_continuous(dev):
    lengths = torch.tensor([2, 1, 0, 3], dtype=torch.int32, device=dev)
    vals = torch.tensor([0, 5, 9, 1, 7, 3], dtype=torch.int32, device=dev)
    blocks = torch.tensor([4, 5], device=dev)  # 2 features of 2 samples
    return (lengths, vals, None, 2, "continuous", blocks), {}


def _lookup(touch: bool):
    def make(dev):
        ix, (k, t) = index(dev), keys(dev)
        args = (scores(dev), counts(dev, k.numel())) if touch else (None, None)
        return (*table_args(ix), k, t, *args), {}

    return make


def _find_or_insert(policies):
    def make(dev):
        ix, (k, t) = index(dev, policies), keys(dev)
        return (*table_args(ix), ix.sizes, k, t, scores(dev), counts(dev, k.numel())), {}

    return make


def _find_or_insert_evicting(dev):
    ix, (k, t) = full_index(dev), keys(dev)  # 100 and 101 evict a key of each table
    return (*table_args(ix), ix.sizes, k, t, scores(dev), counts(dev, k.numel())), {}


def _find_or_insert_rows(ks):
    def make(dev):
        ix, (k, t) = index(dev), keys(dev, ks)
        inverse = torch.tensor([0, 1, 1, 2, 3, 4, 0], device=dev)  # 7 occurrences
        rows = (values(dev), inverse, D)
        return (*table_args(ix), ix.sizes, k, t, scores(dev), None, *rows), {}

    return make


def _gated(hit: bool):
    def make(dev):
        ix = index(dev)
        indices, offsets, ftab = distinct_batch(dev, hit)
        if dev.type == "cuda":
            d = dedup_launch(indices, offsets, ftab, T, B)
            k, t, c, info, inverse = d.keys, d.tables, d.counts, d.info, d.inverse
        else:  # no kernel here: dedup_launch's outputs by shape, for the fake kernel
            k, t = indices, index_tables(indices, offsets, ftab, T, B)[0]
            c, inverse = torch.ones_like(indices), torch.arange(indices.numel())
            info = torch.zeros(T + 6 + F + 1 + 6, dtype=torch.int64)
        rows = (values(dev), inverse, D)
        return (*table_args(ix), ix.sizes, k, t, scores(dev), c, info, *rows), {}

    return make


def _dedup_launch(dev):
    return (*distinct_batch(dev, hit=False), T, B, None), {"key_bits": 64, "counts": True}


def _insert_or_assign(dev):
    ix = index(dev, (ScorePolicy.TIMESTAMP_LFU, ScorePolicy.CUSTOMIZED))
    k, t = keys(dev)
    assign = torch.arange(2 * k.numel(), device=dev).view(2, -1)  # 2 score words
    return (*table_args(ix), ix.sizes, k, t, assign), {}


def _erase(dev):
    ix, (k, t) = index(dev), keys(dev)
    return (*table_args(ix), ix.sizes, k, t), {}


def _export_scan(dev):
    ix = index(dev)
    return (ix.keys, ix.scores, ix.slot_offsets, [1, 0], [0, 6], 0, [0]), {}


def _write_batch(dev):
    """Keys 100..103 of tables 0, 1, 0, 1 at distinct in-range slots (some over held keys)."""
    keys = torch.arange(100, 104, device=dev)
    ids = torch.tensor([0, 1, 0, 1], device=dev)
    return keys, ids, torch.tensor([0, 1, 2, 31], device=dev)


def _slot_writes_check(dev):
    ix = index(dev)
    return (ix.slot_offsets, ix.bucket_widths, *_write_batch(dev)), {}


def _slot_writes_apply(dev):
    ix = index(dev)
    keys, ids, slots = _write_batch(dev)
    digests = torch.ones(4, dtype=torch.uint8, device=dev)
    words = torch.arange(4 * ix.score_words, device=dev).view(ix.score_words, 4)
    return (*table_args(ix)[:5], ix.sizes, keys, ids, slots, digests, words), {}


def _timestamp(dev):
    return (torch.empty(0, device=dev), 3), {}


def _find_rows(dtype):
    def make(dev):
        ix, (k, t) = index(dev), keys(dev)
        return (*table_args(ix), values(dev, dtype), k, t, D), {}

    return make


def _find_batch_rows(dev):
    ix = index(dev)
    indices, offsets, ftab = batch(dev)
    return (*table_args(ix), values(dev), indices, offsets, ftab, B, D, True), {}


def _gather_rows(dtype):
    def make(dev):
        return (values(dev, dtype)[0], torch.tensor([0, 5, -1, 7, 5], device=dev)), {}

    return make


def _scatter_rows(dtype):
    def make(dev):
        rows = torch.randn(4, W, generator=_gen(5)).to(dev, dtype)
        return (values(dev, dtype)[0], torch.tensor([0, 5, -1, 7], device=dev), rows), {}

    return make


def _gather_rows_many(dev):
    tables = values(dev, torch.float32)
    buffers = [tables[0], tables[1][:, :3].contiguous()]
    return (buffers, [torch.tensor([0, 5, -1]), torch.tensor([2])]), {}


def _scatter_rows_many(dev):
    tables = [values(dev, torch.float32)[0], values(dev, torch.float16)[1]]
    slots = [torch.tensor([0, 5, -1]), torch.tensor([2])]
    rows = [
        torch.randn(s.numel(), t.shape[1], generator=_gen(6)).to(t)
        for s, t in zip(slots, tables, strict=True)
    ]
    return (tables, slots, rows), {}


def _init_rows(mode, dtype, state):
    def make(dev):
        v = values(dev, dtype)[0]
        slots, ks = torch.tensor([0, 5, -1, 7], device=dev), torch.tensor([1, 2, 3, -4], device=dev)
        s = torch.full((W - D,), 0.5, device=dev) if state else None
        return (v, slots, ks, D, 7, mode, 0.1, 0.5, -1.0, 1.0, 0.25, s), {}

    return make


def _init_new_rows(dev):
    status = torch.tensor([1, 2, 0, 1, 3], device=dev)  # INSERTED, EVICTED, HIT, INSERTED, FAILED
    slots = torch.tensor([0, 5, 3, 7, -1], device=dev)
    ks = torch.tensor([1, 2, 3, 4, 5], device=dev)
    tables = torch.tensor([0, 1, 0, 1, 0], device=dev)
    params = [0.0, 1.0, -1.0, 1.0, 0.0] * 2
    states = [None, torch.zeros(W - D, device=dev)]
    args = (values(dev), slots, ks, tables, status, [D, D], [1, 2], [0, 1], params, states)
    return args, {}


def _dedup(dev, seed=2):
    indices, offsets, ftab = batch(dev, seed)
    return dedup_batch(indices, offsets, ftab, T, B)


def _unique_slots(dev, d) -> torch.Tensor:
    """A slot of each unique key, in its table's rows (some -1)."""
    rows = torch.tensor([64, 32], device=dev)[d.tables]
    gen = _gen(6)
    slots = (torch.rand(d.keys.numel(), generator=gen).to(dev) * rows).long()
    slots[::4] = -1
    return slots


def _gather_table_rows(per_occurrence: bool):
    def make(dev):
        d = _dedup(dev)
        inverse = d.inverse if per_occurrence else None
        return (values(dev), _unique_slots(dev, d), d.tables, inverse, D), {}

    return make


def _segment_plan(dev):
    _, order, starts = segments(dev)
    return (starts, order.numel()), {}


def _pool(mean: bool, weighted: bool):
    def make(dev):
        indices, offsets, ftab = batch(dev)
        gen = _gen(7)
        slots = torch.randint(-1, 32, (indices.numel(),), generator=gen).to(dev)
        weights = torch.rand(indices.numel(), generator=gen).to(dev) if weighted else None
        return (values(dev), slots, offsets, ftab, B, D, mean, weights), {}

    return make


def _segment_sum(kind: str):
    def make(dev):
        single = kind == "plain"
        _, order, starts = segments(dev, single=single)
        gen = _gen(8)
        n = order.numel()
        if kind == "pooled":  # each entry's bag and factor
            bags = 7
            grads = torch.randn(bags, D, generator=gen).to(dev)
            rows = torch.randint(0, bags, (n,), generator=gen).to(dev)
            scale = torch.rand(n, generator=gen).to(dev)
            return (grads, order, starts, None, rows, scale, False), {}
        grads = torch.randn(n, D, generator=gen).to(dev)
        # skip_single leaves a one-entry key's row unwritten: here every key has several, so
        # the outputs compared by the aot util are all written.
        return (grads, order, starts, None, None, None, kind == "skip_single"), {}

    return make


def _segment_single_rows(dev):
    _, order, starts = segments(dev)
    return (order, starts), {}


def _dedup_batch(with_counters: bool):
    def make(dev):
        indices, offsets, ftab = batch(dev)
        c = torch.randint(0, 5, (indices.numel(),), generator=_gen(9)).to(dev)
        return (indices, offsets, ftab, T, B, c if with_counters else None, 64), {}

    return make


def _index_tables(dev):
    return (*batch(dev), T, B), {}


def _batch_bounds(dev):
    indices, offsets, ftab = batch(dev)
    _, checks = index_tables(indices, offsets, ftab, T, B)
    return (checks.cpu(), indices.numel(), 0, F), {}


def _status_counts(dev):
    return (torch.tensor([0, 1, 2, 3, 1, 0], device=dev), [0, 2, 6]), {}


def _optimizer_update(kind: str):
    def make(dev):
        gen = _gen(10)
        slots = [torch.tensor([0, 3, -1], device=dev), torch.tensor([1, 2], device=dev)]
        grads = [torch.randn(s.numel(), D, generator=gen).to(dev) for s in slots]
        if kind == "adam":  # rows [embedding | m | v]: 3 * D wide
            skip = torch.zeros((), dtype=torch.bool, device=dev)
            args = ("adam", *ADAM, skip, None, None)
            return (values(dev), slots, grads, [D, D], [1, 3], *args), {}
        # sgd, entries 0 and 3 reading their gradients from grad_source's rows 2 and 0
        grad_rows = torch.tensor([2, -1, -1, 0, -1], device=dev)
        source = torch.randn(3, D, generator=gen).to(dev)
        args = ("sgd", *SGD, None, grad_rows, source)
        return (values(dev, width=D), slots, grads, [D, D], [1, 1], *args), {}

    return make


def _summed_update(pooled: bool):
    def make(dev):
        d = _dedup(dev)
        n = d.order.numel()
        gen = _gen(11)
        sizes = (d.bounds[1 : T + 1] - d.bounds[:T]).tolist()
        trigger = torch.zeros((), device=dev, requires_grad=True)
        rows = scale = workspace = nonfinite = None
        if pooled:  # the output's bags, each entry's bag and factor; sums into a workspace
            out = torch.randn(B, F * D, generator=gen).to(dev)
            rows = torch.randint(0, B * F, (n,), generator=gen).to(dev)
            scale = torch.rand(n, generator=gen).to(dev)
            workspace = torch.empty(0) if dev.type == "cpu" else None
        else:
            out = torch.randn(n, D, generator=gen).to(dev)
            if dev.type == "cuda":  # dedup_launch's zeroed flag
                nonfinite = torch.zeros((), dtype=torch.bool, device=dev)
        steps = torch.zeros(T, dtype=torch.int64)
        args = (
            trigger, out, d.order, d.starts, None, rows, scale, _unique_slots(dev, d), sizes,
            values(dev, width=D), [D, D], steps, "sgd", SGD, None, True, D, workspace, nonfinite,
        )  # fmt: skip
        return args, {}

    return make


CUDA_ONLY = ("cuda",)
CPU_ONLY = ("cpu",)
ONE_WORD = (ScorePolicy.STEP, ScorePolicy.LFU)
TIMESTAMP_LFU = (ScorePolicy.TIMESTAMP_LFU, ScorePolicy.NO_EVICTION)

CASES = [
    Case("hash64", "int64", _hash64(torch.int64)),
    Case("hash64", "int32", _hash64(torch.int32)),
    Case("route_keys", "continuous", _route),
    Case("route_keys", "hash_roundrobin", _route_hash),
    Case("bucketize_by_owner", "roundrobin_weights", _bucketize_roundrobin),
    Case("bucketize_by_owner", "continuous_int32", _bucketize_continuous),
    Case("table_lookup", "touch", _lookup(touch=True)),
    Case("table_lookup", "read_only", _lookup(touch=False)),
    Case("table_find_or_insert", "one_word", _find_or_insert(policies=ONE_WORD)),
    Case("table_find_or_insert", "two_words", _find_or_insert(policies=TIMESTAMP_LFU)),
    Case("table_find_or_insert", "evicting", _find_or_insert_evicting),
    Case("table_find_or_insert_rows", "all_hit", _find_or_insert_rows(HITS)),
    Case("table_find_or_insert_rows", "a_miss", _find_or_insert_rows(MISSES[:5])),
    # Every key found: the victim outputs are left unwritten (documented: meaningful only when
    # a key missed, which the a_miss case covers), so eager and traced runs differ there.
    Case("table_find_or_insert_gated", "all_hit", _gated(hit=True), NO_AOT, CUDA_ONLY),
    Case("table_find_or_insert_gated", "a_miss", _gated(hit=False), devices=CUDA_ONLY),
    Case("table_insert_or_assign", "two_words", _insert_or_assign),
    Case("table_erase", "some_absent", _erase),
    # A clock reading: eager and the traced run read it at different times, so the aot util
    # compares them within a second (rtol and atol both needed; the values are nanoseconds).
    Case("table_export_scan", "two_tables", _export_scan, devices=CPU_ONLY),
    Case("slot_writes_check", "two_tables", _slot_writes_check, devices=CPU_ONLY),
    Case("slot_writes_apply", "two_tables", _slot_writes_apply, devices=CPU_ONLY),
    Case("table_timestamp", "three", _timestamp, tolerance=(1e-12, 1e9)),
    Case("table_find_rows", "float32", _find_rows(torch.float32)),
    Case("table_find_rows", "bfloat16", _find_rows(torch.bfloat16)),
    Case("table_find_batch_rows", "checked", _find_batch_rows),
    Case("gather_rows", "float32", _gather_rows(torch.float32)),
    Case("gather_rows", "float16", _gather_rows(torch.float16)),
    Case("scatter_rows", "float32", _scatter_rows(torch.float32)),
    Case("scatter_rows", "bfloat16", _scatter_rows(torch.bfloat16)),
    Case("gather_rows_many", "two_buffers", _gather_rows_many, devices=CPU_ONLY),
    Case("scatter_rows_many", "two_buffers", _scatter_rows_many, devices=CPU_ONLY),
    Case("init_rows", "normal_state", _init_rows("normal", torch.float32, state=True)),
    Case("init_rows", "uniform_bf16", _init_rows("uniform", torch.bfloat16, state=False)),
    Case("init_new_rows", "two_tables", _init_new_rows),
    Case("gather_table_rows", "per_occurrence", _gather_table_rows(per_occurrence=True)),
    Case("gather_table_rows", "per_key", _gather_table_rows(per_occurrence=False)),
    # On CUDA the plan's dead chunk columns are left unwritten (at::empty; documented: only
    # its live entries count, and the CPU kernel zeroes them), so eager and traced runs differ.
    Case("segment_plan", "single_keys", _segment_plan, cuda_utils=NO_AOT),
    Case("pool_table_rows", "sum", _pool(mean=False, weighted=False)),
    Case("pool_table_rows", "mean_weighted", _pool(mean=True, weighted=True)),
    # Returns a str: the aot util compares outputs as tensors (assert_close takes no str), and
    # there is nothing to trace (no tensors; one CompositeImplicitAutograd kernel).
    Case("pool_cpu_build", "build", lambda dev: ((), {}), utils=NO_AOT, devices=CPU_ONLY),
    # the calling thread's count set to what it is: the test's thread keeps its count
    Case(
        "set_thread_intra_op_threads",
        "unchanged",
        lambda dev: ((torch.get_num_threads(),), {}),
        utils=NO_AOT,
        devices=CPU_ONLY,
    ),
    Case("segment_sum_rows", "plain", _segment_sum("plain")),
    Case("segment_sum_rows", "pooled", _segment_sum("pooled")),
    Case("segment_sum_rows", "skip_single", _segment_sum("skip_single")),
    Case("segment_single_rows", "single_keys", _segment_single_rows),
    # The dedups return their five index rows as one (5, N) buffer (the wrappers take views),
    # and dedup_launch its info words, NaN/inf flag and clock as one buffer too: no output
    # aliases another. dedup_launch's case has U == N, so every row is meaningful.
    Case("dedup_batch", "counters", _dedup_batch(with_counters=True)),
    Case("dedup_batch", "plain", _dedup_batch(with_counters=False)),
    Case("dedup_launch", "distinct", _dedup_launch, UTILS, CUDA_ONLY),
    Case("index_tables", "batch", _index_tables),
    Case("batch_bounds", "checks", _batch_bounds, devices=CPU_ONLY),  # host words: CPU only
    Case("status_counts", "two_tables", _status_counts),
    Case("optimizer_update", "adam_skip", _optimizer_update("adam")),
    Case("optimizer_update", "sgd_grad_rows", _optimizer_update("sgd")),
    # An autograd node in C++ (its only kernel, at the Autograd key): the forward returns `out`
    # and stores the step; the backward sums the gradients and updates the tables, the step
    # counter (through its CPU data) and the workspace in place, from state the node holds.
    # AOTAutograd cannot trace that: the forward's checks read sizes as ints (no symbolic
    # shapes) and the backward writes host memory, so the aot util is left out;
    # test_summed_update_declares_what_its_backward_writes checks the schema's (a!) against
    # that backward instead. Its fake is that same kernel: fake tensors reach the Autograd key
    # first, and the forward reads only metadata.
    Case("summed_update", "per_occurrence", _summed_update(pooled=False), utils=NO_AOT),
    Case("summed_update", "pooled_workspace", _summed_update(pooled=True), utils=NO_AOT),
]


def _params():
    for case in CASES:
        for device in case.devices:
            marks = [pytest.mark.cuda] if device == "cuda" else []
            yield pytest.param(case, device, id=f"{case.op}-{case.name}-{device}", marks=marks)


def test_every_op_has_a_case():
    import demb_kernels

    ops = registered_ops()
    assert set(demb_kernels.OPS) <= ops
    assert {c.op for c in CASES} == ops, "an op without an opcheck case (or a case of no op)"
    cpu = {c.op for c in CASES if "cpu" in c.devices}
    assert ops - cpu == {"dedup_launch", "table_find_or_insert_gated"}
    cuda = {c.op for c in CASES if "cuda" in c.devices}
    assert ops - cuda == {
        "pool_cpu_build",
        "set_thread_intra_op_threads",
        "batch_bounds",
        "gather_rows_many",
        "scatter_rows_many",
        "table_export_scan",
        "slot_writes_check",
        "slot_writes_apply",
    }


@pytest.mark.parametrize(("case", "device"), list(_params()))
def test_opcheck(case: Case, device: str):
    args, kwargs = case.make(torch.device(device))
    rtol, atol = case.tolerance or (None, None)
    op = getattr(torch.ops.demb, case.op).default
    utils = case.cuda_utils if device == "cuda" and case.cuda_utils else case.utils
    torch.library.opcheck(op, args, kwargs, test_utils=utils, rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    "case", [c for c in CASES if "cpu" not in c.devices], ids=lambda c: f"{c.op}-{c.name}"
)
def test_cuda_only_ops_run_their_fakes_without_a_gpu(case: Case):
    """The ops with a CUDA kernel only: where no GPU runs them, their fake kernels (checked
    against the kernels by test_opcheck on a GPU) still run on fake tensors of these shapes."""
    args, kwargs = case.make(torch.device("cpu"))
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake_args, fake_kwargs = torch.utils._pytree.tree_map_only(
            torch.Tensor, mode.from_tensor, (args, kwargs)
        )
        out = getattr(torch.ops.demb, case.op).default(*fake_args, **fake_kwargs)
    assert all(isinstance(t, torch.Tensor) for t in out)


def test_import_registers_every_fake_kernel():
    """``import demb_kernels`` alone registers a fake (meta) kernel for each op, except
    pool_cpu_build and set_thread_intra_op_threads (no tensors: one kernel for every
    backend) and summed_update (an autograd node whose one kernel also runs on fake
    tensors)."""
    code = (
        "import torch, demb_kernels\n"
        "ops = {s.name[6:] for s in torch._C._jit_get_all_schemas()"
        " if s.name.startswith('demb::')}\n"
        "print(sorted(op for op in ops if not demb_kernels.has_kernel(op, 'Meta')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    want = "['pool_cpu_build', 'set_thread_intra_op_threads', 'summed_update']"
    assert out.stdout.strip() == want


def _tensors(arg: object) -> list[torch.Tensor]:
    if isinstance(arg, torch.Tensor):
        return [arg]
    if isinstance(arg, list | tuple):
        return [t for t in arg if isinstance(t, torch.Tensor)]
    return []


def test_summed_update_declares_what_its_backward_writes():
    """summed_update writes its arguments in its backward, where opcheck's schema util does
    not look: every argument a forward and backward change is declared written, ``(a!)``."""
    args, _ = _summed_update(pooled=True)(torch.device("cpu"))
    before = [[t.clone() for t in _tensors(a)] for a in args]
    out = torch.ops.demb.summed_update.default(*args)
    out.backward(torch.randn(out.shape, generator=_gen(12)))
    schema = torch.ops.demb.summed_update.default._schema
    changed = set()
    for arg, value, old in zip(schema.arguments, args, before, strict=True):
        now = _tensors(value)
        if any(a.shape != b.shape or not torch.equal(a, b) for a, b in zip(now, old, strict=True)):
            changed.add(arg.name)
    written = {a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write}
    assert changed == {"values", "steps", "workspace"}
    assert changed <= written
    assert written == changed | {"nonfinite"}  # the sums' flag, written on CUDA only
