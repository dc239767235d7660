"""The online state of a ``demb train`` run: what the dense file beside a delta or a checkpoint
holds, the thresholds of incremental dumps, and putting a model back at the step of the last
delta (a resumed run, a replica catching up).

A model is rebuilt from the last complete checkpoint (:func:`~demb_torchrec.DynamicEmbLoad`
puts every key back at the slot it was dumped from) and the deltas after it
(:func:`~demb_torchrec.replay_increment` writes each key at its source slot), so its tables
equal the source's slot for slot: evictions then pick the same victims, and a resumed run goes
on exactly as the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from demb_torchrec.delta_files import read_delta_dump
from demb_torchrec.errors import CheckpointError
from demb_torchrec.load import DynamicEmbLoad
from demb_torchrec.model_tables import dynamic_tables
from demb_torchrec.replay import replay_increment
from demb_torchrec.scores import get_score
from demb_torchrec.train.model import TrainModel
from demb_torchrec.train.state import OnlinePaths, Saved, load_dense

__all__ = [
    "Thresholds",
    "apply_dense",
    "dense_state",
    "rebuild",
    "replay_one",
    "restore",
    "table_threshold",
]

Thresholds = dict[str, dict[str, int]]


def table_threshold(model: torch.nn.Module) -> Thresholds:
    """The score each table gives its next keys: the threshold of the next incremental dump
    (it then holds exactly the keys touched from now on)."""
    return get_score(model) or {}


def _modules(model: torch.nn.Module) -> list[Any]:
    """The model's table modules (each fuses several tables), in a fixed order."""
    seen: dict[int, Any] = {}
    for t in dynamic_tables(model):
        seen.setdefault(id(t.module), t.module)
    return list(seen.values())


def dense_state(tm: TrainModel, step: int, threshold: Thresholds) -> dict[str, Any]:
    """Everything besides the tables' rows a run needs to go on from ``step``: the dense
    parameters and their optimizer's state, the tables' step counters (their STEP scores) and
    update counts (Adam's bias correction), and the next delta's threshold."""
    return {
        "step": step,
        "dense": {n: p.detach().cpu().clone() for n, p in _dense_named(tm)},
        "dense_opt": tm.dense_opt.state_dict(),
        "table_steps": [list(m.tables.steps) for m in _modules(tm.dmp)],
        "table_updates": [m.step_counts.clone() for m in _modules(tm.dmp)],
        "threshold": threshold,
    }


def _dense_named(tm: TrainModel) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in tm.dmp.named_parameters() if "sparse_arch" not in n]


def apply_dense(tm: TrainModel, state: dict[str, Any], optimizer: bool) -> None:
    params = dict(_dense_named(tm))
    saved = state["dense"]
    if set(saved) != set(params):
        raise CheckpointError(
            f"dense state of step {state['step']}: parameters {sorted(set(saved) ^ set(params))} "
            "differ from the model's (another train.bottom_mlp / top_mlp / dim?)"
        )
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(saved[n].to(p.device))
    if optimizer:
        tm.dense_opt.load_state_dict(state["dense_opt"])
    modules = _modules(tm.dmp)
    for m, steps, updates in zip(
        modules, state["table_steps"], state["table_updates"], strict=True
    ):
        m.tables.steps = list(steps)
        m.step_counts.copy_(updates)


def rebuild(
    tm: TrainModel, paths: OnlinePaths, *, optimizer: bool = True
) -> tuple[int, dict[str, Any] | None]:
    """Load the last complete checkpoint into a freshly built model (every key at its slot),
    replay the deltas after it (without a checkpoint: every delta, the first holding every key
    touched since the start), and load the last dense state read (with its optimizer's state
    when ``optimizer``).

    Returns:
        The step the model is at now (-1 when there was nothing) and the last dense state read
        (None when there was nothing).
    """
    last: dict[str, Any] | None = None
    step = -1
    ckpt = paths.last_ckpt()
    if ckpt is not None:
        last = load_dense(ckpt.dense)
        DynamicEmbLoad(ckpt.tables, tm.dmp, optim=True, pg=tm.rank.group)
        step = ckpt.step
    for saved in paths.complete_deltas(after=step):
        last = load_dense(saved.dense)
        replay_increment(tm.dmp, read_delta_dump(saved.tables))
        step = saved.step
    if last is not None:
        apply_dense(tm, last, optimizer)
    return step, last


def replay_one(tm: TrainModel, saved: Saved, *, optimizer: bool = True) -> dict[str, Any]:
    """Replay one more delta (the next after the model's step) and load its dense state."""
    state = load_dense(saved.dense)
    replay_increment(tm.dmp, read_delta_dump(saved.tables))
    apply_dense(tm, state, optimizer)
    return state


def restore(tm: TrainModel, paths: OnlinePaths) -> tuple[int, Thresholds]:
    """Put a freshly built model back at the last complete delta's step (rank 0 then removes
    every later file a killed run left); returns that step and the next delta's threshold
    (step 0 and the model's own threshold when there is no delta yet)."""
    step, state = rebuild(tm, paths)
    rank = tm.rank
    if rank.world_size > 1:
        dist.barrier(group=rank.group)
    if rank.first:
        paths.remove_after(max(step, 0))
    if state is None:
        return 0, table_threshold(tm.dmp)
    threshold: Thresholds = state["threshold"]
    return step, threshold
