"""The opcheck cases, per op: each op's inputs and the opcheck utils it runs (a case that leaves
one out says why beside it). ``test_opcheck.py`` runs them."""

from __future__ import annotations

import torch
from _opcheck_inputs import (
    ADAM,
    HITS,
    MISSES,
    NO_AOT,
    SGD,
    UTILS,
    B,
    Case,
    D,
    F,
    T,
    W,
    _gen,
    batch,
    counts,
    distinct_batch,
    full_index,
    index,
    keys,
    scores,
    segments,
    table_args,
    values,
)
from demb_kernels.launched import dedup_launch
from demb_kernels.lookup import dedup_batch, index_tables
from demb_kernels.table import ScorePolicy

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
