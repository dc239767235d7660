"""The training loop of ``demb train``: DLRM steps over the run's samples, reports every
``log_every`` steps, evaluation every ``eval_every``, an incremental dump every
``delta_every`` (a delta file and the dense part), a full checkpoint every ``ckpt_every`` and
at the end; ``resume`` restarts from the last checkpoint plus the deltas after it.

On several ranks every rank takes its slice of the step's global batch and its loss is the
mean over its slice: DDP averages the dense gradients over ranks and TorchRec's embedding
all-to-all divides the sparse ones by the world size (its gradient division), so both are the
global mean's gradients and the run follows the 1-rank run's updates.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from demb_torchrec.dump import DumpHandle, DynamicEmbDump
from demb_torchrec.errors import ConfigError
from demb_torchrec.incremental import incremental_dump
from demb_torchrec.stats import count_insert_outcomes, table_placement
from demb_torchrec.train.batch import ClickBatch
from demb_torchrec.train.config import Settings
from demb_torchrec.train.metrics import Window, auc_logloss, gather, tables_record
from demb_torchrec.train.model import Rank, TrainModel, build_model, init_rank, to_inputs
from demb_torchrec.train.online import Thresholds, dense_state, restore, table_threshold
from demb_torchrec.train.plots import plot_run
from demb_torchrec.train.report import MetricsLog, read_records
from demb_torchrec.train.source import Source, make_source
from demb_torchrec.train.state import OnlinePaths, save_dense

__all__ = ["DONE", "RunSummary", "evaluate", "train"]

DONE = "DONE"
"""The file a finished run leaves in its output directory (its last step inside)."""


@dataclass(frozen=True)
class RunSummary:
    """What a run did: its last step, its first and last eval, the files it wrote."""

    steps: int
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    seconds: float
    records: int
    plots: list[Path]
    output: Path


def evaluate(tm: TrainModel, source: Source, step: int) -> dict[str, float]:
    """AUC and log loss of the model on the held-out set at ``step`` (every rank its slice)."""
    rank = tm.rank
    held = source.eval_set(step)
    lo, hi = _slice(len(held), rank)
    part = held.slice(lo, hi)
    was_training = tm.dmp.training
    tm.dmp.eval()
    with torch.no_grad():
        dense, kjt = to_inputs(part, rank.device)
        logits = tm.dmp(dense, kjt).squeeze(1).float().cpu()
    tm.dmp.train(was_training)
    auc, logloss = auc_logloss(gather(logits, rank), gather(part.labels.float(), rank))
    return {"auc": auc, "logloss": logloss}


def _slice(n: int, rank: Rank) -> tuple[int, int]:
    if n % rank.world_size:
        raise ConfigError(
            f"data.batch_size / data.eval_samples: {n} samples do not split evenly over "
            f"{rank.world_size} ranks"
        )
    per = n // rank.world_size
    return rank.rank * per, (rank.rank + 1) * per


def _step(
    tm: TrainModel, batch: ClickBatch, loss_fn: torch.nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training step on this rank's slice; returns its mean loss and its logits."""
    rank = tm.rank
    dense, kjt = to_inputs(batch, rank.device)
    labels = batch.labels.to(rank.device)
    logits = tm.dmp(dense, kjt).squeeze(1)
    loss = loss_fn(logits, labels)
    tm.dense_opt.zero_grad()
    loss.backward()
    tm.dense_opt.step()
    return loss.detach(), logits.detach()


def _check_output(paths: OnlinePaths, resume: bool, overwrite: bool) -> None:
    used = (paths.root / "train.jsonl").exists() or paths.deltas.exists() or paths.ckpts.exists()
    if used and not (resume or overwrite):
        raise ConfigError(
            f"output.dir={str(paths.root)!r} holds a run: pass --resume to continue it, "
            "--overwrite to start over, or another --out"
        )


