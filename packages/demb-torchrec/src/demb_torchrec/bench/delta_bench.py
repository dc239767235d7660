"""``demb bench delta``: incremental dumps, their replay, and the non-blocking full dump of the
reference workload's tables, each beside the copy of the same bytes measured in the same run.

The model is one :class:`~demb_torchrec.DynamicEmbeddingTables` of the reference workload's
tables (:class:`~demb_torchrec.bench.workload.Workload` at ``scale``: 10 tables of
``round(1,677,721 * scale)`` rows, D=128, float32, Adam, TIMESTAMP scores, NONE pooling), each
of ``capacity`` slots (the rows at load factor ``load_factor``, rounded up to whole buckets of
128), ``init_capacity = max_capacity``: no table grows during the run. Every row key is
inserted first (the module bench's prefill); a replica of the same layout is built and filled
the same way (once: replays are idempotent, each repeat replays into it again). Phases 1-2 run
one untimed window first (warm-up: first calls, buffers touched), checked like the others.

Figures (each one timed ``repeats`` times; median, min and max, beside its baseline timed as
often in the same run, with ``median / baseline median`` and the issue's target):

1. ``incremental_dump``: :func:`~demb_torchrec.get_score` is read, then training steps
   (forward + backward, Adam) run over a window of ``touched`` of the rows of every table
   (a random subset of the keys present, once each), then
   :func:`~demb_torchrec.incremental_dump` with that threshold is timed. The dump must hold
   exactly the window's keys (else :class:`DeltaCheckError`). Baseline: one copy of the same
   bytes (keys, embeddings, optimizer state, scores and slots of the dumped rows) from a device
   tensor into pinned host memory (CUDA; also into pageable memory, reported beside it: the
   dump's own host tensors are pageable), or a host ``Tensor.copy_`` (CPU). Target <= 2x.
2. ``replay_increment`` of that delta into the replica. Baseline: a copy of the same bytes from
   pinned host memory to the device (CUDA), or a host ``Tensor.copy_`` (CPU). Target <= 2x.
   After each replay the replica's rows above the threshold (keys, slots, scores, embeddings
   and optimizer state) must equal the source's bit for bit, else :class:`DeltaCheckError`.
   For information (no target), both calls also beside the random-row copies inside them: a
   gather of the delta's rows by slot from the model's value buffers into fresh buffers, and
   their scatter into the replica's at the same slots.
3. ``DynamicEmbDump(dir, model, optim=True, blocking=False)`` into a folder under ``directory``
   (the replica is freed first): (a) the seconds the call blocks its caller (until it
   returns; also until the snapshot's copies are done, on CUDA), beside a device-to-device copy
   of the bytes the snapshot copies (the index's keys, digests, score words and sizes and every
   table's value rows, in chunks of 256 MiB; CPU: host copies). Target <= 2x. (b) the mean
   training step (the reference workload's power-law batches; each step timed between
   synchronizations of the current stream, which the write's side stream is not) of the steps
   run until ``handle.done()`` (at least ``min_steps``), beside the mean of as many steps run
   just before the call. Target <= 1.15x. Then ``handle.wait()`` and the checkpoint is
   removed. One untimed dump runs first (warm-up; it sets how many steps precede the next).

Memory (at ``scale`` 1.0 on CUDA, ``load_factor`` 0.8: 2,097,152 slots a table): each model
holds 10 x 2,097,152 x (128 + 256) x 4 B = 32.2 GB of value rows plus 0.36 GB of index.
Phases 1-2 hold both models (65.2 GB) plus the baselines' device buffer (the delta's bytes,
2.6 GB; the dump and the replay take one table's rows at a time, 0.26 GB) and a training
step's output and gradient (about 1 GB; the fill's forwards, 5.4 GB); phase 3 holds the
model, the dump's snapshot (32.6 GB) and the training batches (about 2 GB): about 70 GB of GPU
memory at the peak, one 80 GB H100.
Host memory: the delta (2.6 GB) and the baselines' pinned and pageable buffers (2.6 GB each)
and the background write's chunks. Disk: one checkpoint at a time under ``directory``, about
10 x 1,677,721 x (8 + 1,536 + 8) B = 26 GB. On the CPU (default scale 0.01) all of it is
about 1 GB of memory.
"""

