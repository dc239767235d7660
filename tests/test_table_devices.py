"""One table algorithm: the kernels place keys where demb_planner.table_hash says, and a CUDA
index fed the same batches as a CPU index ends identical (keys, slots, scores) for every
policy, with >= 10**7 keys through tables that evict (on a GPU machine)."""

from __future__ import annotations

import demb_planner
import numpy as np
import pytest
import torch
from demb_kernels import table as ops
from demb_kernels.table import InsertStatus, ScorePolicy, TableIndex
from demb_storage import ScoredHashTable, ScoreStrategy, TableConfig

CAPACITIES = [1 << 18, 1 << 16]
WIDTHS = [128, 32]


def test_kernels_place_keys_where_the_planner_says():
    """In an empty, large table every key lands in its planner home bucket with the planner's
    digest, at the first empty slot of its circular order (mostly its start position)."""
    index = TableIndex.create([1 << 20, 1 << 18], [128, 16], [ScorePolicy.STEP] * 2)
    g = torch.Generator().manual_seed(3)
    keys = torch.randint(-(2**63), 2**63 - 1, (100_000,), generator=g).unique()
    keys = keys[keys != -1]
    tids = torch.randint(0, 2, keys.shape, generator=g)
    res = ops.find_or_insert(index, keys, tids, torch.tensor([1, 1]))
    assert bool((res.status == InsertStatus.INSERTED).all())
    at_start = 0
    for t, (cap, width) in enumerate([(1 << 20, 128), (1 << 18, 16)]):
        mine = tids == t
        home = demb_planner.home_slots(keys[mine].numpy(), cap, width)
        slots = res.slots[mine]
        np.testing.assert_array_equal((slots // width).numpy(), home.bucket)
        lo, _ = index.slot_range(t)
        np.testing.assert_array_equal(index.digests[lo + slots].numpy(), home.digest)
        at_start += int(((slots % width).numpy() == home.start).sum())
    assert at_start > 0.9 * keys.numel()


def _batches(policy: ScorePolicy, total: int, batch: int, seed: int):
    """Batches of keys (a hot set with duplicates + a wide cold range), table ids, score args,
    counts; keys far outnumber slots so the tables evict."""
    g = torch.Generator().manual_seed(seed)
    for step in range(total // batch):
        hot = torch.randint(0, 20_000, (batch // 2,), generator=g)
        cold = torch.randint(-(10**9), 10**9, (batch - batch // 2,), generator=g)
        keys = torch.cat([hot, cold])
        keys[keys == -1] = 7
        keys = keys[torch.randperm(batch, generator=g)]
        tids = torch.randint(0, 2, (batch,), generator=g)
        if policy is ScorePolicy.CUSTOMIZED:
            args = torch.randint(0, 1000, (2,), generator=g)  # goes up and down
        else:
            args = torch.tensor([1000 + step, 2000 + step])
        counts = torch.randint(0, 4, (batch,), generator=g)
        yield keys, tids, args, counts


def _assert_same_index(cpu: TableIndex, gpu: TableIndex) -> None:
    for name in ("keys", "digests", "scores", "sizes"):
        torch.testing.assert_close(
            getattr(gpu, name).cpu(), getattr(cpu, name), rtol=0, atol=0, msg=name
        )
    for t in range(cpu.num_tables):
        a, b = ops.export(cpu, t), ops.export(gpu, t)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y.cpu(), x, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_timestamp_copies_one_reading_of_the_global_timer():
    first = ops.timestamp("cuda", 3)
    many = ops.timestamp("cuda", 5)
    assert many.device.type == "cuda"
    assert many.shape == (5,)
    assert len(set(many.tolist())) == 1
    assert int(many[0]) >= int(first[0]) > 0
    with pytest.raises(ValueError, match="count"):
        ops.timestamp("cuda", 0)


@pytest.mark.cuda
@pytest.mark.parametrize("policy", list(ScorePolicy), ids=lambda p: p.name)
def test_cuda_index_equals_cpu_index(policy):
    """>= 10**7 keys per policy through two fused evicting tables: every per-key output and the
    whole index agree after every batch; insert_or_assign and erase batches in between."""
    evicted = _run_both(policy, CAPACITIES, WIDTHS, 10_000_000, 250_000)
    if policy is ScorePolicy.NO_EVICTION:
        assert evicted == 0
    else:
        assert evicted > 1_000_000


@pytest.mark.cuda
@pytest.mark.parametrize("widths", [[1024, 256], [2048, 256]], ids=["staged", "wider"])
@pytest.mark.parametrize("policy", list(ScorePolicy), ids=lambda p: p.name)
def test_cuda_wide_buckets_equal_cpu(policy, widths):
    """Buckets of 1024 and 256 slots (a cache's: a warp searches a shared-memory copy of each
    on CUDA) or 2048 (wider than the copy: the warp searches global memory), few of them, so
    each batch sends hundreds of keys to every bucket: outputs and index agree as above."""
    evicted = _run_both(policy, [1 << 13, 1 << 12], widths, 1_000_000, 50_000)
    if policy is not ScorePolicy.NO_EVICTION:
        assert evicted > 100_000


def _run_both(policy, capacities, widths, total, batch) -> int:
    """The batches of _batches through a CPU and a CUDA index, compared after every batch;
    returns how many keys evicted."""
    cpu = TableIndex.create(capacities, widths, [policy, policy])
    gpu = TableIndex.create(capacities, widths, [policy, policy], "cuda")
    evicted = 0
    for step, (keys, tids, args, counts) in enumerate(_batches(policy, total, batch, 1)):
        a = ops.find_or_insert(cpu, keys, tids, args, counts)
        b = ops.find_or_insert(gpu, keys.cuda(), tids.cuda(), args.cuda(), counts.cuda())
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y.cpu(), x, rtol=0, atol=0)
        evicted += int((a.status == InsertStatus.EVICTED).sum())
        sub = slice(0, 20_000)
        if step % 5 == 2:
            assign = torch.stack([keys[sub] % 97, keys[sub] % 89])[: cpu.score_words]
            a = ops.insert_or_assign(cpu, keys[sub], tids[sub], assign)
            b = ops.insert_or_assign(gpu, keys[sub].cuda(), tids[sub].cuda(), assign.cuda())
            for x, y in zip(a, b, strict=True):
                torch.testing.assert_close(y.cpu(), x, rtol=0, atol=0)
        if step % 5 == 4:
            a_freed = ops.erase(cpu, keys[sub], tids[sub])
            b_freed = ops.erase(gpu, keys[sub].cuda(), tids[sub].cuda())
            torch.testing.assert_close(b_freed.cpu(), a_freed, rtol=0, atol=0)
        lookups = ops.find(cpu, keys, tids, args, counts)
        torch.testing.assert_close(
            ops.find(gpu, keys.cuda(), tids.cuda(), args.cuda(), counts.cuda()).cpu(),
            lookups,
            rtol=0,
            atol=0,
        )
        _assert_same_index(cpu, gpu)
    return evicted


@pytest.mark.cuda
@pytest.mark.parametrize("policy", list(ScorePolicy), ids=lambda p: p.name)
def test_cuda_batches_found_whole_equal_cpu(policy):
    """Batches whose keys are all in the table (the CUDA op then skips its insert pass), with
    duplicates, then with one missing key at the end or an empty key (FAILED, not a hit):
    outputs, index and all_hit flags equal the CPU's, and only the missing key is inserted."""
    cpu = TableIndex.create(CAPACITIES, WIDTHS, [policy, policy])
    gpu = TableIndex.create(CAPACITIES, WIDTHS, [policy, policy], "cuda")
    g = torch.Generator().manual_seed(5)
    present = torch.randint(0, 10**9, (40_000,), generator=g).unique()
    tids = torch.randint(0, 2, present.shape, generator=g)
    args = torch.tensor([10, 20])
    ops.find_or_insert(cpu, present, tids, args)
    ops.find_or_insert(gpu, present.cuda(), tids.cuda(), args.cuda())
    sizes = cpu.sizes.clone()
    pick = torch.randint(0, present.numel(), (100_000,), generator=g)
    keys, ktids = present[pick], tids[pick]
    last_new = torch.cat([keys, torch.tensor([2 * 10**9])]), torch.cat([ktids, torch.tensor([1])])
    for step, (k, t) in enumerate([(keys, ktids), last_new, (keys, ktids)]):
        args = torch.tensor([11 + step, 21 + step])
        counts = torch.randint(0, 4, k.shape, generator=g)
        a, a_hit, _ = ops.find_or_insert_rows(cpu, k, t, args, counts)
        gk, gt, gc = k, t, counts
        if step == 2:  # the GPU batch also holds the empty key: FAILED, not a hit
            gk, gt, gc = (torch.cat([x, torch.tensor([v])]) for x, v in ((k, -1), (t, 0), (gc, 1)))
        b, b_hit, _ = ops.find_or_insert_rows(
            gpu, gk.cuda(), gt.cuda(), args.cuda(), gc.cuda(), check=False
        )
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y.cpu()[..., : a.slots.numel()], x, rtol=0, atol=0)
        _assert_same_index(cpu, gpu)
        assert int((a.status == InsertStatus.HIT).sum()) == keys.numel()
        assert (a_hit, b_hit) == [(True, True), (False, False), (True, False)][step]
        if step == 2:
            assert int(b.status[-1]) == InsertStatus.FAILED
            assert int(b.slots[-1]) == -1
    expected = sizes.clone()
    expected[1] += 1  # the one new key
    torch.testing.assert_close(cpu.sizes, expected, rtol=0, atol=0)


@pytest.mark.cuda
def test_cuda_find_or_insert_captured_in_a_graph_equals_cpu():
    """Captured into a CUDA graph (no sync there: both passes always run), find_or_insert
    replays like the CPU op: a batch of new keys, then the same batch again (all found)."""
    cpu = TableIndex.create(CAPACITIES, WIDTHS, [ScorePolicy.LFU] * 2)
    gpu = TableIndex.create(CAPACITIES, WIDTHS, [ScorePolicy.LFU] * 2, "cuda")
    g = torch.Generator().manual_seed(9)
    keys = torch.randint(0, 10**9, (50_000,), generator=g)
    tids = torch.randint(0, 2, keys.shape, generator=g)
    args = torch.tensor([3, 4])
    k, t, a = keys.cuda(), tids.cuda(), args.cuda()
    warm = TableIndex.create(CAPACITIES, WIDTHS, [ScorePolicy.LFU] * 2, "cuda")
    ops.find_or_insert(warm, k, t, a)  # loads the kernels before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, all_hit, _ = ops.find_or_insert_rows(gpu, k, t, a, check=False)
    assert not all_hit  # not known while captured
    torch.testing.assert_close(gpu.sizes.cpu(), torch.zeros(2, dtype=torch.int64))
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        expected = ops.find_or_insert(cpu, keys, tids, args)
        for x, y in zip(expected, captured, strict=True):
            torch.testing.assert_close(y.cpu(), x, rtol=0, atol=0)
        _assert_same_index(cpu, gpu)
    assert bool((expected.status == InsertStatus.HIT).all())


@pytest.mark.cuda
def test_cuda_rehash_equals_cpu_rehash():
    cpu = TableIndex.create(CAPACITIES, WIDTHS, [ScorePolicy.LFU, ScorePolicy.TIMESTAMP_LFU])
    gpu = TableIndex.create(
        CAPACITIES, WIDTHS, [ScorePolicy.LFU, ScorePolicy.TIMESTAMP_LFU], "cuda"
    )
    for keys, tids, args, counts in _batches(ScorePolicy.LFU, 400_000, 100_000, 2):
        ops.find_or_insert(cpu, keys, tids, args, counts)
        ops.find_or_insert(gpu, keys.cuda(), tids.cuda(), args.cuda(), counts.cuda())
    for t in (0, 1):
        cpu, old_a, new_a = ops.rehash(cpu, t, 2 * cpu.capacities[t])
        gpu, old_b, new_b = ops.rehash(gpu, t, 2 * gpu.capacities[t])
        torch.testing.assert_close(old_b.cpu(), old_a, rtol=0, atol=0)
        torch.testing.assert_close(new_b.cpu(), new_a, rtol=0, atol=0)
    _assert_same_index(cpu, gpu)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "strategy",
    [
        ScoreStrategy.TIMESTAMP,
        ScoreStrategy.STEP,
        ScoreStrategy.LFU,
        ScoreStrategy.NO_EVICTION,
        (ScoreStrategy.LFU, ScoreStrategy.TIMESTAMP),
    ],
    ids=str,
)
def test_cuda_scored_table_equals_cpu_scored_table(strategy):
    """Growth, value moves and evictions agree; timestamps come from one shared fake clock."""
    configs = [
        TableConfig(dim=32, max_capacity=1 << 15, init_capacity=1 << 11, score_strategy=strategy),
        TableConfig(
            dim=16,
            state_dim=16,
            max_capacity=1 << 13,
            init_capacity=1 << 13,
            bucket_capacity=32,
            dtype=torch.bfloat16,
            score_strategy=strategy,
        ),
    ]
    ticks = iter(range(10**6))
    now = [0]

    def clock_for(device: str):
        return lambda: torch.tensor([now[0]], device=device)

    tables = {d: ScoredHashTable(configs, d, clock=clock_for(d)) for d in ("cpu", "cuda")}
    for keys, tids, _, counts in _batches(ScorePolicy.LFU, 1_000_000, 50_000, 3):
        now[0] = next(ticks)
        out = {}
        for d, table in tables.items():
            o = table.find_or_insert(keys.to(d), tids.to(d), counts=counts.to(d))
            for t in range(2):
                new = (o.status.cpu() != InsertStatus.HIT) & (o.slots.cpu() >= 0) & (tids == t)
                rows = (keys[new] % 200).to(torch.float32).unsqueeze(1).expand(-1, configs[t].width)
                table.write(t, o.slots[new.to(d)], rows.to(d))
            out[d] = o
        torch.testing.assert_close(out["cuda"].slots.cpu(), out["cpu"].slots, rtol=0, atol=0)
    for t in range(2):
        a, b = tables["cpu"].export(t), tables["cuda"].export(t)
        assert tables["cpu"].capacity(t) == tables["cuda"].capacity(t)
        for name, x, y in zip(a._fields, a, b, strict=True):
            if x is None or y is None:  # a field of split exports only
                assert (x, y) == (None, None), name
                continue
            torch.testing.assert_close(y.cpu(), x, rtol=0, atol=0)
        # every stored row still holds its own key: values moved with their keys
        torch.testing.assert_close(
            a.values[:, 0].to(torch.float32), (a.keys % 200).to(torch.float32), rtol=0, atol=0
        )


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("keys", "tids", "message"),
    [
        ([5, -1], [0, 0], "empty-key sentinel"),
        ([5, 6], [0, 2], "table_ids"),
    ],
)
def test_cuda_bad_input_is_named(keys, tids, message):
    index = TableIndex.create(CAPACITIES, WIDTHS, [ScorePolicy.STEP] * 2, "cuda")
    k = torch.tensor(keys, device="cuda")
    t = torch.tensor(tids, device="cuda")
    with pytest.raises(ValueError, match=message):
        ops.find_or_insert(index, k, t, torch.tensor([1, 1], device="cuda"))
    with pytest.raises(ValueError, match=message):
        ops.find(index, k, t)
    # unchecked, the kernels skip the bad entries instead of writing out of bounds
    res = ops.find_or_insert(index, k, t, torch.tensor([1, 1], device="cuda"), check=False)
    assert res.status.tolist()[1] == InsertStatus.FAILED
    assert int(index.sizes.sum()) == 1


@pytest.mark.cuda
def test_cuda_find_or_insert_rows_equals_cpu():
    """The gather queued before the all-found read-back: rows, outputs and index equal the
    CPU op's for a batch of present keys (rows read) and one with a new key (rows None, as
    while the stream is captured into a CUDA graph)."""
    cpu = TableIndex.create(CAPACITIES, WIDTHS, [ScorePolicy.LFU] * 2)
    gpu = TableIndex.create(CAPACITIES, WIDTHS, [ScorePolicy.LFU] * 2, "cuda")
    g = torch.Generator().manual_seed(13)
    present = torch.randint(0, 10**9, (30_000,), generator=g).unique()
    tids = torch.randint(0, 2, present.shape, generator=g)
    ops.find_or_insert(cpu, present, tids, torch.tensor([1, 2]))
    ops.find_or_insert(gpu, present.cuda(), tids.cuda(), torch.tensor([1, 2]).cuda())
    values = [torch.randn(c, 132, generator=g) for c in CAPACITIES]
    on_gpu = [v.cuda() for v in values]
    inverse = torch.randint(0, present.numel(), (90_000,), generator=g)
    new = torch.cat([present, torch.tensor([2 * 10**9])]), torch.cat([tids, torch.tensor([1])])
    for step, (k, t) in enumerate([(present, tids), new]):
        args = torch.tensor([3 + step, 4 + step])
        a = ops.find_or_insert_rows(cpu, k, t, args, gather=ops.RowGather(values, inverse, 128))
        b = ops.find_or_insert_rows(
            gpu, k.cuda(), t.cuda(), args.cuda(), gather=ops.RowGather(on_gpu, inverse.cuda(), 128)
        )
        for x, y in zip(a[0], b[0], strict=True):
            torch.testing.assert_close(y.cpu(), x, rtol=0, atol=0)
        _assert_same_index(cpu, gpu)
        assert a[1] == b[1] == (step == 0)
        if step == 0:
            assert torch.equal(b[2].cpu(), a[2])
        else:
            assert a[2] is None
            assert b[2] is None
    k, t, args, inv = present.cuda(), tids.cuda(), torch.tensor([5, 6]).cuda(), inverse.cuda()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, all_hit, rows = ops.find_or_insert_rows(
            gpu, k, t, args, gather=ops.RowGather(on_gpu, inv, 128), check=False
        )
    assert not all_hit
    assert rows is None
