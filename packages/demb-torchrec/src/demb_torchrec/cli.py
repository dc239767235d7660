"""The ``demb`` command: ``demb`` (or ``demb env``) reports the environment; ``demb bench
module`` runs the table module's reference workload; ``demb bench dlrm`` a DistributedModelParallel
train step of a DLRM-like model on dynamic tables; ``demb bench balance`` the keys per rank of the
two modulo routings."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["environment_report", "main"]

_DISTRIBUTIONS = (
    "demb-planner",
    "demb-io",
    "demb-kernels",
    "demb-optim",
    "demb-storage",
    "demb-torchrec",
    "torch",
    "torchrec",
    "fbgemm-gpu",
    "fbgemm-gpu-cpu",
    "numpy",
)


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> list[tuple[str, str]]:
    """``(name, value)`` lines: package versions, which kernels are built, the device found."""
    import torch
    from demb_kernels import cuda_kernels_built, has_kernel

    lines = [("python", sys.version.split()[0])]
    lines += [(name, _version(name)) for name in _DISTRIBUTIONS]
    cpu_built = has_kernel("hash64", "CPU")
    lines.append(("demb CPU kernels", "built" if cpu_built else "missing"))
    if cpu_built:
        from demb_kernels.pooling import pool_cpu_build

        lines.append(("demb CPU pooling", f"{pool_cpu_build()} build"))
    lines.append(("demb CUDA kernels", "built" if cuda_kernels_built() else "not built"))
    if torch.cuda.is_available():
        device = f"cuda: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        device = "cpu (no CUDA device visible)"
    lines.append(("device", device))
    try:
        logging.disable(logging.WARNING)  # fbgemm_gpu logs a compatibility-table notice per op
        import fbgemm_gpu  # noqa: F401

        fbgemm = "imports"
    except Exception as error:
        fbgemm = f"fails to import: {type(error).__name__}: {error}"
    finally:
        logging.disable(logging.NOTSET)
    lines.append(("fbgemm_gpu", fbgemm))
    return lines


def _bench_module(args: argparse.Namespace) -> int:
    import torch

    from demb_torchrec.bench.module_bench import run
    from demb_torchrec.bench.workload import Workload

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    scale = args.scale if args.scale is not None else (1.0 if device.type == "cuda" else 0.01)
    w = Workload(
        pooling=args.pooling,
        optimizer=args.optimizer,
        check_gradients=not args.no_check_gradients,
    ).scaled(scale)
    overrides = {k: getattr(args, k) for k in ("tables", "dim", "rows", "samples")}
    w = Workload(**{**w.as_dict(), **{k: v for k, v in overrides.items() if v is not None}})
    report = run(w, device, args.steps, args.warmup, baseline=not args.no_baseline)
    return _write_report(report, args)


def _write_report(report: dict[str, Any], args: argparse.Namespace) -> int:
    """Stamp a benchmark's report with the command that made it and write it as JSON to
    ``--out`` (if given); the command's exit code."""
    report["command"] = "demb " + " ".join(args.argv)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0


def _bench_dlrm(args: argparse.Namespace) -> int:
    import torch

    from demb_torchrec.bench.dlrm_bench import DlrmWorkload, run

    gpu = torch.cuda.is_available()
    w = DlrmWorkload(
        world_size=args.world_size,
        batch_size=args.batch_size or (8192 if gpu else 1024),
        scale=args.scale if args.scale is not None else (1.0 if gpu else 0.001),
        steps=args.steps,
        warmup=args.warmup,
    )
    report = run(w)
    print(
        f"dlrm on {report['device']} x {w.world_size} ({report['backend']}): 26 dynamic tables "
        f"({sum(report['table_rows']):,} rows, D={w.dim}), batch {w.batch_size} per rank: "
        f"{report['step_ms']:.3f} ms per step, {report['samples_per_s']:,.0f} samples/s"
    )
    return _write_report(report, args)


def _bench_balance(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.balance_bench import BalanceWorkload, run

    w = BalanceWorkload(world_size=args.world_size, batch_size=args.batch_size, steps=args.steps)
    report = run(w)
    print(f"keys per rank on {report['device']} x {w.world_size} ({report['backend']}):")
    for name, t in report["tables"].items():
        print(f"  {name:<28} max/mean {t['max_over_mean']:.3f}  per rank {t['keys_per_rank']}")
    return _write_report(report, args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demb", description="demb: dynamic embedding tables.")
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("env", help="print the environment (also what a bare `demb` does)")
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    module = bench.add_parser(
        "module",
        help="the table module on the reference workload (10 tables, D=128, power-law ids)",
    )
    module.add_argument("--device", help="cuda or cpu (default: cuda when visible)")
    module.add_argument(
        "--scale",
        type=float,
        help="rows and samples times this (default 1 on a GPU, 0.01 on the CPU)",
    )
    module.add_argument("--pooling", choices=["none", "sum"], default="none")
    module.add_argument(
        "--optimizer", choices=["adam", "sgd", "adagrad", "rowwise_adagrad"], default="adam"
    )
    for name in ("tables", "dim", "rows", "samples"):
        module.add_argument(f"--{name}", type=int, help=f"override the workload's {name}")
    module.add_argument("--steps", type=int, default=20, help="timed steps")
    module.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    module.add_argument("--no-baseline", action="store_true", help="skip the TorchRec baseline")
    module.add_argument(
        "--no-check-gradients",
        action="store_true",
        help="the module's check_gradients=False: no NaN/inf check before each update",
    )
    module.add_argument("--out", help="write the report as JSON here")
    dlrm = bench.add_parser(
        "dlrm", help="a DMP train step of a DLRM-like model on 26 dynamic tables (Criteo sizes)"
    )
    dlrm.add_argument("--world-size", type=int, default=1, help="local ranks (one per GPU)")
    dlrm.add_argument("--batch-size", type=int, help="samples per rank (8192 GPU, 1024 CPU)")
    dlrm.add_argument(
        "--scale", type=float, help="table rows times this (default 1 on a GPU, 0.001 on the CPU)"
    )
    dlrm.add_argument("--steps", type=int, default=20, help="timed steps")
    dlrm.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    dlrm.add_argument("--out", help="write the report as JSON here")
    balance = bench.add_parser(
        "balance", help="keys per rank under roundrobin vs hash_roundrobin (strided, power law)"
    )
    balance.add_argument("--world-size", type=int, default=2, help="local ranks (one per GPU)")
    balance.add_argument("--batch-size", type=int, default=8192, help="keys per rank and step")
    balance.add_argument("--steps", type=int, default=8, help="forwards")
    balance.add_argument("--out", help="write the report as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``demb``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    if args.command == "bench":
        runs = {"dlrm": _bench_dlrm, "balance": _bench_balance, "module": _bench_module}
        return runs[args.bench](args)
    for name, value in environment_report():
        print(f"{name:<20} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
