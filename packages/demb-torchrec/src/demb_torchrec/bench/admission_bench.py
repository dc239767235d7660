"""``demb bench admission``: what frequency admission, its counter and a custom eviction score
cost, each beside the same work without them, in one run.

Every figure is timed in alternating rounds (the variant going first alternates): ``warmup``
untimed steps of each, then ``rounds`` rounds of ``steps`` timed steps of each; a round's figure
is the median of its steps, and the figure the median over rounds (min and max beside it). Each
step is timed between device synchronizations (the counter's calls between CUDA events).

1. ``train step with admission``: the reference workload's module
   (:class:`~demb_torchrec.bench.workload.Workload` at ``scale``: 10 tables of D=128 filled with
   every row key, Adam, NONE pooling, the module bench's capacity), where each step's batch has
   ``new_share`` (20%) of each table's unique ids replaced by ids never seen before
   (:class:`NewKeyBatches`), the others drawn from the rows in the table. Every table has
   ``FrequencyAdmissionStrategy(threshold=3, counter=KVCounter(capacity))``, the counter sized
   for the new keys of ``counter_steps`` (32) steps of a table. Baseline: the same module
   without admission on the same batches. With admission the training forward takes the
   unique-rows path: it finds the step's unique keys first (no score touched), adds the missing
   ones to the counter (erasing those admitted), then inserts the admitted ones; without it the
   module takes its direct path (one find_or_insert). Target <= 1.15x. Checked: every new key
   was asked about once (admitted + rejected = new keys), some were rejected, and the tables
   grew by the admitted keys.
2. ``counter add``: :meth:`demb_storage.MultiTableKVCounter.add` of one step's unique (key,
   table) pairs of the 10 tables with their frequencies, beside
   :meth:`demb_storage.ScoredHashTable.find_or_insert` of the same keys and counts into LFU
   tables of the same slots and bucket width (the counter's policy; their value rows are never
   touched: ``zero_new_rows=False``). Both are emptied before each step (untimed) and stay under
   their capacity (a step's keys fill about a sixth of it): ``new keys`` times the insert of
   every pair, ``keys present`` a second call with the same pairs
   (:mod:`demb_torchrec.bench._admission_parts`). Target: counter time / table time <= 1.25x
   (keys/s at least 0.8x the table's). Checked: every count returned (the frequency, then twice
   it) and every insert (all inserted, then all found).
3. ``train step with score_function``: the reference workload's tables with
   ``score_strategy=(TIMESTAMP, LFU)`` and about half as many slots as a step looks up ids of a
   table (every step evicts), with ``score_function=lru_lfu_decay_score``, beside the same
   tables evicting with the built-in compound order. Target <= 1.1x. Checked: every table of
   both evicted in a step after the rounds.

Memory: figure 1 holds two models of the module bench's size: at scale 1, 2 x 10 x 4,194,304
slots x (128 + 256) x 4 B = 129 GB (an H200; ``--scale 0.5``, 64 GB, fits an 80 GB H100). Each
figure's models are freed before the next.
"""

from __future__ import annotations

import gc
import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
from demb_storage import (
    AdmissionStrategy,
    FrequencyAdmissionStrategy,
    KVCounter,
    ScoreFunction,
    ScoreStrategy,
)

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.bench._admission_parts import (
    AdmissionCheckError,
    Batch,
    NewKeyBatches,
    counter_figures,
    print_report,
)
from demb_torchrec.bench._delta_report import figure
from demb_torchrec.bench.compare import check_counts, machine_info
from demb_torchrec.bench.workload import (
    Workload,
    make_batches,
    reference_tables,
    timed,
)
from demb_torchrec.options import (
    DynamicEmbScoreStrategy,
)
from demb_torchrec.train.score_functions import lru_lfu_decay_score

__all__ = [
    "AdmissionCheckError",
    "AdmissionWorkload",
    "NewKeyBatches",
    "run",
]

