"""``demb bench dlrm``: a DistributedModelParallel train step of a DLRM-like model whose 26 sparse
features are dynamic tables.

TorchRec's ``DLRM`` (13 dense features through a bottom MLP, the 26 pooled embeddings, their
pairwise interactions, a top MLP, BCE loss) over an ``EmbeddingBagCollection`` of 26 dynamic
tables, D=128, sized like Criteo Kaggle's categorical features (33.8M rows in all; scaled on the
CPU), one id per sample and feature drawn from a power law (alpha 1.05) over each table's rows.
Planned by ``DynamicEmbeddingShardingPlanner`` (row-wise, ``roundrobin``), sparse tables trained
by ``apply_optimizer_in_backward`` (Adam), the dense part by Adam. One process per rank (gloo on
the CPU, NCCL on GPUs; on the CPU forked from a server process that imports TorchRec once for
every run); a step is forward, backward and the dense optimizer's step, timed between
synchronizations on every rank (a barrier). Rank 0 prints and writes the medians.

:func:`run_scaling` runs it at several world sizes in turn (the batch per rank fixed: weak
scaling) and sets each one's samples/s beside ``W`` times the same run's 1-rank samples/s; their
ratio is the scaling efficiency.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from demb_torchrec.bench._ranks import finish_rank, init_rank, machine, spawn_ranks
from demb_torchrec.bench.compare import Comparison, check_counts, print_comparisons
from demb_torchrec.bench.workload import power_law_ids

__all__ = ["CRITEO_ROWS", "DlrmWorkload", "describe", "run", "run_scaling", "scaling"]

CRITEO_ROWS = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27,
    14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Rows of Criteo Kaggle's 26 categorical features."""
_PRELOAD = (
    "torchrec",
    "torchrec.distributed.model_parallel",
    "torchrec.models.dlrm",
    "demb_torchrec.planner",
    "demb_torchrec.sharders",
)
"""What a rank imports that takes long: imported once for every run of :func:`run` (CPU only)."""


@dataclass(frozen=True)
class DlrmWorkload:
    """The benchmark's shape."""

    world_size: int = 1
    batch_size: int = 8192
    """Samples per rank and step."""
    dim: int = 128
    scale: float = 1.0
    """Table rows times this (at least 16 each)."""
    alpha: float = 1.05
    steps: int = 20
    warmup: int = 5

    def __post_init__(self) -> None:
        check_counts(self, *("world_size", "batch_size", "dim", "steps"))
        check_counts(self, "warmup", minimum=0)
        if not self.scale > 0 or not self.alpha > 1:
            raise ValueError(f"scale={self.scale!r} must be > 0 and alpha={self.alpha!r} > 1")

    def rows(self) -> list[int]:
        return [max(16, round(r * self.scale)) for r in CRITEO_ROWS]


def _batch(w: DlrmWorkload, rank: int, step: int, device: torch.device) -> tuple[Any, ...]:
    from torchrec import KeyedJaggedTensor

    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    ids = [power_law_ids(gen, w.batch_size, rows, w.alpha) for rows in w.rows()]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(len(ids))],
        values=torch.cat(ids),
        lengths=torch.ones(len(ids) * w.batch_size, dtype=torch.int32),
    )
    dense = torch.randn(w.batch_size, 13, generator=gen)
    labels = torch.randint(0, 2, (w.batch_size,), generator=gen).float()
    return dense.to(device), kjt.to(device), labels.to(device)


def _rank(rank: int, w: DlrmWorkload, store_path: str, out: str | None) -> None:
    import torchrec.optim as trec_optim
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from demb_torchrec.capacity import get_table_value_bytes
    from demb_torchrec.constraints import DynamicEmbParameterConstraints
    from demb_torchrec.options import DynamicEmbTableOptions
    from demb_torchrec.planner import DynamicEmbeddingShardingPlanner
    from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder

    device = init_rank(rank, w.world_size, store_path)
    on_gpu = device.type == "cuda"
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=w.dim, num_embeddings=rows, feature_names=[f"f{i}"]
        )
        for i, rows in enumerate(w.rows())
    ]
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(ebc, 13, [512, 256, w.dim], [1024, 1024, 512, 256, 1], dense_device=device)
    apply_optimizer_in_backward(trec_optim.Adam, model.sparse_arch.parameters(), {"lr": 1e-3})
    constraints = {  # every value row in device memory (the spec's sizing: 0 keeps none)
        c.name: DynamicEmbParameterConstraints(
            use_dynamicemb=True,
            dynamicemb_options=DynamicEmbTableOptions(
                global_hbm_for_values=get_table_value_bytes(c, "adam", w.world_size)
            ),
        )
        for c in configs
    }
    sharder = DynamicEmbeddingBagCollectionSharder()
    pg = dist.GroupMember.WORLD
    planner = DynamicEmbeddingShardingPlanner(
        configs,
        # TorchRec's default topology assumes 32 GB of HBM: give it the device's own
        Topology(
            world_size=w.world_size,
            compute_device=device.type,
            **(
                {"hbm_cap": torch.cuda.get_device_properties(device).total_memory} if on_gpu else {}
            ),
        ),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], pg)
    dmp = DistributedModelParallel(
        model, env=ShardingEnv.from_process_group(pg), plan=plan, sharders=[sharder], device=device
    )
    dense_params = [p for n, p in dmp.named_parameters() if "sparse_arch" not in n]
    dense_opt = torch.optim.Adam(dense_params, lr=1e-3)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    batches = [_batch(w, rank, s, device) for s in range(4)]
    times = []
    for step in range(w.warmup + w.steps):
        dense, kjt, labels = batches[step % len(batches)]
        dist.barrier()
        if on_gpu:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        loss = loss_fn(dmp(dense, kjt).squeeze(1), labels)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        if on_gpu:
            torch.cuda.synchronize(device)
        dist.barrier()
        if step >= w.warmup:
            times.append(time.perf_counter() - start)
    report = None
    if rank == 0:
        step_ms = statistics.median(times) * 1e3
        report = {
            "workload": asdict(w),
            "table_rows": w.rows(),
            **machine(device),
            "step_ms": step_ms,
            "samples_per_s": w.batch_size * w.world_size / (step_ms / 1e3),
            "last_loss": float(loss),
        }
    finish_rank(report, out)


