"""A TorchRec EmbeddingCollection of dynamic tables, planned by DynamicEmbeddingShardingPlanner and
sharded row-wise by DynamicEmbeddingCollectionSharder under DistributedModelParallel on 1, 2 and
4 CPU ranks over gloo (each rank a process): every rank's output rows, over several training
steps, equal (on one rank exactly, on more up to the rounding of the gradient sums' order) those
of one unsharded DynamicEmbeddingTables fed the global batch (all ranks' samples) and the global
gradients (divided by the world size, as TorchRec's all-to-alls do): routing, the all-to-alls
and the fused update lose and reorder nothing. The EmbeddingCollection's ids are deduplicated
before the all-to-all (fewer ids reach the lookups than the batch holds), and every key's LFU
score still equals its occurrences in the global batches."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from demb_torchrec import DynamicEmbeddingTables, DynamicEmbPoolingMode

RANK_SCRIPT = Path(__file__).with_name("_sharded_ec_rank.py")
CLOSE = {"rtol": 1e-5, "atol": 1e-6}  # other summation orders


def _rank_module() -> SimpleNamespace:
    """The rank script's batches and constants (its ``main`` is not run)."""
    return SimpleNamespace(**runpy.run_path(str(RANK_SCRIPT)))


def reference_outputs(
    world: int, options, optimizer: str, kind: str = "ec", module_out: list | None = None
) -> list[list[list[torch.Tensor]]]:
    """Per step, per rank, what that rank's sharded collection should output: the rows (per
    feature, ``ec``) or the bags (``ebc-*``) one unsharded module gives the global batch (every
    feature's samples of rank 0, then of rank 1, ...). ``module_out`` receives the module."""
    ranks = _rank_module()
    modes = {
        "ec": DynamicEmbPoolingMode.NONE,
        "ebc-sum": DynamicEmbPoolingMode.SUM,
        "ebc-mean": DynamicEmbPoolingMode.MEAN,
    }
    clip = {"gradient_clipping": True, "max_gradient": ranks.CLIP}
    module = DynamicEmbeddingTables(
        options,
        table_names=[t[0] for t in ranks.TABLES],
        pooling_mode=modes[kind],
        device="cpu",
        optimizer=optimizer.removesuffix("-clip"),
        learning_rate=0.1,
        **(clip if optimizer.endswith("-clip") else {}),
    )
    features = range(len(ranks.TABLES))
    per_step = []
    for step in range(ranks.STEPS):
        batches = [ranks.batch(step, r) for r in range(world)]
        lengths = [batches[r][0][f] for f in features for r in range(world)]
        values = [batches[r][1][f] for f in features for r in range(world)]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat(lengths).cumsum(0)])
        out = module(torch.cat(values), offsets)
        if kind == "ec":
            counts = [v.numel() for v in values]
            pieces = list(out.split(counts))
            grads = [
                ranks.gradient(step, r, f, counts[f * world + r], ranks.TABLES[f][2])
                for f in features
                for r in range(world)
            ]
            got = [[pieces[f * world + r].detach() for f in features] for r in range(world)]
        else:  # (B * world, sum of dims): rank r's bags are rows [r * B, (r + 1) * B)
            batch = ranks.BATCH
            grads = [ranks.gradient(step, r, 0, batch, out.shape[1]) for r in range(world)]
            got = [[out[r * batch : (r + 1) * batch].detach()] for r in range(world)]
        # TorchRec's all-to-alls divide gradients by the world size (comm_ops.GRADIENT_DIVISION,
        # on by default), as DDP averages dense gradients: the global gradient of the step.
        torch.autograd.backward([out], [torch.cat(grads) / world])
        per_step.append(got)
    if module_out is not None:
        module_out.append(module)
    return per_step


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("world", "dist_type", "optimizer"),
    [
        (1, "roundrobin", "sgd"),
        (2, "roundrobin", "adam"),
        # hash_roundrobin routing also runs by default in the replay and mixed-model rank tests
        pytest.param(2, "hash_roundrobin", "sgd", marks=pytest.mark.slow),
        (2, "continuous", "sgd"),
        pytest.param(4, "continuous", "sgd", marks=pytest.mark.slow),
        (2, "roundrobin", "sgd-clip"),
    ],
)
def test_sharded_rows_equal_one_unsharded_module(run_ranks, world, dist_type, optimizer):
    """``sgd-clip``: gradient_clipping / max_gradient given to the sharder reach the tables and
    clip each occurrence's gradient as the unsharded module does (so ids are not deduplicated
    before the all-to-all then)."""
    results = run_ranks(RANK_SCRIPT, world, dist_type, optimizer, "ec")
    capacity = -(-1000 // world)
    assert results[0]["options"][0].max_capacity == -(-capacity // 128) * 128  # per rank
    # On one rank exactly. On more, a key's gradient is summed per sending rank first (its
    # deduplicated occurrences), then across ranks: equal up to the rounding of that order.
    exact = {"rtol": 0.0, "atol": 0.0} if world == 1 else {"rtol": 1e-6, "atol": 1e-7}
    check_rows(results, world, optimizer, exact)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("world", "optimizer"),
    [
        pytest.param(1, "sgd", marks=pytest.mark.slow),  # 1 rank: test_admission_module.py
        (2, "adam"),
        pytest.param(4, "sgd", marks=pytest.mark.slow),
    ],
)
def test_sharded_admission_equals_one_unsharded_module(run_ranks, world, optimizer):
    """Frequency admission (threshold 2) on every table: each owner rank counts the keys it
    receives with the frequencies the input dist's dedup carries, so the keys admitted, the rows
    (rejected keys read their initial row and train nothing) and the LFU scores equal one
    unsharded module's step for step."""
    results = run_ranks(RANK_SCRIPT, world, "roundrobin", optimizer, "ec-admit")
    assert results[0]["options"][0].admit_strategy is not None
    ranks = _rank_module()
    for f, (name, *_) in enumerate(ranks.TABLES):  # admission kept some keys out
        sent = {
            k
            for step in range(ranks.STEPS)
            for r in range(world)
            for k in ranks.batch(step, r)[1][f].tolist()
        }
        held = {k for res in results for k in res["tables"][name][0].tolist()}
        assert held < sent, name
    exact = {"rtol": 0.0, "atol": 0.0} if world == 1 else {"rtol": 1e-6, "atol": 1e-7}
    check_rows(results, world, optimizer, exact)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("world", "optimizer"),
    [
        pytest.param(1, "sgd", marks=pytest.mark.slow),
        (2, "adam"),
        pytest.param(4, "rowwise_adagrad", marks=pytest.mark.slow),
    ],
)
def test_sharded_caching_equals_one_unsharded_module(run_ranks, world, optimizer):
    """Every table a cache of 16 rows per rank over its host table: the keys move
    between the tiers (and overflow the cache), yet each step's rows and the keys, rows and
    scores across both tiers equal one all-device unsharded module's."""
    results = run_ranks(RANK_SCRIPT, world, "roundrobin", optimizer, "ec-cache")
    assert results[0]["options"][0].caching
    row = results[0]["options"][0].local_hbm_for_values // 16
    assert row in (8 * 4, 8 * 4 * 3, (8 + 4) * 4), row  # 16 rows of SGD, Adam, row-wise Adagrad
    moved = [
        (st["write_backs"], st["storage_hits"], st["overflows"])
        for res in results
        for per_kernel in res["cache_stats"]
        for st in per_kernel.values()
    ]
    assert sum(m[0] for m in moved) > 0, moved  # the caches wrote rows back
    if world <= 2:  # (over 4 ranks, 3 steps bring no evicted key back)
        assert sum(m[1] for m in moved) > 0, moved  # and read some back
    exact = {"rtol": 0.0, "atol": 0.0} if world == 1 else {"rtol": 1e-6, "atol": 1e-7}
    check_rows(results, world, optimizer, exact)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_torchrec_prefetch_pipeline_prefetches_caching_tables(run_ranks, world):
    """The caching tables of ``ec-cache`` trained by TorchRec's PrefetchTrainPipelineSparseDist
    (each next batch prefetched between a step's forward and its backward, through the
    sharded collection's lookups): the storage hits come from the prefetch, and the rows and
    scores still equal one all-device unsharded module's."""
    results = run_ranks(RANK_SCRIPT, world, "roundrobin", "adam", "ec-cache-pipeline")
    ranks = _rank_module()
    assert all(len(res["outputs"]) == ranks.STEPS for res in results)
    counted = [
        st for res in results for per_kernel in res["cache_stats"] for st in per_kernel.values()
    ]
    assert sum(st["prefetched"] for st in counted) > 0, counted
    exact = {"rtol": 0.0, "atol": 0.0} if world == 1 else {"rtol": 1e-6, "atol": 1e-7}
    check_rows(results, world, "adam", exact)


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_sharded_hybrid_tables_equal_one_unsharded_module(run_ranks, world):
    """Hybrid tables (16 rows a rank on the device, the rest in host memory: on the CPU one
    kind of memory) train like one all-device unsharded module."""
    results = run_ranks(RANK_SCRIPT, world, "roundrobin", "adam", "ec-hybrid")
    options = results[0]["options"][0]
    assert not options.caching
    assert options.local_hbm_for_values == 16 * (8 + 16) * 4
    exact = {"rtol": 0.0, "atol": 0.0} if world == 1 else {"rtol": 1e-6, "atol": 1e-7}
    check_rows(results, world, "adam", exact)


