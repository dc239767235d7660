"""Phase 3 of ``demb bench delta``: non-blocking ``DynamicEmbDump`` calls, timed, with the
training steps taken while each writes beside as many steps just before it
(:mod:`demb_torchrec.bench.delta_bench`)."""

from __future__ import annotations

import math
import shutil
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.bench._delta_baselines import copier, nbytes, snapshot_tensors
from demb_torchrec.bench._delta_report import figure
from demb_torchrec.bench.workload import Workload, make_batches, timed
from demb_torchrec.dump import DynamicEmbDump

__all__ = ["GRAD", "BackgroundWork", "background_dumps"]

GRAD = 1e-3
"""Every output gradient entry of the benchmark's training steps."""
_BATCHES = 4
_TARGET_COPY = 2.0
_TARGET_STEP = 1.15
_PRE_STEPS_MARGIN = 1.25  # steps before a dump: this times the previous dump's steps


class BackgroundWork(Protocol):
    """What phase 3 reads of the benchmark's workload."""

    @property
    def reference(self) -> Workload: ...
    @property
    def seed(self) -> int: ...
    @property
    def repeats(self) -> int: ...
    @property
    def min_steps(self) -> int: ...


def _stepper(
    ref: Workload, seed: int, device: torch.device, model: DynamicEmbeddingTables
) -> Callable[[], float]:
    """A timed training step (:func:`_stream_timed`) of the workload's next batch."""
    batches = make_batches(ref, _BATCHES, device, seed + 1)
    model.train()
    with torch.no_grad():
        grad = torch.full_like(model(*batches[0]), GRAD)
    turn = [0]

    def step() -> None:
        batch = batches[turn[0] % len(batches)]
        turn[0] += 1
        torch.autograd.backward([model(*batch)], [grad])

    return lambda: _stream_timed(step, device)


def _stream_timed(call: Callable[[], object], device: torch.device) -> float:
    """Seconds ``call`` takes, the current stream synchronized before and after (not the
    device: the background write's side stream is not waited for, as a training loop's
    ``loss.item()`` does not wait for it)."""
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    if stream is not None:
        stream.synchronize()
    start = time.perf_counter()
    call()
    if stream is not None:
        stream.synchronize()
    return time.perf_counter() - start


def _checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def background_dumps(
    w: BackgroundWork, device: torch.device, model: DynamicEmbeddingTables, folder: Path
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Phase 3 of ``demb bench delta``: a warm-up dump, then ``w.repeats`` non-blocking dumps
    into ``folder``, each with training steps of ``w.reference`` before it and during its
    background write (at least ``w.min_steps``).

    Returns:
        The figures (the call; on CUDA the call with its copies done; the steps during the
        write) and the write's record (seconds, bytes, steps).
    """
    step = _stepper(w.reference, w.seed, device, model)
    tensors = snapshot_tensors(model)
    table_bytes = nbytes(tensors)
    copy = copier(tensors, device)
    cuda = device.type == "cuda"
    calls: list[float] = []
    ready: list[float] = []
    copies: list[float] = []
    during: list[float] = []
    before: list[float] = []
    writes: list[float] = []
    steps_during: list[int] = []
    steps_before: list[int] = []
    on_disk = 0
    pre = 0
    for r in range(w.repeats + 1):  # the first: warm-up
        timed_run = r > 0
        pre_times = [step() for _ in range(pre)]
        copy_s = timed(copy, device)
        path = folder / f"ckpt{r}"
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        handle = DynamicEmbDump(path, model, optim=True, blocking=False)
        call_s = time.perf_counter() - t0
        if cuda:  # the snapshot's copies are queued on the current stream
            torch.cuda.current_stream(device).synchronize()
        ready_s = time.perf_counter() - t0
        step_times: list[float] = []
        written: float | None = None  # when done() was first seen, between steps
        while True:
            if written is None and handle.done():
                written = time.perf_counter() - t0
            if written is not None and len(step_times) >= w.min_steps:
                break
            step_times.append(step())
        handle.wait()
        on_disk = _checkpoint_bytes(path)
        shutil.rmtree(path)
        m = len(step_times)
        pre = max(w.min_steps, math.ceil(_PRE_STEPS_MARGIN * m))
        if not timed_run:
            continue
        compared = pre_times[-m:]
        calls.append(call_s)
        ready.append(ready_s)
        copies.append(copy_s)
        during.append(statistics.fmean(step_times))
        before.append(statistics.fmean(compared))
        writes.append(written)
        steps_during.append(m)
        steps_before.append(len(compared))
    memory = "D2D copy" if cuda else "host memcpy (Tensor.copy_)"
    baseline = (
        f"{memory} of the tables' bytes (index keys, digests, score words, sizes; value rows "
        "with optimizer state), 256 MiB at a time"
    )
    figures = [
        figure(
            "dump call (blocking=False) returns", calls, baseline, copies, _TARGET_COPY, table_bytes
        ),
    ]
    if cuda:
        figures.append(
            figure("dump call + snapshot copies done", ready, baseline, copies, None, table_bytes)
        )
    figures.append(
        figure(
            "train step during the background write",
            during,
            "mean train step of as many steps just before the dump call (each timed between "
            "synchronizations of the current stream)",
            before,
            _TARGET_STEP,
            None,
            unit="s/step",
        )
    )
    info = {
        "seconds": writes,
        "checkpoint_bytes": on_disk,
        "table_bytes": table_bytes,
        "steps_during": steps_during,
        "steps_before": steps_before,
        "what": "seconds from the call until handle.done() was first seen (between steps)",
    }
    return figures, info
