"""The readers ``demb bench fuzz`` runs on mutated inputs, and what each one reads (its content).

Every reader takes the paths of the undamaged inputs (:data:`INPUTS`), one of them swapped for a
mutated copy, and an empty output folder, and returns its content: a tuple of ``(label, value)``
entries that the undamaged inputs give identically on every run. The demb-io CLI's subcommands
are run through their own functions (``demb_io.cli._verify`` and the rest: what ``demb-io
verify`` runs, without the catch that turns any ``ValueError`` or ``OSError`` into exit status
2), their printed lines (paths replaced by names) being part of the content, and what they wrote
read back. ``load`` is :func:`~demb_torchrec.DynamicEmbLoad` into a fresh small CPU model
(torch is imported by that reader only).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from demb_io import Checkpoint, IoError, read_delta
from demb_io import cli as io_cli
from demb_io.mutations import FUZZ_COLLECTIONS, FUZZ_TABLES, fuzz_checkpoint, fuzz_delta
from demb_planner import DembError

if TYPE_CHECKING:
    from torch import nn

__all__ = [
    "INPUTS",
    "READERS",
    "Content",
    "DirtyError",
    "Reader",
    "checkpoint_content",
    "delta_content",
    "diff",
    "leftovers",
    "model_content",
]

Content = tuple[tuple[str, Any], ...]
"""What a reader read: ``(label, value)`` entries (an array's dtype, shape and bytes, a meta
as sorted JSON, a printed line), in reading order."""
Paths = Mapping[str, Path]

INPUTS: dict[str, Callable[[Path], None]] = {
    "checkpoint": fuzz_checkpoint,
    "delta1": fuzz_delta,
    "delta2": functools.partial(fuzz_delta, later=True),
    "prefill": functools.partial(fuzz_checkpoint, seed=5),
}
"""The undamaged inputs, by name, and the function writing each: the checkpoint, a delta that
applies to it, the next delta (``merge``'s second), and the checkpoint ``load``'s model holds
before its load (never mutated)."""

_TABLES = [(c, t) for c in FUZZ_COLLECTIONS for t in FUZZ_TABLES]


class DirtyError(Exception):
    """A reader's typed error that left its target changed (``load``: the model)."""


@dataclass(frozen=True)
class Reader:
    """A reader: the ``inputs`` it may be given mutated (one per case), its ``run(paths,
    out)``, the ``typed`` errors it may raise, and whether its output is ``atomic`` (after an
    error, ``out`` must be empty; otherwise only outputs completed before it may remain)."""

    inputs: tuple[str, ...]
    run: Callable[[Paths, Path], Content]
    typed: type[Exception] = IoError
    atomic: bool = False


def _arrays(where: str, data: object) -> Content:
    """The array fields of ``data`` (a ShardData or DeltaTable; a None field as ``None``)."""
    rows: list[tuple[str, Any]] = []
    for f in dataclasses.fields(data):  # type: ignore[arg-type]
        value = getattr(data, f.name)
        if value is None or isinstance(value, np.ndarray):
            array = None if value is None else (value.dtype.str, value.shape, value.tobytes())
            rows.append((f"{where}.{f.name}", array))
    return tuple(rows)


def _meta(where: str, meta: object) -> tuple[str, Any]:
    text = json.dumps(dataclasses.asdict(meta), sort_keys=True, default=str)  # type: ignore[call-overload]
    return (f"{where} meta", text)


def checkpoint_content(path: Path) -> Content:
    """Every table of the checkpoint at ``path``: its shards' metas and all its rows (CRCs
    checked)."""
    ckpt = Checkpoint(path)
    rows: Content = ()
    for collection in ckpt.collections():
        for table in ckpt.tables(collection):
            where = f"{collection}/{table}"
            metas = ckpt.shards(collection, table)
            rows += tuple(_meta(f"{where}.rank{m.rank}", m) for m in metas)
            rows += _arrays(where, ckpt.read_table(collection, table))
    return rows


def delta_content(path: Path) -> Content:
    """Every table of the delta at ``path``: its meta and rows (CRCs checked)."""
    rows: Content = ()
    for table in read_delta(path):
        where = f"{table.meta.collection}/{table.meta.table}"
        rows += (_meta(where, table.meta), *_arrays(where, table))
    return rows


def _cli(
    command: Callable[[argparse.Namespace], None],
    paths: Paths,
    folder: Path,
    section: str = "",
    **args: object,
) -> Content:
    """The lines ``command`` (a ``demb_io.cli`` subcommand) prints, paths replaced by names
    (``folder``: ``<out>``), each labelled with the subcommand, ``section`` and its first
    word."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        command(argparse.Namespace(**args))
    text = printed.getvalue()
    names = [(str(p), f"<{n}>") for n, p in paths.items()] + [(str(folder), "<out>")]
    for path, name in sorted(names, key=lambda pn: -len(pn[0])):
        text = text.replace(path, name)
    lines = [line.split() for line in text.splitlines() if line.strip()]
    where = " ".join(w for w in (command.__name__[1:], section) if w)
    return tuple((f"{where} {words[0]}", " ".join(words)) for words in lines)


_PRINTED = ("verify ", "inspect ", "merge ", "apply ", "reshard ", "export ")
"""The labels of printed lines (:func:`_cli`)."""


def _read_back(read: Callable[[Path], Content], path: Path) -> Content:
    """What ``read`` reads of a reader's output, or an entry saying it cannot be read."""
    try:
        return read(path)
    except Exception as err:
        return (("unreadable output", f"{type(err).__name__}: {err}"),)


def _verify_checkpoint(paths: Paths, out: Path) -> Content:
    return _cli(io_cli._verify, paths, out, path=str(paths["checkpoint"]))


def _verify_delta(paths: Paths, out: Path) -> Content:
    return _cli(io_cli._verify, paths, out, path=str(paths["delta1"]))


def _inspect(paths: Paths, out: Path) -> Content:
    return tuple(
        line
        for name in ("checkpoint", "delta1")
        for line in _cli(io_cli._inspect, paths, out, name, path=str(paths[name]))
    )


def _read_checkpoint(paths: Paths, out: Path) -> Content:
    return checkpoint_content(paths["checkpoint"])


def _read_delta(paths: Paths, out: Path) -> Content:
    return delta_content(paths["delta1"])


def _merge(paths: Paths, out: Path) -> Content:
    deltas = [str(paths["delta1"]), str(paths["delta2"])]
    printed = _cli(io_cli._merge, paths, out, out=str(out / "merged"), deltas=deltas)
    return printed + _read_back(delta_content, out / "merged")


def _apply(paths: Paths, out: Path) -> Content:
    printed = _cli(
        io_cli._apply,
        paths,
        out,
        checkpoint=str(paths["checkpoint"]),
        delta=str(paths["delta1"]),
        out=str(out / "applied"),
    )
    return printed + _read_back(checkpoint_content, out / "applied")


def _reshard(paths: Paths, out: Path) -> Content:
    printed = _cli(
        io_cli._reshard,
        paths,
        out,
        checkpoint=str(paths["checkpoint"]),
        out=str(out / "resharded"),
        world_size=3,
        dist_type="hash_roundrobin",
        num_embeddings=None,
    )
    return printed + _read_back(checkpoint_content, out / "resharded")


def _npz(path: Path) -> Content:
    with np.load(path) as archive:
        return tuple(
            (f"{path.stem}.{k}", (archive[k].dtype.str, archive[k].shape, archive[k].tobytes()))
            for k in sorted(archive.files)
        )


def _export(paths: Paths, out: Path) -> Content:
    rows: Content = ()
    for collection, table in _TABLES:
        target = out / f"{collection}.{table}.npz"
        rows += _cli(
            io_cli._export,
            paths,
            out,
            checkpoint=str(paths["checkpoint"]),
            collection=collection,
            table=table,
            out=str(target),
            format="npz",
            raw=False,
        )
        rows += _read_back(_npz, target)
    return rows


def _model() -> nn.Module:
    """A small CPU model holding :data:`~demb_io.mutations.FUZZ_TABLES` in each collection of
    :data:`~demb_io.mutations.FUZZ_COLLECTIONS` (adagrad)."""
    import torch

    from demb_torchrec import (
        DynamicEmbeddingTables,
        DynamicEmbPoolingMode,
        DynamicEmbScoreStrategy,
        DynamicEmbTableOptions,
    )

    def options(dtype: str, dim: int, scores: tuple[str, ...]) -> DynamicEmbTableOptions:
        strategy = tuple(getattr(DynamicEmbScoreStrategy, s) for s in scores)
        return DynamicEmbTableOptions(
            dim=dim,
            max_capacity=128,
            embedding_dtype=getattr(torch, dtype),
            score_strategy=strategy if len(strategy) > 1 else strategy[0],
        )

    def tables() -> DynamicEmbeddingTables:
        return DynamicEmbeddingTables(
            [options(*spec[:3]) for spec in FUZZ_TABLES.values()],
            table_names=list(FUZZ_TABLES),
            pooling_mode=DynamicEmbPoolingMode.SUM,
            device="cpu",
            optimizer="adagrad",
        )

    return torch.nn.ModuleDict({c: tables() for c in FUZZ_COLLECTIONS})


def model_content(model: nn.Module) -> Content:
    """Every table of ``model`` (a :func:`_model`): its keys, rows (embedding and optimizer
    state) and scores, by key."""
    rows: list[tuple[str, Any]] = []
    for collection, module in model.items():  # type: ignore[operator]
        for i, table in enumerate(module.table_names):
            ex = module.tables.export(i)
            order = ex.keys.argsort()
            for name in ("keys", "values", "scores"):
                tensor = getattr(ex, name)[order]
                array = (tensor.float() if name == "values" else tensor).numpy()
                rows.append((f"{collection}/{table}.{name}", (array.shape, array.tobytes())))
    return tuple(rows)


def _load(paths: Paths, out: Path) -> Content:
    """DynamicEmbLoad (``optim=True``) into a fresh model that first loads ``prefill`` (other
    rows, some keys shared); a typed error must leave the model as it was."""
    from demb_torchrec import DynamicEmbLoad

    model = _model()
    DynamicEmbLoad(paths["prefill"], model, optim=True)
    before = model_content(model)
    try:
        DynamicEmbLoad(paths["checkpoint"], model, optim=True)
    except DembError as err:
        changed = diff(before, model_content(model))
        if changed:
            raise DirtyError(f"{type(err).__name__} left the model changed: {changed}") from err
        raise
    return model_content(model)


READERS: dict[str, Reader] = {
    "verify_checkpoint": Reader(("checkpoint",), _verify_checkpoint),
    "inspect": Reader(("checkpoint", "delta1"), _inspect),
    "read_checkpoint": Reader(("checkpoint",), _read_checkpoint),
    "read_delta": Reader(("delta1",), _read_delta),
    "verify_delta": Reader(("delta1",), _verify_delta),
    "merge": Reader(("delta1", "delta2"), _merge, atomic=True),
    "apply": Reader(("checkpoint", "delta1"), _apply, atomic=True),
    "reshard": Reader(("checkpoint",), _reshard, atomic=True),
    "export": Reader(("checkpoint",), _export),
    "load": Reader(("checkpoint",), _load, typed=DembError),
}
"""Every reader, by name: the demb-io CLI's ``verify`` (of the checkpoint, of a delta),
``inspect`` (both), ``merge`` (the two deltas), ``apply`` (the delta to the checkpoint),
``reshard`` (to 3 ranks) and ``export`` (each table to ``.npz``), their outputs read back;
``read_checkpoint`` and ``read_delta`` (demb-io's readers: metas and rows); ``load``
(DynamicEmbLoad)."""


def _labelled(content: Content) -> dict[str, Any]:
    """``content`` by label, a repeated label numbered from its second time (``label #2``)."""
    seen: dict[str, int] = {}
    labelled = {}
    for label, value in content:
        seen[label] = seen.get(label, 0) + 1
        labelled[label if seen[label] == 1 else f"{label} #{seen[label]}"] = value
    return labelled


def diff(reference: Content, content: Content, limit: int = 3) -> str:
    """What ``content`` lacks, adds or changes of ``reference``, by label (at most ``limit``
    of each); ``""`` when they are equal."""
    want, got = _labelled(reference), _labelled(content)
    parts = []
    for what, labels in (
        ("missing", [k for k in want if k not in got]),
        ("extra", [k for k in got if k not in want]),
        ("changed", [k for k in want if k in got and got[k] != want[k]]),
    ):
        if what == "changed":  # a printed line: what it says now
            labels = [f"{k} -> {got[k]!r}" if k.startswith(_PRINTED) else k for k in labels]  # noqa: PLW2901
        if labels:
            more = f" (+{len(labels) - limit})" if len(labels) > limit else ""
            parts.append(f"{what} {', '.join(labels[:limit])}{more}")
    if not parts and reference != content:
        parts.append("reordered")
    return "; ".join(parts)


def leftovers(reader: Reader, out: Path) -> list[str]:
    """What a reader's failed run left in ``out``: anything, for an ``atomic`` reader; else a
    scratch or staging file or folder (a hidden name, ``.tmp-`` or ``.old-``)."""
    return sorted(
        p.name
        for p in out.iterdir()
        if reader.atomic or p.name.startswith(".") or ".tmp-" in p.name or ".old-" in p.name
    )