@pytest.mark.multiproc
@pytest.mark.parametrize(
    ("world", "kind", "optimizer"),
    [
        pytest.param(1, "ebc-sum", "sgd", marks=pytest.mark.slow),  # 1 rank: the train job test
        (2, "ebc-sum", "adam"),
        pytest.param(2, "ebc-mean", "sgd", marks=pytest.mark.slow),
    ],
)
def test_sharded_bags_equal_one_unsharded_module(run_ranks, world, kind, optimizer):
    results = run_ranks(RANK_SCRIPT, world, "roundrobin", optimizer, kind)
    # On one rank a bag is summed in bag order, as the unsharded module does. On more, each
    # rank sums the bag's keys it owns and the partial sums are added (TorchRec's
    # reduce-scatter), then MEAN divides (TorchRec's callback): equal up to rounding.
    exact = world == 1 and kind == "ebc-sum"
    check_bags(results, world, kind, optimizer, {"rtol": 0.0, "atol": 0.0} if exact else CLOSE)


@pytest.mark.cuda
@pytest.mark.multiproc
def test_torchrec_prefetch_pipeline_on_a_gpu(run_ranks):
    """The same on one GPU over NCCL: TorchRec's pipeline runs its prefetch on a stream of its
    own and the tables read the storage on theirs; equal up to float rounding."""
    results = run_ranks(RANK_SCRIPT, 1, "roundrobin", "adam", "ec-cache-pipeline", "cuda")
    counted = [st for per_kernel in results[0]["cache_stats"] for st in per_kernel.values()]
    assert sum(st["prefetched"] for st in counted) > 0, counted
    check_rows(results, 1, "adam", CLOSE)