_BATCHES = 4
_GRAD = 1e-3
_PREFILL_IDS = 1 << 21  # ids per prefill forward (1 GB of output rows at D=128)
_TARGET_TRAIN = 1.15
_TARGET_COUNTER = 1.25
_TARGET_SCORE = 1.1
_COMPOUND = (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU)


@dataclass(frozen=True)
class AdmissionWorkload:
    """The reference workload at ``scale``; ``rounds`` rounds of ``steps`` timed steps per
    variant after ``warmup`` untimed steps each."""

    scale: float = 1.0
    steps: int = 10
    rounds: int = 5
    warmup: int = 5
    new_share: float = 0.2
    """The share of each table's unique ids a step replaces by ids never seen before."""
    threshold: int = 3
    """The frequency admission's threshold."""
    counter_steps: int = 32
    """The admission counter of a table holds the new keys of this many steps."""
    seed: int = 0

    def __post_init__(self) -> None:
        check_counts(self, "steps", "rounds", "counter_steps", "threshold")
        check_counts(self, "warmup", minimum=0)
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"scale={self.scale!r}: must be a finite number > 0")
        if not 0 < self.new_share < 1:
            raise ValueError(f"new_share={self.new_share!r}: must be in (0, 1)")

    @property
    def reference(self) -> Workload:
        """The reference workload at ``scale`` (NONE pooling, Adam)."""
        return Workload(pooling="none", optimizer="adam").scaled(self.scale)

    @property
    def capacity(self) -> int:
        """Slots a table of figure 1, as the module bench builds them
        (:attr:`Workload.spare_capacity`)."""
        return self.reference.spare_capacity

    @property
    def evicting_capacity(self) -> int:
        """Slots a table of figure 3: every step evicts (:attr:`Workload.evicting_capacity`)."""
        return self.reference.evicting_capacity


def _build(
    ref: Workload,
    device: torch.device,
    capacity: int,
    *,
    admit_strategy: AdmissionStrategy | None = None,
    score_strategy: ScoreStrategy | tuple[ScoreStrategy, ...] = ScoreStrategy.TIMESTAMP,
    score_function: ScoreFunction | None = None,
) -> DynamicEmbeddingTables:
    """The workload's tables of ``capacity`` slots (buckets of 128) with these options."""
    options = {
        "admit_strategy": admit_strategy,
        "score_strategy": score_strategy,
        "score_function": score_function,
    }
    return reference_tables(ref, device, capacity, options)