def run(w: DlrmWorkload) -> dict[str, Any]:
    """Run the benchmark on ``w.world_size`` local ranks (one GPU each when CUDA is visible);
    returns rank 0's report.

    Raises:
        ValueError: more ranks than visible GPUs.
    """
    return spawn_ranks(_rank, w, w.world_size, preload=_PRELOAD)


def describe(report: dict[str, Any]) -> str:
    """One line for a report of :func:`run`: the ranks, the tables, the step time, samples/s."""
    w = report["workload"]
    return (
        f"dlrm on {report['device']} x {w['world_size']} ({report['backend']}): 26 dynamic "
        f"tables ({sum(report['table_rows']):,} rows, D={w['dim']}), batch {w['batch_size']} "
        f"per rank: {report['step_ms']:.3f} ms per step, {report['samples_per_s']:,.0f} samples/s"
    )


def scaling(reports: Sequence[dict[str, Any]]) -> list[Comparison]:
    """Each report's samples/s beside ``W`` times the 1-rank report's (``W`` its world size):
    the ratio is the weak-scaling efficiency.

    Raises:
        ValueError: no report of world size 1.
    """
    one = [r for r in reports if r["workload"]["world_size"] == 1]
    if not one:
        raise ValueError("scaling needs a report of world size 1")
    base = one[0]["samples_per_s"]
    return [
        Comparison(
            f"world size {r['workload']['world_size']}",
            r["samples_per_s"],
            r["workload"]["world_size"] * base,
            "samples/s",
            "W x 1 rank's samples/s",
        )
        for r in reports
    ]


def run_scaling(w: DlrmWorkload, world_sizes: Sequence[int]) -> dict[str, Any]:
    """Run ``w`` at each of ``world_sizes`` in turn (``w.world_size`` ignored), printing each
    run's line, then a table of each world size's samples/s beside ``W`` times the 1-rank
    figure and the efficiency; returns every run's report and the scaling rows.

    Raises:
        ValueError: ``world_sizes`` lacks 1 or repeats a size, or has more ranks than GPUs.
    """
    if 1 not in world_sizes or len(set(world_sizes)) != len(world_sizes):
        raise ValueError(f"world_sizes={list(world_sizes)}: must hold 1, each size once")
    gpus = torch.cuda.device_count()
    if gpus and max(world_sizes) > gpus:  # before any run, not after the first ones
        raise ValueError(f"world_sizes={list(world_sizes)}: only {gpus} GPUs are visible")
    reports = []
    for size in world_sizes:
        reports.append(run(replace(w, world_size=size)))
        print(describe(reports[-1]))
    comparisons = scaling(reports)
    print_comparisons(
        f"weak scaling (batch {w.batch_size} per rank): samples/s at W ranks beside W x 1 rank's, "
        "the ratio is the efficiency",
        comparisons,
    )
    rows = [
        {
            "world_size": r["workload"]["world_size"],
            "step_ms": r["step_ms"],
            "samples_per_s": c.figure,
            "w_times_one_rank_samples_per_s": c.baseline,
            "efficiency": c.ratio,
        }
        for r, c in zip(reports, comparisons, strict=True)
    ]
    return {
        "benchmark": "dlrm_scaling",
        "world_sizes": list(world_sizes),
        "device": reports[0]["device"],
        "backend": reports[0]["backend"],
        "reports": reports,
        "scaling": rows,
        "comparisons": [c.as_dict() for c in comparisons],
    }