def train(
    settings: Settings,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    on_ready: Callable[[], None] | None = None,
) -> RunSummary:
    """Run the job of ``settings`` on this process's rank (collective over the group).

    ``on_ready`` is called on rank 0 once the output directory is set for the run (a resumed
    run's later files removed), before the first step.

    Raises:
        ConfigError: a setting the model, the data or the output directory rejects (before
            the first step).
    """
    rank = init_rank()
    paths = OnlinePaths(settings.output)
    if rank.first:
        _check_output(paths, resume, overwrite)
    source = make_source(settings)
    t = settings["train"]
    steps = int(t["steps"])
    if source.steps_available is not None and steps > source.steps_available:
        raise ConfigError(
            f"train.steps={steps}: the data holds {source.steps_available} batches of "
            f"{source.batch_size}"
        )
    online = settings["online"]
    every = {k: int(online[k]) for k in ("delta_every", "ckpt_every")}
    for key, value in every.items():
        if value and value % int(t["log_every"]):
            raise ConfigError(f"online.{key}={value}: must be a multiple of train.log_every")

    _slice(source.batch_size, rank)
    tm = build_model(settings, rank)
    count_insert_outcomes(tm.dmp)
    start, threshold = 0, table_threshold(tm.dmp)
    if resume:
        start, threshold = restore(tm, paths)
    elif rank.first and overwrite:
        paths.remove_after(-1)
    if rank.world_size > 1:
        dist.barrier(group=rank.group)
    log: MetricsLog | None = None
    if rank.first:
        _print_placement(tm.dmp)
        paths.root.mkdir(parents=True, exist_ok=True)
        (paths.root / DONE).unlink(missing_ok=True)
        logdir = paths.root / "tensorboard" if settings["output"]["tensorboard"] else None
        log = MetricsLog(paths.root / "train.jsonl", logdir, resume_step=start if resume else None)
        if on_ready is not None:
            on_ready()
    loss_fn = torch.nn.BCEWithLogitsLoss()
    window = Window()
    lo, hi = _slice(source.batch_size, rank)
    pending: tuple[DumpHandle, Path, dict[str, Any]] | None = None
    bar = tqdm(
        total=steps, initial=start, disable=not (progress and rank.first), unit="step",
        dynamic_ncols=True,
    )  # fmt: skip
    began = time.perf_counter()
    tick, tick_step = began, start
    first_eval: dict[str, float] = {}
    last_eval: dict[str, float] = {}
    log_every, eval_every = int(t["log_every"]), int(t["eval_every"])
    for step in range(start, steps):
        batch = source.train_batch(step).slice(lo, hi)
        loss, logits = _step(tm, batch, loss_fn)
        window.add(loss, logits, batch.labels)
        done = step + 1
        bar.update(1)
        if done % log_every == 0 or done == steps:
            now = time.perf_counter()
            rate = (done - tick_step) * source.batch_size / max(now - tick, 1e-9)
            tick, tick_step = now, done
            record: dict[str, Any] = {
                "step": done,
                "samples": done * source.batch_size,
                "seconds": now - began,
                "train": {**window.report(rank), "samples_per_s": rate},
            }
            if done % eval_every == 0 or done in (steps, log_every):
                record["eval"] = evaluate(tm, source, done)
                first_eval = first_eval or record["eval"]
                last_eval = record["eval"]
            record["tables"] = tables_record(tm.dmp, rank)
            if log is not None:
                log.write(record)
            bar.set_postfix(
                loss=f"{record['train']['loss']:.4f}",
                auc=f"{record['train']['auc']:.3f}",
                sps=f"{rate:,.0f}",
            )
        if every["delta_every"] and done % every["delta_every"] == 0:
            threshold = _write_delta(tm, paths, done, threshold)
        if (every["ckpt_every"] and done % every["ckpt_every"] == 0) or done == steps:
            _finish_ckpt(pending, rank.first)
            pending = _checkpoint(tm, paths, done, threshold, settings, final=done == steps)
    _finish_ckpt(pending, rank.first)
    bar.close()
    plots: list[Path] = []
    records = 0
    if log is not None:
        log.close()
        found = read_records(paths.root / "train.jsonl")
        records = len(found)
        plots = plot_run(_with_replica(found, paths.root), paths.root / "plots")
        (paths.root / DONE).write_text(str(steps))
    if rank.world_size > 1:
        dist.barrier(group=rank.group)
    return RunSummary(
        steps=steps,
        first_eval=first_eval,
        last_eval=last_eval,
        seconds=time.perf_counter() - began,
        records=records,
        plots=plots,
        output=paths.root,
    )


def _with_replica(records: list[dict[str, Any]], root: Path) -> list[dict[str, Any]]:
    """The trainer's records with the replica's AUC (where a replica logged the same step)."""
    replica = root / "replica.jsonl"
    if not replica.exists():
        return records
    by_step = {r["step"]: r.get("replica") for r in read_records(replica)}
    out = []
    for r in records:
        seen = by_step.get(r["step"])
        out.append({**r, "replica": seen} if seen else r)
    return out


def _print_placement(model: torch.nn.Module) -> None:
    """Where each table's values live (rank 0's shards), one line per kind of placement."""
    groups: dict[str, list[str]] = {}
    for per in table_placement(model).values():
        for name, text in per.items():
            groups.setdefault(text, []).append(name)
    for text, names in groups.items():
        shown = ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]}"
        print(f"demb train: {len(names)} tables ({shown}): {text}", flush=True)


def _write_delta(
    tm: TrainModel, paths: OnlinePaths, step: int, threshold: Thresholds
) -> Thresholds:
    """Dump what changed since ``threshold`` (gathered from every rank), rank 0 writes it and
    the dense state; returns the next delta's threshold."""
    from demb_torchrec.delta_files import write_delta_dump

    rank = tm.rank
    pg = rank.group if rank.world_size > 1 else None
    deltas = incremental_dump(tm.dmp, threshold, pg=pg)
    nxt = table_threshold(tm.dmp)
    saved = paths.delta(step)
    if rank.first:
        write_delta_dump(saved.tables, deltas)
        save_dense(saved.dense, dense_state(tm, step, nxt))
    return nxt


def _checkpoint(
    tm: TrainModel,
    paths: OnlinePaths,
    step: int,
    threshold: Thresholds,
    settings: Settings,
    final: bool,
) -> tuple[DumpHandle, Path, dict[str, Any]] | None:
    """A full dump at ``step``: blocking, or non-blocking (finished before the next one)."""
    rank = tm.rank
    saved = paths.ckpt(step)
    state = dense_state(tm, step, threshold)
    blocking = bool(settings["online"]["blocking_ckpt"]) or final
    if blocking:
        DynamicEmbDump(saved.tables, tm.dmp, optim=True, pg=rank.group)
        if rank.first:
            save_dense(saved.dense, state)
        return None
    handle = DynamicEmbDump(saved.tables, tm.dmp, optim=True, pg=rank.group, blocking=False)
    return handle, saved.dense, state


def _finish_ckpt(pending: tuple[DumpHandle, Path, dict[str, Any]] | None, first: bool) -> None:
    """Wait for a non-blocking checkpoint, then write its dense state (rank 0)."""
    if pending is None:
        return
    handle, dense_path, state = pending
    handle.wait()
    if first:
        save_dense(dense_path, state)
