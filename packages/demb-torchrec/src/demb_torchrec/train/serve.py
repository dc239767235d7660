"""``demb serve``: a replica that follows a training run's delta directory.

It builds the run's model for evaluation, loads the last checkpoint and the deltas after it,
then replays each new delta as it appears (with the dense part written beside it), evaluates
at every step the trainer evaluated, and logs its AUC and its lag behind the trainer to
``replica.jsonl`` (rank 0). With ``follow`` it waits for new deltas until the trainer's
``DONE`` file says the run is over and every delta is replayed. It runs on as many ranks as
the trainer (a delta's layout includes the world size): one process, or torchrun's.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

from demb_torchrec.train.config import Settings
from demb_torchrec.train.loop import DONE, evaluate
from demb_torchrec.train.model import TrainModel, build_model, init_rank
from demb_torchrec.train.online import rebuild, replay_one
from demb_torchrec.train.report import MetricsLog
from demb_torchrec.train.source import Source, make_source
from demb_torchrec.train.state import OnlinePaths

__all__ = ["ReplicaSummary", "serve"]


@dataclass(frozen=True)
class ReplicaSummary:
    """What a replica did: the last step it holds (-1: none), its evaluations
    ``(step, auc, logloss)``."""

    step: int
    evals: list[tuple[int, float, float]]


def serve(
    settings: Settings, *, follow: bool = True, poll_s: float = 0.5, timeout_s: float = 600.0
) -> ReplicaSummary:
    """Follow the deltas of the run ``settings`` describes (its ``output.dir``).

    Args:
        follow: wait for new deltas until the trainer is done (else replay what is there).
        poll_s: seconds between looks at the delta directory.
        timeout_s: stop waiting after this many seconds without a new delta.
    """
    rank = init_rank()
    paths = OnlinePaths(settings.output)
    source = make_source(settings)
    tm = build_model(settings, rank)
    tm.dmp.eval()
    evals: list[tuple[int, float, float]] = []
    log = MetricsLog(paths.root / "replica.jsonl") if rank.first else None
    with log if log is not None else contextlib.nullcontext():

        def report(step: int) -> None:  # collective: every rank evaluates its slice
            record = _record(tm, source, paths, step, int(settings["train"]["eval_every"]))
            if "auc" in record["replica"]:
                r = record["replica"]
                evals.append((step, r["auc"], r["logloss"]))
            if log is not None:
                log.write(record)

        step, state = rebuild(tm, paths, optimizer=False)
        if state is not None:
            report(step)
        waited = time.monotonic()
        while True:
            for saved in paths.complete_deltas(after=step):
                replay_one(tm, saved, optimizer=False)
                step = saved.step
                report(step)
                waited = time.monotonic()
            finished = (paths.root / DONE).exists()
            if not follow or (finished and not paths.complete_deltas(after=step)):
                break
            if time.monotonic() - waited > timeout_s:
                break
            time.sleep(poll_s)
    return ReplicaSummary(step=step, evals=evals)


def _record(
    tm: TrainModel, source: Source, paths: OnlinePaths, step: int, eval_every: int
) -> dict[str, Any]:
    found = paths.complete_deltas()
    latest = found[-1].step if found else step
    replica: dict[str, Any] = {
        "lag_steps": latest - step,
        "lag_s": max(0.0, time.time() - paths.delta(step).dense.stat().st_mtime),
    }
    if step % eval_every == 0:
        replica.update(evaluate(tm, source, step))
    return {"step": step, "replica": replica}
