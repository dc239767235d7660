"""``demb bench soak``: memory over a long training run of a model that evicts on every step,
beside the same run's eval-mode forwards (known flat) as the baseline.

The model is the two-table evicting model of the training-memory tests: tables ``user`` and
``item`` of ``capacity`` slots each (dims 16 and 16), SUM pooling, adam, ids drawn from
``10**6``, batches of ``batch`` samples with bags of ``bag`` ids per feature: once the tables
are full, nearly every id of a batch evicts a row. After ``warmup`` training steps (which fill
the tables), the baseline phase runs ``warmup`` eval forwards (``model.eval()``, no grad, no
backward) then ``steps`` more, sampling every ``every``; the training phase then runs
``warmup`` training steps (forward + backward with the fused update) then ``steps`` more,
sampling the same way. A sample is taken after ``gc.collect()`` (and, on CUDA,
``torch.cuda.synchronize()``): the process's resident memory (``/proc/self/statm``) and, on
CUDA, ``torch.cuda.memory_allocated()`` and ``memory_reserved()``, all in MB (2**20 bytes).

Growth is the least-squares slope of a phase's samples, in MB per 1,000 steps, and its total
growth from the first sample to the last; each training figure is printed beside the eval
phase's with their difference (slopes near zero make ratios meaningless).

With ``dump_every`` N > 0 the training phase also writes the model with
:func:`~demb_torchrec.DynamicEmbDump` (``optim=True``) into a temporary folder every N steps,
loads it with :func:`~demb_torchrec.DynamicEmbLoad` into a second model of the same layout
(emptied first) and checks that each table's export (keys, values with optimizer state, scores;
sorted by key) is bit-identical; one more round trip runs before the phase's warm-up (its first
imports and allocations are not growth), and a sample at a round trip's step is taken before
it (every sample follows training steps). The count of exact round trips is reported; an
inexact one fails ``demb bench soak``.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from demb_torchrec._quiet import quiet_import
from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.bench.compare import check_counts, machine_info
from demb_torchrec.bench.module_bench import build, prefill
from demb_torchrec.bench.workload import Workload, all_on_device, make_batches
from demb_torchrec.dump import DynamicEmbDump, DynamicEmbLoad
from demb_torchrec.options import DynamicEmbPoolingMode, DynamicEmbTableOptions

__all__ = ["SoakWorkload", "growth", "memory_sample", "round_trip_mismatch", "run", "slope"]

_MB = 2**20
_MODELS = ("evicting", "reference")
_REFERENCE_BATCHES = 8
_LABELS = {"rss_mb": "RSS", "allocated_mb": "allocated", "reserved_mb": "reserved"}


@dataclass(frozen=True)
class SoakWorkload:
    """A soak run: ``steps`` sampled steps per phase after ``warmup``, a sample every
    ``every``; a dump/load round trip every ``dump_every`` training steps (0: none)."""

    steps: int = 10_000
    warmup: int = 500
    every: int = 1_000
    dump_every: int = 0
    dims: tuple[int, int] = (16, 16)
    capacity: int = 4096
    batch: int = 256
    bag: int = 2
    id_space: int = 10**6
    optimizer: str = "adam"
    seed: int = 0
    model: str = "evicting"
    """``evicting``: the two-table model above; ``reference``: the reference workload of
    ``demb bench module`` (10 prefilled tables of D=128, power-law batches; no eviction),
    rows and samples times ``scale``."""
    scale: float = 1.0

    def __post_init__(self) -> None:
        check_counts(self, "steps", "every", "capacity", "batch", "bag", "id_space")
        check_counts(self, "warmup", "dump_every", minimum=0)
        if self.model not in _MODELS:
            raise ValueError(f"model={self.model!r}: must be one of {_MODELS}")
        if self.model == "reference" and self.dump_every:
            raise ValueError("dump_every: round trips run on the evicting model only")
        if not self.scale > 0:
            raise ValueError(f"scale={self.scale!r}: must be > 0")
        if len(self.dims) != 2 or any(d < 1 for d in self.dims):
            raise ValueError(f"dims={self.dims!r}: must be two positive dims")
        if self.every > self.steps:
            raise ValueError(f"every={self.every}: must be <= steps={self.steps}")

    def as_dict(self) -> dict[str, Any]:
        """The workload as JSON fields."""
        return {**asdict(self), "dims": list(self.dims)}


def _model(w: SoakWorkload, device: torch.device) -> DynamicEmbeddingTables:
    if w.model == "reference":
        reference = Workload().scaled(w.scale)
        module = build(reference, device)
        prefill(module, reference)
        return module
    options = [
        DynamicEmbTableOptions(
            dim=d,
            max_capacity=w.capacity,
            init_capacity=w.capacity,
            local_hbm_for_values=all_on_device(d, w.capacity, w.optimizer),
        )
        for d in w.dims
    ]
    return DynamicEmbeddingTables(
        options,
        table_names=["user", "item"],
        pooling_mode=DynamicEmbPoolingMode.SUM,
        device=device,
        optimizer=w.optimizer,
    )


def memory_sample(step: int, device: torch.device) -> dict[str, float]:
    """After ``gc.collect()`` (and a CUDA synchronize): the process's resident MB and, on
    CUDA, the allocator's allocated and reserved MB; ``step`` included."""
    gc.collect()
    sample = {"step": float(step)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        sample["allocated_mb"] = torch.cuda.memory_allocated(device) / _MB
        sample["reserved_mb"] = torch.cuda.memory_reserved(device) / _MB
    with open("/proc/self/statm") as f:
        sample["rss_mb"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / _MB
    return sample


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` over ``xs`` (0.0 for fewer than two distinct xs)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if not sxx:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def growth(samples: list[dict[str, float]], metric: str) -> dict[str, float]:
    """A metric's ``per_1000_steps`` (least-squares slope, MB per 1,000 steps) and ``total``
    (MB, first sample to last) over ``samples``."""
    xs = [s["step"] for s in samples]
    ys = [s[metric] for s in samples]
    return {"per_1000_steps": 1000 * slope(xs, ys), "total": ys[-1] - ys[0]}


def round_trip_mismatch(a: DynamicEmbeddingTables, b: DynamicEmbeddingTables) -> str | None:
    """Where two models' tables differ (keys, values with optimizer state, scores; each
    table's export sorted by key), or None when every table is bit-identical."""
    for t, name in enumerate(a.table_names):
        ea, eb = a.tables.export(t), b.tables.export(t)
        if ea.keys.numel() != eb.keys.numel():
            return f"{name}: {ea.keys.numel()} keys dumped, {eb.keys.numel()} loaded"
        ia, ib = ea.keys.argsort(), eb.keys.argsort()
        for field in ("keys", "values", "scores"):
            if not torch.equal(getattr(ea, field)[ia], getattr(eb, field)[ib]):
                return f"{name}: the {field} differ after the round trip"
    return None


class _RoundTrips:
    """Dump/load round trips of a model into a temporary folder, each checked bit-exact."""

    def __init__(self, w: SoakWorkload, device: torch.device, folder: Path) -> None:
        self.probe = _model(w, device)  # built once: loads go into it, emptied first
        self.path = folder / "ckpt"
        self.count = 0
        self.exact = 0
        self.seconds = 0.0
        self.mismatches: list[dict[str, Any]] = []

    def __call__(self, model: DynamicEmbeddingTables, step: int) -> None:
        t0 = time.perf_counter()
        DynamicEmbDump(self.path, model, optim=True)
        self.probe.tables.clear()
        DynamicEmbLoad(self.path, self.probe, optim=True)
        self.seconds += time.perf_counter() - t0
        self.count += 1
        mismatch = round_trip_mismatch(model, self.probe)
        if mismatch is None:
            self.exact += 1
        else:
            self.mismatches.append({"step": step, "mismatch": mismatch})

    def report(self, every: int) -> dict[str, Any]:
        return {
            "every": every,
            "round_trips": self.count,
            "exact": self.exact,
            "mean_seconds": self.seconds / max(self.count, 1),
            "mismatches": self.mismatches,
        }


def _phase(
    model: DynamicEmbeddingTables,
    w: SoakWorkload,
    device: torch.device,
    train: bool,
    round_trips: _RoundTrips | None,
) -> tuple[list[dict[str, float]], float]:
    """``warmup`` steps, then ``steps`` sampled ones (training, or eval forwards); the samples
    and the sampled steps' seconds (sampling and round trips left out)."""
    step = _stepper(model, w, device, train, w.seed + int(train))
    model.train(train)
    with torch.no_grad() if not train else torch.enable_grad():
        if round_trips is not None:
            round_trips(model, 0)  # unsampled: first imports and allocations
        _steps(step, w.warmup)
        samples = [memory_sample(0, device)]
        seconds = 0.0
        done = 0
        for stop in _stops(w):
            seconds += _timed_steps(step, stop - done, device)
            done = stop
            # Sampled before a round trip of the same step: every sample follows training
            # steps, none the transient buffers of a dump just done.
            if done % w.every == 0 or done == w.steps:
                samples.append(memory_sample(done, device))
            if round_trips is not None and w.dump_every and done % w.dump_every == 0:
                round_trips(model, done)
    return samples, seconds


def _stops(w: SoakWorkload) -> list[int]:
    """The steps (counted from 1) after which a phase samples or round-trips, in order."""
    marks = {w.steps, *range(w.every, w.steps + 1, w.every)}
    if w.dump_every:
        marks |= set(range(w.dump_every, w.steps + 1, w.dump_every))
    return sorted(marks)


def _stepper(
    model: DynamicEmbeddingTables, w: SoakWorkload, device: torch.device, train: bool, seed: int
) -> Callable[[], None]:
    """One step of the model on a fresh batch: two features (one per table, feature-major),
    ``batch`` bags of ``bag`` ids each, drawn from ``id_space`` by a generator seeded
    ``seed``; a training step runs the backward (and its fused update)."""
    if w.model == "reference":
        return _reference_stepper(model, w, device, train, seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    n = 2 * w.batch * w.bag
    offsets = torch.arange(0, n + 1, w.bag, device=device)

    def step() -> None:
        indices = torch.randint(0, w.id_space, (n,), generator=gen, device=device)
        if train:
            model(indices, offsets).square().sum().backward()
        else:
            model(indices, offsets)

    return step


def _reference_stepper(
    model: DynamicEmbeddingTables, w: SoakWorkload, device: torch.device, train: bool, seed: int
) -> Callable[[], None]:
    """One step of the reference workload: the next of a few pre-made batches in turn (a
    training step backpropagates a fixed small output gradient)."""
    batches = make_batches(Workload().scaled(w.scale), _REFERENCE_BATCHES, device, seed)
    with torch.no_grad():
        grad = torch.full_like(model(*batches[0]), 1e-3)
    turn = [0]

    def step() -> None:
        batch = batches[turn[0] % len(batches)]
        turn[0] += 1
        if train:
            torch.autograd.backward([model(*batch)], [grad])
        else:
            model(*batch)

    return step


def _steps(step: Callable[[], None], count: int) -> None:
    for _ in range(count):
        step()


def _timed_steps(step: Callable[[], None], count: int, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    _steps(step, count)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def _print(report: dict[str, Any]) -> None:
    metrics = report["metrics"]
    train, base = report["samples"]["train"], report["samples"]["eval"]
    w = report["workload"]
    print(
        f"soak of the {w['model']} model on {report['device']}: {w['steps']:,} steps per "
        f"phase after {w['warmup']:,} warm-up, a sample every {w['every']:,} "
        "(MB; eval = the baseline)"
    )
    heads = (f"{'train ' + _LABELS[m]:>15} {'eval ' + _LABELS[m]:>15}" for m in metrics)
    print("  step    " + "  ".join(heads))
    for t, b in zip(train, base, strict=True):
        cells = "  ".join(f"{t[m]:>15.2f} {b[m]:>15.2f}" for m in metrics)
        print(f"  {int(t['step']):<8,}{cells}")
    print(f"  {'growth':<36} {'training':>10} {'eval (baseline)':>16} {'difference':>11}")
    for row in report["growth"]:
        print(
            f"  {row['figure']:<36} {row['train']:>10.3f} {row['baseline']:>16.3f} "
            f"{row['difference']:>+11.3f}"
        )
    s = report["ms_per_step"]
    print(
        f"  ms per step: training {s['train']:.3f}, eval {s['eval']:.3f} "
        f"(ratio {s['train'] / s['eval']:.3g}x)"
    )
    if report["dump"] is not None:
        d = report["dump"]
        print(
            f"  dump/load round trips: {d['exact']} of {d['round_trips']} bit-exact "
            f"(every {d['every']:,} steps, {d['mean_seconds'] * 1e3:.1f} ms each)"
        )
        for m in d["mismatches"]:
            print(f"    step {m['step']}: {m['mismatch']}")


def run(w: SoakWorkload, device: torch.device) -> dict[str, Any]:
    """Run the eval phase (the baseline), then the training phase, of ``w`` on ``device``;
    print the samples and the growth figures and return the report."""
    quiet_import()
    torch.manual_seed(w.seed)
    folder = Path(tempfile.mkdtemp(prefix="demb_soak_"))
    try:
        model = _model(w, device)
        model.train()
        _steps(_stepper(model, w, device, True, w.seed + 2), w.warmup)  # fills the tables
        round_trips = _RoundTrips(w, device, folder) if w.dump_every else None
        eval_samples, eval_s = _phase(model, w, device, False, None)
        train_samples, train_s = _phase(model, w, device, True, round_trips)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    metrics = ["rss_mb", *(("allocated_mb", "reserved_mb") if device.type == "cuda" else ())]
    rows = []
    for m in metrics:
        gt, gb = growth(train_samples, m), growth(eval_samples, m)
        for key, what in (("per_1000_steps", "per 1,000 steps"), ("total", "first->last")):
            rows.append(
                {
                    "figure": f"{_LABELS[m]} MB {what}",
                    "metric": m,
                    "kind": key,
                    "train": gt[key],
                    "baseline": gb[key],
                    "difference": gt[key] - gb[key],
                }
            )
    report: dict[str, Any] = {
        "benchmark": "soak",
        "device": str(device),
        "machine": machine_info(device),
        "workload": w.as_dict(),
        "metrics": metrics,
        "samples": {"train": train_samples, "eval": eval_samples},
        "growth": rows,
        "baseline_name": "eval-mode forwards (no backward) of the same model, same run",
        "ms_per_step": {"train": 1e3 * train_s / w.steps, "eval": 1e3 * eval_s / w.steps},
        "dump": None if round_trips is None else round_trips.report(w.dump_every),
    }
    _print(report)
    return report