GPU_CASES = [
    *[("ec", o) for o in ("sgd", "adagrad", "rowwise_adagrad", "adam")],
    *[("ebc-sum", o) for o in ("sgd", "adagrad", "rowwise_adagrad", "adam")],
    ("ebc-mean", "sgd"),
    ("ebc-mean", "adam"),
]


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize(("kind", "optimizer"), GPU_CASES)
def test_sharded_on_gpus_equals_one_unsharded_module(run_ranks, world, kind, optimizer):
    """The same on ``world`` GPUs over NCCL (one process per GPU), against the unsharded
    module on the CPU: equal up to float rounding (GPU sums in other orders)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, {torch.cuda.device_count()} visible")
    results = run_ranks(RANK_SCRIPT, world, "roundrobin", optimizer, kind, "cuda")
    if kind == "ec":
        check_rows(results, world, optimizer, CLOSE)
    else:
        check_bags(results, world, kind, optimizer, CLOSE)


def _unsharded(results: list) -> list:
    """The tables' options for one all-device module (no cache tier)."""
    flat = {"caching": False, "global_hbm_for_values": 0, "local_hbm_for_values": 0}
    return [
        type(o)(**{**o.__dict__, "max_capacity": 2048, "init_capacity": None, **flat})
        for o in results[0]["options"]
    ]