from __future__ import annotations

import gc
import math
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import torch

from demb_torchrec._quiet import quiet_import
from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.bench._delta_background import GRAD, background_dumps
from demb_torchrec.bench._delta_baselines import (
    Copies,
    row_copies,
)
from demb_torchrec.bench._delta_report import figure, print_report
from demb_torchrec.bench.compare import machine_info
from demb_torchrec.bench.module_bench import prefill
from demb_torchrec.bench.workload import (
    BUCKET,
    Workload,
    reference_tables,
)
from demb_torchrec.incremental import DeltaDumpResult, incremental_dump
from demb_torchrec.options import (
    DynamicEmbScoreStrategy,
)
from demb_torchrec.replay import replay_increment
from demb_torchrec.scores import get_score

__all__ = ["DeltaCheckError", "DeltaWorkload", "run"]

_T = TypeVar("_T")
_TARGET_COPY = 2.0


class DeltaCheckError(RuntimeError):
    """An incremental dump that does not hold exactly the window's keys, or a replay whose rows
    differ from the source's."""


@dataclass(frozen=True)
class DeltaWorkload:
    """The reference workload's tables at ``scale``; a window of ``touched`` of each table's
    rows per repeat; ``repeats`` timings of each figure."""

    scale: float = 1.0
    touched: float = 0.10
    repeats: int = 5
    load_factor: float = 0.8
    """Rows over slots of each table when filled (its capacity: the rows over this, in whole
    buckets of 128)."""
    min_steps: int = 3
    """Training steps run during a background write, at least."""
    directory: str | None = None
    """Where the dumps' temporary folder is made (default: the system's temporary folder)."""
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("repeats", "min_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")
        if not (isinstance(self.scale, float | int) and math.isfinite(self.scale)):
            raise ValueError(f"scale={self.scale!r}: must be a finite number > 0")
        if not self.scale > 0:
            raise ValueError(f"scale={self.scale!r}: must be > 0")
        if not 0 < self.touched <= 1:
            raise ValueError(f"touched={self.touched!r}: must be in (0, 1]")
        if not 0 < self.load_factor <= 1:
            raise ValueError(f"load_factor={self.load_factor!r}: must be in (0, 1]")

    @property
    def reference(self) -> Workload:
        """The reference workload at ``scale`` (NONE pooling, Adam)."""
        return Workload(pooling="none", optimizer="adam").scaled(self.scale)

    @property
    def capacity(self) -> int:
        """Slots of each table: its rows over ``load_factor``, in whole buckets."""
        buckets = math.ceil(self.reference.rows / self.load_factor / BUCKET)
        return max(1, buckets) * BUCKET

    @property
    def touched_rows(self) -> int:
        """Keys of each table a window trains."""
        return max(1, round(self.touched * self.reference.rows))

    def as_dict(self) -> dict[str, Any]:
        """The workload as JSON fields."""
        ref = self.reference
        return {
            **asdict(self),
            "tables": ref.tables,
            "dim": ref.dim,
            "rows": ref.rows,
            "samples": ref.samples,
            "optimizer": ref.optimizer,
            "score_strategy": "TIMESTAMP",
            "capacity": self.capacity,
            "touched_rows": self.touched_rows,
        }


# ------------------------------------------------------------------------------------ model
def build(w: DeltaWorkload, device: torch.device) -> DynamicEmbeddingTables:
    """The workload's tables, empty: ``capacity`` slots each from the start."""
    options = {"init_capacity": w.capacity, "score_strategy": DynamicEmbScoreStrategy.TIMESTAMP}
    return reference_tables(w.reference, device, w.capacity, options, seed=w.seed)


def _present_keys(model: DynamicEmbeddingTables, rows: int) -> list[torch.Tensor]:
    """Per table, the row keys ``[0, rows)`` it holds (a fill may have evicted a few)."""
    keys = torch.arange(rows, device=model.device)
    out = []
    for t in range(model.num_tables):
        ids = torch.full_like(keys, t)
        out.append(keys[model.tables.find(keys, ids) >= 0])
    return out


