"""The online state of a ``demb train`` run: what a delta's dense file holds, the thresholds of
incremental dumps, and putting a model back at the step of the last delta (a resumed run, a
replica catching up).

A model is rebuilt from the delta chain: the last *full* delta (the one written at a
checkpoint step, holding every key with its slot) or, without one, the first delta (which holds
every key touched since the start), then every delta after it, each replayed with
:func:`~demb_torchrec.replay_increment`. A replay writes each key at the slot it held in the
source, so the rebuilt tables equal the source's slot for slot, and training goes on exactly
as it did. (:func:`~demb_torchrec.DynamicEmbLoad` of a full checkpoint restores the same keys,
rows and scores but not their slots, so evictions among equal scores could then pick other
victims: a resumed run would not be bit for bit the same.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from demb_torchrec.delta_files import read_delta_dump
from demb_torchrec.errors import CheckpointError
from demb_torchrec.model_tables import dynamic_tables
from demb_torchrec.replay import replay_increment
from demb_torchrec.scores import get_score
from demb_torchrec.train.config import Settings
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


def dense_state(tm: TrainModel, step: int, threshold: Thresholds, *, full: bool) -> dict[str, Any]:
    """Everything besides the tables' rows a run needs to go on from ``step``: the dense
    parameters and their optimizer's state, the tables' step counters (their STEP scores) and
    update counts (Adam's bias correction), the next delta's threshold, and whether the delta
    beside it is full."""
    return {
        "step": step,
        "full": full,
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


def _chain(paths: OnlinePaths) -> list[tuple[Saved, dict[str, Any]]]:
    """The deltas to replay: from the last full one (else the first) to the last."""
    found = [(d, load_dense(d.dense)) for d in paths.complete_deltas()]
    start = 0
    for i, (_, state) in enumerate(found):
        if state.get("full"):
            start = i
    return found[start:]


def rebuild(
    tm: TrainModel, paths: OnlinePaths, *, optimizer: bool = True
) -> tuple[int, dict[str, Any] | None]:
    """Replay the delta chain into a freshly built model and load the last delta's dense state
    (with its optimizer's state when ``optimizer``).

    Returns:
        The step the model is at now (-1 when there was no delta) and the last dense state
        read (None when there was no delta).
    """
    last: dict[str, Any] | None = None
    step = -1
    for saved, state in _chain(paths):
        replay_increment(tm.dmp, read_delta_dump(saved.tables))
        last, step = state, saved.step
    if last is not None:
        apply_dense(tm, last, optimizer)
    return step, last


def replay_one(tm: TrainModel, saved: Saved, *, optimizer: bool = True) -> dict[str, Any]:
    """Replay one more delta (the next after the model's step) and load its dense state."""
    state = load_dense(saved.dense)
    replay_increment(tm.dmp, read_delta_dump(saved.tables))
    apply_dense(tm, state, optimizer)
    return state


def restore(tm: TrainModel, paths: OnlinePaths, settings: Settings) -> tuple[int, Thresholds]:
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
