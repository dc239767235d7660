"""The command lines of ``demb train`` and ``demb serve`` (also ``python -m demb_torchrec.train
[serve]``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from demb_torchrec._quiet import quiet_torchrec
from demb_torchrec.errors import DembError
from demb_torchrec.train.config import DEFAULTS, NOT_BUILT, Settings, load_settings, parse_override

__all__ = ["main_serve", "main_train"]

_FLAGS = {
    "data": ("data", "path"),
    "out": ("output", "dir"),
    "steps": ("train", "steps"),
    "batch_size": ("data", "batch_size"),
    "seed": ("data", "seed"),
    "log_every": ("train", "log_every"),
    "eval_every": ("train", "eval_every"),
    "delta_every": ("online", "delta_every"),
    "ckpt_every": ("online", "ckpt_every"),
}
"""Dedicated flags and the setting each sets (after ``--config`` and ``--set``)."""

_RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _settings_help() -> str:
    lines = ["settings (TOML sections of --config, or --set section.key=value):"]
    for section, body in DEFAULTS.items():
        keys = ", ".join(f"{k}={v!r}" for k, v in body.items())
        lines.append(f"  [{section}] {keys}")
    lines.append("  [tables.cat_N] any [tables] key for one table (cat_0 ... cat_25)")
    lines.append(
        "  [optimizer] knobs by kind: adam eps/beta1/beta2/weight_decay; adagrad and "
        "rowwise_adagrad eps/initial_accumulator_value; ftrl l1_reg/l2_reg/"
        "learning_rate_power/ftrl_beta/initial_accumulator_value; all gradient_clipping/"
        "max_gradient"
    )
    lines.append(f"  set by the planner (fail when set): tables.{', tables.'.join(NOT_BUILT)}")
    return "\n".join(lines)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="a TOML file of settings (see below)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one setting (TOML value syntax); repeatable",
    )
    parser.add_argument("--out", help="output directory (output.dir)")
    parser.add_argument("--data", help="Criteo TSV or Parquet file (default: synthetic stream)")
    for flag in ("steps", "batch_size", "seed", "log_every", "eval_every"):
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=int)
    parser.add_argument("--delta-every", dest="delta_every", type=int, help="0: no deltas")
    parser.add_argument("--ckpt-every", dest="ckpt_every", type=int, help="0: only at the end")


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="demb train",
        description=(
            "Train a DLRM whose 26 sparse features are dynamic tables: new ids are admitted "
            "on the fly, full buckets evict, an incremental dump goes to <out>/deltas every "
            "--delta-every steps and a full checkpoint to <out>/ckpt every --ckpt-every. "
            "Logs: <out>/train.jsonl, <out>/tensorboard, <out>/plots."
        ),
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    p.add_argument("--replica", action="store_true", help="also run `demb serve` beside it")
    p.add_argument("--world-size", type=int, default=0, help="ranks to start through torchrun")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--print-config", action="store_true", help="print the settings and exit")
    return p


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="demb serve",
        description=(
            "A replica of a `demb train` run: replays the deltas in <out>/deltas into an "
            "eval-only copy of the model as they appear, evaluates at the trainer's eval "
            "steps and logs its AUC and lag to <out>/replica.jsonl. Give it the run's settings."
        ),
        epilog=_settings_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(p)
    p.add_argument("--no-follow", action="store_true", help="replay what is there and stop")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a delta")
    return p


def _load(args: argparse.Namespace) -> Settings:
    overrides: list[tuple[Sequence[str], Any]] = [parse_override(s) for s in args.set]
    for flag, path in _FLAGS.items():
        value = getattr(args, flag, None)
        if value is not None:
            overrides.append((path, value))
    return load_settings(args.config, overrides)


def main_train(argv: Sequence[str]) -> int:
    """``demb train``: returns the exit status."""
    args = _train_parser().parse_args(list(argv))
    try:
        settings = _load(args)
        if args.print_config:
            _print_settings(settings)
            return 0
        if args.world_size and "RANK" not in os.environ:
            return _torchrun(args.world_size, _without(argv))
        quiet_torchrec()
        from demb_torchrec.train.loop import train

        started: list[subprocess.Popen[bytes]] = []

        def ready() -> None:  # the output directory is ready: the replica may look at it
            if args.replica:
                started.append(_start_replica(argv))

        try:
            summary = train(
                settings,
                resume=args.resume,
                overwrite=args.overwrite,
                progress=not args.no_progress,
                on_ready=ready,
            )
        except BaseException:
            for replica in started:  # no run to follow any more
                replica.terminate()
            raise
        code = started[0].wait() if started else 0
    except DembError as err:
        print(f"demb train: {err}", file=sys.stderr)
        return 2
    if _first_rank():
        from demb_torchrec.train.summary import print_summary

        print_summary(summary, settings)
    return code


def main_serve(argv: Sequence[str]) -> int:
    """``demb serve``: returns the exit status."""
    args = _serve_parser().parse_args(list(argv))
    try:
        settings = _load(args)
        quiet_torchrec()
        from demb_torchrec.train.serve import serve

        result = serve(settings, follow=not args.no_follow, timeout_s=args.timeout)
    except DembError as err:
        print(f"demb serve: {err}", file=sys.stderr)
        return 2
    last = result.evals[-1] if result.evals else None
    shown = f", AUC {last[1]:.4f} at step {last[0]}" if last else ""
    if _first_rank():
        print(f"demb serve: replica at step {result.step}, {len(result.evals)} evaluations{shown}")
    return 0


def _first_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _print_settings(settings: Settings) -> None:
    for section, body in settings.as_dict().items():
        print(f"[{section}]")
        for key, value in body.items():
            print(f"  {key} = {value!r}")


_TRAINER_ONLY = ("--resume", "--overwrite", "--replica", "--no-progress", "--print-config")
"""Flags of ``demb train`` that a replica started beside it does not take."""


def _without(argv: Sequence[str], flags: Sequence[str] = ()) -> list[str]:
    """``argv`` without ``--world-size`` (and its value) and without ``flags``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--world-size":
            skip = True
        elif not (a.startswith("--world-size=") or a in flags):
            out.append(a)
    return out


def _launch(world_size: int, *, torchrun: bool = False) -> list[str]:
    """The start of a command running ``-m <module>`` on ``world_size`` local ranks (through
    torchrun when more than one, or when ``torchrun``)."""
    launch = [sys.executable, "-m"]
    if world_size > 1 or torchrun:
        launch += [
            "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}", "-m",
        ]  # fmt: skip
    return launch


def _torchrun(world_size: int, argv: list[str]) -> int:
    """Run ``demb train argv`` on ``world_size`` local ranks through torchrun."""
    return subprocess.call([*_launch(world_size, torchrun=True), "demb_torchrec.train", *argv])


def _start_replica(argv: Sequence[str]) -> subprocess.Popen[bytes]:
    """``demb serve`` with the trainer's settings, in processes of its own: one, or as many as
    the trainer's ranks through torchrun."""
    keep = _without(argv, _TRAINER_ONLY)
    env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
    world = int(os.environ.get("WORLD_SIZE", "1"))  # a delta's layout includes the world size
    return subprocess.Popen([*_launch(world), "demb_torchrec.train", "serve", *keep], env=env)