def _train_on(model: DynamicEmbeddingTables, keys: list[torch.Tensor], samples: int) -> None:
    """Training steps over ``keys`` (per table, as many each), ``samples`` keys of each table
    a step, one id a bag: every key is trained once."""
    model.train()
    count = int(keys[0].numel())
    for start in range(0, count, samples):
        indices = torch.cat([k[start : start + samples] for k in keys])
        offsets = torch.arange(indices.numel() + 1, device=model.device)
        out = model(indices, offsets)
        torch.autograd.backward([out], [torch.full_like(out, GRAD)])


def _delta_bytes(deltas: dict[str, DeltaDumpResult]) -> int:
    """Bytes of the dumped rows: keys, embeddings, optimizer state, scores and slots."""
    total = 0
    for d in deltas.values():
        for i in range(len(d.table_names)):
            state = d.optimizer_states[i]
            parts = [d.keys[i], d.values[i], d.scores[i], d.meta[i]["slot_index"]]
            total += sum(p.numel() * p.element_size() for p in parts)
            total += 0 if state is None else state.numel() * state.element_size()
    return total


def _check_delta(
    deltas: dict[str, DeltaDumpResult], model: DynamicEmbeddingTables, window: list[torch.Tensor]
) -> None:
    """The delta holds exactly the window's keys of every table."""
    d = deltas.get("model")
    if d is None or d.table_names != model.table_names:
        got = {c: r.table_names for c, r in deltas.items()}
        raise DeltaCheckError(f"incremental_dump: tables {got}, expected {model.table_names}")
    for i, name in enumerate(d.table_names):
        got_keys = d.keys[i].sort().values
        want = window[i].cpu().sort().values
        if not torch.equal(got_keys, want):
            raise DeltaCheckError(
                f"incremental_dump: table {name}: {got_keys.numel()} keys dumped, not the "
                f"{want.numel()} keys the window trained"
            )


def _check_replay(
    source: DynamicEmbeddingTables,
    replica: DynamicEmbeddingTables,
    threshold: dict[str, dict[str, int]],
) -> None:
    """The replica's rows scored at or above the threshold equal the source's bit for bit:
    keys, slots, score columns, embeddings and optimizer state."""
    for t, name in enumerate(source.table_names):
        score = threshold["model"][name]
        a = source.tables.export(t, min_score=score)
        b = replica.tables.export(t, min_score=score)
        for field in ("keys", "slots", "scores", "values"):
            x, y = getattr(a, field), getattr(b, field)
            if x.shape != y.shape or not torch.equal(x, y):
                raise DeltaCheckError(
                    f"replay_increment: table {name}: the replica's {field} of the rows "
                    f"replayed differ from the source's ({a.keys.numel()} source rows, "
                    f"{b.keys.numel()} replica rows at or above the threshold)"
                )