def _prefill(model: DynamicEmbeddingTables, ref: Workload, repeats: int) -> list[int]:
    """Insert every row key of every table, each ``repeats`` times in its forward (frequency
    admission of a threshold <= ``repeats`` admits it at once); the tables' sizes after."""
    model.train()
    chunk = max(1, _PREFILL_IDS // (repeats * ref.tables))
    with torch.no_grad():
        for start in range(0, ref.rows, chunk):
            keys = torch.arange(start, min(start + chunk, ref.rows), device=model.device)
            indices = keys.repeat_interleave(repeats).repeat(ref.tables)
            model(indices, torch.arange(indices.numel() + 1, device=model.device))
    return [model.tables.size(t) for t in range(model.num_tables)]


class _Variant:
    """One timed variant: a model and the batch of each of its steps."""

    def __init__(
        self, name: str, model: DynamicEmbeddingTables, batch: Callable[[int], Batch], ref: Workload
    ) -> None:
        self.name = name
        self.model = model
        self.batch = batch
        self.turn = 0
        self.rounds: list[float] = []
        rows = ref.tables * ref.samples  # NONE pooling: one output row an id
        self.grad = torch.full((rows, ref.dim), _GRAD, device=model.device)

    def _step(self, batch: Batch) -> None:
        torch.autograd.backward([self.model(*batch)], [self.grad])

    def run(self, steps: int, device: torch.device, timed_round: bool) -> None:
        times = []
        for _ in range(steps):
            batch = self.batch(self.turn)  # made before the timer starts
            self.turn += 1
            times.append(timed(partial(self._step, batch), device))
        if timed_round:
            self.rounds.append(statistics.median(times))


def _alternate(variants: list[_Variant], w: AdmissionWorkload, device: torch.device) -> None:
    """Warm-up steps of each, then ``rounds`` rounds of ``steps`` timed steps of each (the one
    going first alternating)."""
    for v in variants:
        v.run(w.warmup, device, timed_round=False)
    for r in range(w.rounds):
        for v in variants if r % 2 == 0 else variants[::-1]:
            v.run(w.steps, device, timed_round=True)


# ---------------------------------------------------------------------------- figure 1
def _admission(
    w: AdmissionWorkload, device: torch.device, batches: NewKeyBatches, counter: KVCounter
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Figure 1: the train step with frequency admission beside the step without."""
    ref = w.reference
    capacity = w.capacity
    admitted_model = _build(
        ref,
        device,
        capacity,
        admit_strategy=FrequencyAdmissionStrategy(w.threshold, counter=counter),
    )
    plain = _build(ref, device, capacity)
    filled = {"admission": _prefill(admitted_model, ref, w.threshold)}
    filled["no admission"] = _prefill(plain, ref, w.threshold)
    for name, sizes in filled.items():
        if min(sizes) != ref.rows:
            raise AdmissionCheckError(
                f"{name}: the fill left {sizes} keys in the tables, not {ref.rows} each"
            )
    admission = admitted_model.admission
    assert admission is not None
    admission.read_counts()  # the fill's
    variants = [
        _Variant("admission", admitted_model, batches.batch, ref),
        _Variant("no admission", plain, batches.batch, ref),
    ]
    _alternate(variants, w, device)
    counts = {k: int(v.sum()) for k, v in admission.read_counts().items()}
    asked = batches.asked(variants[0].turn)
    added = {
        v.name: sum(v.model.tables.size(t) for t in range(ref.tables)) - ref.tables * ref.rows
        for v in variants
    }
    if counts["admitted"] + counts["rejected"] != asked:
        raise AdmissionCheckError(
            f"admission: {counts['admitted']} keys admitted and {counts['rejected']} rejected, "
            f"not the {asked} new keys of the steps"
        )
    if counts["rejected"] == 0:
        raise AdmissionCheckError(f"admission rejected none of the {asked} new keys")
    # Below load factor 0.5 no bucket fills: each admitted key took a free slot.
    free = ref.tables * ref.rows + counts["admitted"] <= ref.tables * capacity // 2
    if free and added["admission"] != counts["admitted"]:
        raise AdmissionCheckError(
            f"admission: the tables grew by {added['admission']} keys, not the "
            f"{counts['admitted']} admitted"
        )
    paths = {v.name: type(getattr(v.model, "_train_path", None)).__name__ for v in variants}
    fig = figure(
        "train step with admission",
        variants[0].rounds,
        "the same train step without admission, same batches",
        variants[1].rounds,
        _TARGET_TRAIN,
        None,
        unit="s/step",
    )
    fig["note"] = (
        f"both take {paths['admission']} / {paths['no admission']}; with admission the "
        "forward first finds the step's unique keys, adds the missing ones to the counter "
        "(erasing those admitted), runs find_or_insert of the others and writes the rejected "
        "keys' rows from their initializer; without it, one find_or_insert"
    )
    checks = {**counts, "new_keys_asked": asked, "keys_added": added, "train_path": paths}
    return fig, checks


# ---------------------------------------------------------------------------- figure 3
def _evicted_in_a_step(v: _Variant, device: torch.device) -> list[int]:
    """Keys each table evicts in one more (untimed) step of ``v``."""
    outcomes = v.model.tables.outcomes
    outcomes.enable(True)
    try:
        v.run(1, device, timed_round=False)
        return [t["evicted"] for t in outcomes.read()]
    finally:
        outcomes.enable(False)


def _score_function(
    w: AdmissionWorkload, device: torch.device
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Figure 3: the train step of tables that evict every step by ``score_function`` beside
    the built-in compound evictor."""
    ref = w.reference
    name = "train step with score_function"
    baseline_name = "the same train step, built-in (TIMESTAMP, LFU) eviction, same batches"
    custom = _build(
        ref,
        device,
        w.evicting_capacity,
        score_strategy=_COMPOUND,
        score_function=lru_lfu_decay_score,
    )
    functions = [c.score_function for c in custom.tables.configs]
    if any(f is not lru_lfu_decay_score for f in functions):
        raise AdmissionCheckError(
            f"score_function: the tables were built with {functions}, not lru_lfu_decay_score"
        )
    builtin = _build(ref, device, w.evicting_capacity, score_strategy=_COMPOUND)
    batches = make_batches(ref, _BATCHES, device, w.seed)

    def batch(step: int) -> Batch:
        return batches[step % _BATCHES]

    variants = [
        _Variant("score_function", custom, batch, ref),
        _Variant("built-in", builtin, batch, ref),
    ]
    _alternate(variants, w, device)
    evicted = {v.name: _evicted_in_a_step(v, device) for v in variants}
    for variant, per_table in evicted.items():
        if min(per_table) == 0:
            raise AdmissionCheckError(
                f"{variant}: a step evicted {per_table} keys per table; every table should evict"
            )
    fig = figure(
        name, variants[0].rounds, baseline_name, variants[1].rounds, _TARGET_SCORE, None, "s/step"
    )
    return fig, {"evicted_in_a_step": evicted, "capacity": w.evicting_capacity}


# ---------------------------------------------------------------------------- the run
def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(w: AdmissionWorkload, device: torch.device) -> dict[str, Any]:
    """Time the three figures on ``device`` one after another (each one's models freed
    before the next); print the table and return the report.

    Raises:
        AdmissionCheckError: a figure whose work was not what it should be (see the module).
    """
    torch.manual_seed(w.seed)
    ref = w.reference
    batches = NewKeyBatches(ref, device, w.seed, w.new_share)
    counter = KVCounter(capacity=w.counter_steps * batches.span)
    figures, checks = [], {}
    fig, checks["admission"] = _admission(w, device, batches, counter)
    figures.append(fig)
    _release(device)
    counter_figs, checks["counter"] = counter_figures(
        ref,
        device,
        counter,
        steps=w.steps,
        rounds=w.rounds,
        warmup=w.warmup,
        seed=w.seed,
        target=_TARGET_COUNTER,
    )
    figures += counter_figs
    _release(device)
    fig, checks["score_function"] = _score_function(w, device)
    figures.append(fig)
    unique = [u for per_batch in batches.unique_keys for u in per_batch]
    new = [n for per_batch in batches.new_keys for n in per_batch]
    report: dict[str, Any] = {
        "benchmark": "admission",
        "device": str(device),
        "machine": machine_info(device),
        "workload": {
            **asdict(w),
            "tables": ref.tables,
            "dim": ref.dim,
            "rows": ref.rows,
            "samples": ref.samples,
            "optimizer": ref.optimizer,
            "pooling": ref.pooling,
            "capacity": w.capacity,
            "unique_keys_per_table_step": statistics.fmean(unique),
            "new_keys_per_table_step": statistics.fmean(new),
            "counter_capacity": counter.capacity,
            "counter_slots": counter.slots,
            "counter_bucket_capacity": counter.bucket_capacity,
            "evicting_capacity": w.evicting_capacity,
        },
        "figures": figures,
        "checks": checks,
        "ratio": "figure median / baseline median (seconds; the medians over rounds of each "
        "round's median step); target: the bound the ratio should meet",
    }
    print_report(report)
    return report