def check_rows(results: list, world: int, optimizer: str, tol: dict) -> None:
    """Every rank's rows per step against the unsharded module's; fewer ids reached the
    lookups than were sent (deduplicated) unless the tables clip; each key's LFU score equals
    its occurrences, on one rank only."""
    modules: list[DynamicEmbeddingTables] = []
    want = reference_outputs(world, _unsharded(results), optimizer, module_out=modules)
    for step, per_rank in enumerate(want):
        for r in range(world):
            got = results[r]["outputs"][step]
            for f, (g, w) in enumerate(zip(got, per_rank[r], strict=True)):
                torch.testing.assert_close(g, w, **tol, msg=f"step {step} rank {r} feature {f}")
    ranks = _rank_module()
    sent = sum(
        int(ranks.batch(step, r)[0][f].sum())
        for step in range(ranks.STEPS)
        for r in range(world)
        for f in range(len(ranks.TABLES))
    )
    received = sum(sum(res["received"]) for res in results)
    assert 0 < received < sent if optimizer != "sgd-clip" else received == sent
    for t, name in enumerate(modules[0].table_names):
        ref = modules[0].tables.export(t)
        want_scores = dict(zip(ref.keys.tolist(), ref.scores[:, 0].tolist(), strict=True))
        got_scores: dict[int, int] = {}
        for res in results:
            keys, scores = res["tables"][name]
            for k, c in zip(keys.tolist(), scores[:, 0].tolist(), strict=True):
                assert k not in got_scores, f"table {name}: key {k} on two ranks"
                got_scores[k] = c
        assert got_scores == want_scores, name


def check_bags(results: list, world: int, kind: str, optimizer: str, tol: dict) -> None:
    """Every rank's bags per step against the unsharded module's."""
    want = reference_outputs(world, _unsharded(results), optimizer, kind)
    for step, per_rank in enumerate(want):
        for r in range(world):
            (got,) = results[r]["outputs"][step]
            torch.testing.assert_close(got, per_rank[r][0], **tol, msg=f"step {step} rank {r}")


def test_torchrec_index_dedup_over_dynamic_tables_is_refused():
    from demb_torchrec.input_dist import DynamicRwSparseFeaturesDist
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed.types import ParameterSharding, ShardingEnv

    config = EmbeddingConfig(name="a", embedding_dim=8, num_embeddings=10, feature_names=["f"])
    ec = EmbeddingCollection(tables=[config], device=torch.device("meta"))
    params = {"a": ParameterSharding("row_wise", "customized_kernel", ranks=[0])}
    sharder = DynamicEmbeddingCollectionSharder(use_index_dedup=True)
    with pytest.raises(ValueError, match=r"use_index_dedup=True.*\['a'\]"):
        sharder.shard(ec, params, ShardingEnv(1, 0, None))
    with pytest.raises(ValueError, match="dedup: only a sequence dist"):
        DynamicRwSparseFeaturesDist(None, 1, "roundrobin", [10], is_sequence=False, dedup=True)


@pytest.mark.parametrize("is_sequence", [True, False], ids=["sequence", "pooled"])
def test_a_kjt_of_float_ids_is_a_type_error_naming_the_values(is_sequence):
    """As the module refuses float indices, the sharded collections' input dist refuses a KJT
    whose values are not int64 / int32, before any routing (InputTypeError naming them)."""
    import torch.distributed as dist
    from demb_torchrec import InputTypeError
    from demb_torchrec.input_dist import DynamicRwSparseFeaturesDist
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)  # one rank, no default group
    input_dist = DynamicRwSparseFeaturesDist(group, 1, "roundrobin", [10], is_sequence)
    floats = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([1.0, 2.0]), lengths=torch.tensor([1, 1])
    )
    with pytest.raises(InputTypeError, match=r"ids of features \['f'\] must be int64") as bad:
        input_dist(floats)
    assert bad.value.argument == "values"