def _timed_result(call: Callable[[], _T], device: torch.device) -> tuple[_T, float]:
    """What ``call`` returns and the seconds it took (the device synchronized before and
    after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    out = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, time.perf_counter() - start


# -------------------------------------------------------------------------------- phases
def _deltas_and_replays(
    w: DeltaWorkload,
    device: torch.device,
    model: DynamicEmbeddingTables,
    replica: DynamicEmbeddingTables,
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """Phases 1 and 2: ``repeats`` windows, each dumped and replayed, beside the copies."""
    ref = w.reference
    present = _present_keys(model, ref.rows)
    fewest = min(int(p.numel()) for p in present)
    if fewest < w.touched_rows:
        raise DeltaCheckError(
            f"a table holds {fewest} of its {ref.rows} row keys after the fill, fewer than the "
            f"window's {w.touched_rows}: lower --load-factor"
        )
    gen = torch.Generator().manual_seed(w.seed)
    times: dict[str, list[float]] = {
        k: []
        for k in ("dump", "d2h_pinned", "d2h_pageable", "replay", "h2d_pinned", "gather", "scatter")
    }
    copies: Copies | None = None
    nbytes = 0
    for r in range(w.repeats + 1):  # the first: warm-up (checked, not timed)
        timing = r > 0
        picks = [torch.randperm(int(p.numel()), generator=gen)[: w.touched_rows] for p in present]
        window = [p[i.to(p.device)] for p, i in zip(present, picks, strict=True)]
        threshold = get_score(model)
        assert threshold is not None
        _train_on(model, window, ref.samples)
        deltas, dump_s = _timed_result(partial(incremental_dump, model, threshold), device)
        _check_delta(deltas, model, window)
        nbytes = _delta_bytes(deltas)
        if copies is None or copies.nbytes != nbytes:
            copies = None  # the old buffers go before the new ones are made
            copies = Copies(device, nbytes)
        _, replay_s = _timed_result(partial(replay_increment, replica, deltas), device)
        _check_replay(model, replica, threshold)
        slots = [m["slot_index"] for m in deltas["model"].meta]
        gather, scatter = row_copies(model, replica, slots)
        del deltas
        # on the CPU both copies are host to host (the "pinned" buffer is an ordinary one)
        seconds = {"dump": dump_s, "replay": replay_s, "d2h_pinned": copies.d2h_pinned()}
        if device.type == "cuda":
            seconds["d2h_pageable"] = copies.d2h_pageable()
        seconds["h2d_pinned"] = copies.h2d_pinned()
        seconds["gather"], seconds["scatter"] = gather(), scatter()
        if timing:
            for name, value in seconds.items():
                times[name].append(value)
    cuda = device.type == "cuda"
    to_host = "D2H copy into pinned host memory" if cuda else "host memcpy (Tensor.copy_)"
    to_dev = "H2D copy from pinned host memory" if cuda else "host memcpy (Tensor.copy_)"
    what = "of the same bytes (keys, embeddings, optimizer state, scores, slots)"
    figures = [
        figure(
            "incremental_dump",
            times["dump"],
            f"{to_host} {what}",
            times["d2h_pinned"],
            _TARGET_COPY,
            nbytes,
        )
    ]
    if cuda:
        figures.append(
            figure(
                "incremental_dump (vs pageable)",
                times["dump"],
                f"D2H copy into pageable host memory {what}",
                times["d2h_pageable"],
                None,
                nbytes,
            )
        )
    figures.append(
        figure(
            "replay_increment",
            times["replay"],
            f"{to_dev} {what}",
            times["h2d_pinned"],
            _TARGET_COPY,
            nbytes,
        )
    )
    rows = "the delta's rows (embeddings and optimizer state) by slot, table by table"
    figures += [  # the random-row copies inside each call, for information
        figure(
            "incremental_dump (vs its row gather)",
            times["dump"],
            f"a gather of {rows}, from the value buffers into fresh ones",
            times["gather"],
            None,
            nbytes,
        ),
        figure(
            "replay_increment (vs its row scatter)",
            times["replay"],
            f"a scatter of {rows}, into the replica's value buffers",
            times["scatter"],
            None,
            nbytes,
        ),
    ]
    return figures, {"deltas": w.repeats + 1, "replays": w.repeats + 1}


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(w: DeltaWorkload, device: torch.device) -> dict[str, Any]:
    """Fill the model and its replica, time the three phases on ``device``, print the table
    and return the report.

    Raises:
        DeltaCheckError: a delta that does not hold exactly its window's keys, or a replay
            whose rows differ from the source's.
    """
    quiet_import()
    torch.manual_seed(w.seed)
    ref = w.reference
    model = build(w, device)
    prefill(model, ref)
    replica = build(w, device)
    prefill(replica, ref)
    sizes = [model.tables.size(t) for t in range(model.num_tables)]
    figures, checks = _deltas_and_replays(w, device, model, replica)
    del replica
    _release(device)
    if w.directory is not None:
        Path(w.directory).mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="demb_delta_", dir=w.directory))
    try:
        dump_figures, write = background_dumps(w, device, model, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report: dict[str, Any] = {
        "benchmark": "delta",
        "device": str(device),
        "machine": machine_info(device),
        "workload": w.as_dict(),
        "keys_after_fill": sizes,
        "figures": figures + dump_figures,
        "background_write": write,
        "checks": checks,
        "ratio": "figure median / baseline median (seconds); target: the issue's bound",
    }
    print_report(report)
    return report
