"""``demb bench retain``: what retaining evicted keys costs a training step, in one run.

The reference workload's tables (:class:`~demb_torchrec.bench.workload.Workload` at ``scale``:
10 tables of D=128, Adam, NONE pooling, power-law ids) are built with about half as many slots
as a step looks up ids of a table (a power of two), so every training step evicts. Three
variants are timed in alternating rounds of ``steps`` steps on the same batches:

* ``discard``: tables with ``evicted_item_mode=DISCARD`` (the default), as built;
* ``no hook``: the same tables with the insert paths' retention hook
  (:meth:`demb_storage.ScoredHashTable.record_evictions`) replaced by a function that does
  nothing: the step as it was before retention existed. ``discard / no hook`` is the cost of
  retention to tables that do not retain (the issue's target: unchanged, 1.00x);
* ``retain``: a second model whose tables have ``evicted_item_mode=RETAIN_KEY``; its evicted
  keys are popped (:func:`~demb_torchrec.pop_evicted_keys`) after every round, outside the
  timed steps. ``retain / discard`` is what retaining costs.

Each step is timed between device synchronizations; the figure is the median over rounds of
each round's median step.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

import torch

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.bench.workload import (
    Workload,
    make_batches,
    reference_tables,
    timed,
)
from demb_torchrec.options import (
    EvictedItemMode,
)
from demb_torchrec.retained import pop_evicted_keys

__all__ = ["RetainWorkload", "run"]

_BATCHES = 4


@dataclass(frozen=True)
class RetainWorkload:
    """The reference workload at ``scale``; ``rounds`` rounds of ``steps`` timed steps per
    variant after ``warmup`` untimed steps each."""

    scale: float = 1.0
    steps: int = 10
    rounds: int = 5
    warmup: int = 5
    seed: int = 0

    @property
    def reference(self) -> Workload:
        return Workload(pooling="none", optimizer="adam").scaled(self.scale)

    @property
    def capacity(self) -> int:
        """Slots per table: every step evicts (:attr:`Workload.evicting_capacity`)."""
        return self.reference.evicting_capacity


def _build(
    w: RetainWorkload, device: torch.device, mode: EvictedItemMode
) -> DynamicEmbeddingTables:
    return reference_tables(w.reference, device, w.capacity, {"evicted_item_mode": mode})


Batch = tuple[torch.Tensor, torch.Tensor]


class _Variant:
    """One timed variant: a model, the batches it steps through, whether its hook runs."""

    def __init__(
        self, name: str, model: DynamicEmbeddingTables, batches: list[Batch], hook: bool
    ) -> None:
        self.name = name
        self.model = model
        self.batches = batches
        self.hook = hook
        self.turn = 0
        self.rounds: list[float] = []
        self.popped = 0
        with torch.no_grad():
            self.grad = torch.full_like(model(*batches[0]), 1e-3)

    def step(self) -> None:
        batch = self.batches[self.turn % len(self.batches)]
        self.turn += 1
        torch.autograd.backward([self.model(*batch)], [self.grad])

    def run(self, steps: int, device: torch.device, timed_round: bool) -> None:
        tables = self.model.tables
        if not self.hook:  # the instance attribute shadows the method for this round
            tables.record_evictions = _no_hook  # type: ignore[method-assign]
        try:
            times = [timed(self.step, device) for _ in range(steps)]
        finally:
            tables.__dict__.pop("record_evictions", None)
        if timed_round:
            self.rounds.append(statistics.median(times))
        popped = pop_evicted_keys(self.model)  # a retaining buffer stays small; untimed
        self.popped += sum(int(k.numel()) for k in popped.get("model", {}).values())


def _no_hook(table_ids: torch.Tensor, status: torch.Tensor, victims: torch.Tensor) -> None:
    """What the insert paths did before retention existed."""


def run(w: RetainWorkload, device: torch.device) -> dict[str, Any]:
    """Time the three variants; print and return the report."""
    ref = w.reference
    batches = make_batches(ref, _BATCHES, device, w.seed)
    discard = _build(w, device, EvictedItemMode.DISCARD)
    retain = _build(w, device, EvictedItemMode.RETAIN_KEY)
    variants = [
        _Variant("discard", discard, batches, hook=True),
        _Variant("no hook", discard, batches, hook=False),
        _Variant("retain", retain, batches, hook=True),
    ]
    for v in variants:
        v.run(w.warmup, device, timed_round=False)
    for _ in range(w.rounds):
        for v in variants:
            v.run(w.steps, device, timed_round=True)
    median = {v.name: statistics.median(v.rounds) for v in variants}
    report = {
        "bench": "retain",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "workload": {**asdict(w), "rows": ref.rows, "capacity": w.capacity, "tables": ref.tables},
        "step_ms": {name: 1e3 * s for name, s in median.items()},
        "rounds_ms": {v.name: [1e3 * s for s in v.rounds] for v in variants},
        "discard_vs_no_hook": median["discard"] / median["no hook"],
        "retain_vs_discard": median["retain"] / median["discard"],
        "retained_keys_popped": variants[2].popped,
    }
    print(
        f"retain bench on {report['device']}: {ref.tables} tables x {ref.rows:,} rows into "
        f"{w.capacity:,} slots (every step evicts), {ref.samples:,} ids a table a step; "
        f"median of {w.rounds} rounds of {w.steps} steps"
    )
    for name, seconds in median.items():
        print(f"  train step, {name:<8} {1e3 * seconds:9.3f} ms")
    print(f"  discard / no hook  {report['discard_vs_no_hook']:.3f}x  (target: 1.00x, unchanged)")
    print(
        f"  retain / discard   {report['retain_vs_discard']:.3f}x  "
        f"({variants[2].popped:,} evicted keys retained and popped)"
    )
    return report
