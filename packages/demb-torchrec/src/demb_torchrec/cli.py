"""The ``demb`` command: ``demb`` (or ``demb env``) reports the environment; ``demb bench
module`` runs the table module's reference workload (``--profile``: and where its steps spend
their time); ``demb bench dlrm`` a DistributedModelParallel train step of a DLRM-like model on
dynamic tables (at one world size, or several with their scaling efficiency); ``demb bench
balance`` the keys per rank of the two modulo routings; ``demb bench table``, ``update`` and
``io`` the hash table ops, the fused optimizer update and checkpoint I/O, each figure beside a
baseline measured in the same run; ``demb bench fuzz`` reads back mutated checkpoints and
deltas; ``demb bench soak`` memory over a long evicting training run beside eval forwards;
``demb bench readspeed`` checkpoint reads of the current demb-io beside an older one; ``demb
bench delta`` incremental dumps, their replay and the non-blocking dump beside copies of the
same bytes; ``demb bench tiers`` caching tables beside all-device tables and the copy floor of
the rows crossing between the tiers."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from demb_torchrec.bench._parsers import (
    add_admission_parser,
    add_delta_parser,
    add_fuzz_parser,
    add_io_parser,
    add_readspeed_parser,
    add_retain_parser,
    add_soak_parser,
    add_tiers_parser,
)
from demb_torchrec.bench._parsers import bench_parser as _bench_parser

if TYPE_CHECKING:
    import torch

    _Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = ["environment_report", "main"]

_UPDATE_OPTIMIZERS = ("adam", "ftrl", "sgd", "adagrad", "rowwise_adagrad")
"""``demb bench update``'s optimizers (:data:`demb_torchrec.bench.update_bench.OPTIMIZERS`)."""

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
    if args.profile or args.trace:
        from demb_torchrec.bench.module_profile import print_profile, profile_module

        report["profile"] = profile_module(w, device, trace=args.trace)
        print_profile(report["profile"])
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


def _device(args: argparse.Namespace) -> torch.device:
    """``--device``, or CUDA when visible, else the CPU (a ``torch.device``)."""
    import torch

    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _bench_table(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.table_bench import CPU_WORKLOAD, TableWorkload, run

    device = _device(args)
    base = TableWorkload() if device.type == "cuda" else CPU_WORKLOAD
    given = {k: getattr(args, k) for k in ("capacity_log2", "batch", "iters", "copy_mib")}
    if args.dims is not None:
        given["dims"] = tuple(args.dims)
    w = dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    return _write_report(run(w, device, profile=args.profile), args)


def _bench_update(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.update_bench import UpdateWorkload, run

    device = _device(args)
    scale = args.scale if args.scale is not None else (1.0 if device.type == "cuda" else 0.1)
    w = UpdateWorkload(
        dim=args.dim, dtype=args.dtype, iters=args.iters, optimizers=tuple(args.optimizers)
    ).scaled(scale)
    given = {k: getattr(args, k) for k in ("rows", "table_rows", "copy_mib")}
    w = dataclasses.replace(w, **{k: v for k, v in given.items() if v is not None})
    return _write_report(run(w, device), args)


def _bench_io(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.io_bench import IoWorkload, run

    w = IoWorkload(rows=args.rows, dim=args.dim, repeats=args.repeats, directory=args.dir)
    return _write_report(run(w), args)


def _bench_dlrm(args: argparse.Namespace) -> int:
    import torch

    from demb_torchrec.bench.dlrm_bench import DlrmWorkload, describe, run, run_scaling

    gpu = torch.cuda.is_available()
    sizes: list[int] = args.world_size
    w = DlrmWorkload(
        world_size=sizes[0],
        batch_size=args.batch_size or (8192 if gpu else 1024),
        scale=args.scale if args.scale is not None else (1.0 if gpu else 0.001),
        steps=args.steps,
        warmup=args.warmup,
    )
    if len(sizes) > 1:
        return _write_report(run_scaling(w, sizes), args)
    report = run(w)
    print(describe(report))
    return _write_report(report, args)


def _world_sizes(text: str) -> list[int]:
    """``--world-size``: one positive integer, or a comma list of them that holds 1 (the
    scaling baseline), each once."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not an integer or a comma list") from None
    if any(size < 1 for size in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: world sizes must be >= 1")
    if len(sizes) > 1 and (1 not in sizes or len(set(sizes)) != len(sizes)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a list must hold 1 (the scaling baseline) and each size once"
        )
    return sizes


def _bench_fuzz(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.fuzz_bench import FuzzWorkload, run

    w = FuzzWorkload(
        cases=args.cases,
        seed=args.seed,
        case_seconds=args.case_seconds,
        readers=tuple(args.readers),
        case=args.case,
        listed=args.list,
        reseal=args.reseal,
    )
    report = run(w)
    _write_report(report, args)
    return 1 if report["failed"] else 0


def _bench_soak(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.soak_bench import SoakWorkload, run

    w = SoakWorkload(
        steps=args.steps,
        warmup=args.warmup,
        every=args.every,
        dump_every=args.dump_every,
        dims=tuple(args.dims),
        model=args.model,
        scale=args.scale,
    )
    report = run(w, _device(args))
    _write_report(report, args)
    dump = report["dump"]
    return 1 if dump is not None and dump["exact"] != dump["round_trips"] else 0


def _bench_readspeed(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.readspeed_bench import ReadspeedWorkload, run

    w = ReadspeedWorkload(
        baseline=args.baseline,
        gb=args.gb,
        repeats=args.repeats,
        tables=args.tables,
        dim=args.dim,
        cold=args.cold,
        limit=args.limit,
        directory=args.dir,
        verify_calls=args.verify_calls,
    )
    return _write_report(run(w), args)


def _bench_retain(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.retain_bench import RetainWorkload, run

    device = _device(args)
    default = 1.0 if device.type == "cuda" else 0.01
    w = RetainWorkload(
        scale=args.scale if args.scale is not None else default,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
    )
    return _write_report(run(w, device), args)


def _bench_admission(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.admission_bench import AdmissionWorkload, run

    device = _device(args)
    default = 1.0 if device.type == "cuda" else 0.01
    w = AdmissionWorkload(
        scale=args.scale if args.scale is not None else default,
        steps=args.steps,
        rounds=args.rounds,
        warmup=args.warmup,
        seed=args.seed,
    )
    return _write_report(run(w, device), args)


def _bench_tiers(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.tiers_bench import TiersWorkload, run

    device = _device(args)
    default = 1.0 if device.type == "cuda" else 0.01
    w = TiersWorkload(
        scale=args.scale if args.scale is not None else default,
        optimizer=args.optimizer,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
    )
    return _write_report(run(w, device), args)


def _bench_delta(args: argparse.Namespace) -> int:
    from demb_torchrec.bench.delta_bench import DeltaWorkload, run

    device = _device(args)
    cuda = device.type == "cuda"
    w = DeltaWorkload(
        scale=args.scale if args.scale is not None else (1.0 if cuda else 0.01),
        touched=args.touched,
        repeats=args.repeats if args.repeats is not None else (5 if cuda else 3),
        load_factor=args.load_factor,
        min_steps=args.min_steps,
        directory=args.dir,
        seed=args.seed,
    )
    return _write_report(run(w, device), args)


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
    sub.add_parser("train", help="the main job: train a DLRM on dynamic tables (--help)")
    sub.add_parser("serve", help="a replica following a training run's deltas (--help)")
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    module = _bench_parser(
        bench,
        "module",
        "the table module on the reference workload (10 tables, D=128, power-law ids)",
        device=True,
        scale="rows and samples times this (default 1 on a GPU, 0.01 on the CPU)",
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
    module.add_argument(
        "--profile",
        action="store_true",
        help="after the timed run, profile a few more steps (torch.profiler) and print the top "
        "ops by device and host time (also in the JSON)",
    )
    module.add_argument(
        "--trace", metavar="FILE", help="with --profile (implied): write a Chrome trace here"
    )
    dlrm = _bench_parser(
        bench,
        "dlrm",
        "a DMP train step of a DLRM-like model on 26 dynamic tables (Criteo sizes)",
        scale="table rows times this (default 1 on a GPU, 0.001 on the CPU)",
    )
    dlrm.add_argument(
        "--world-size",
        type=_world_sizes,
        default=[1],
        metavar="W[,W...]",
        help="local ranks (one per GPU); a comma list such as 1,2,4 runs each in turn and "
        "prints each one's samples/s beside W x the 1-rank figure (weak scaling efficiency). "
        "Where NVLink multicast misbehaves, run with NCCL_NVLS_ENABLE=0",
    )
    dlrm.add_argument("--batch-size", type=int, help="samples per rank (8192 GPU, 1024 CPU)")
    dlrm.add_argument("--steps", type=int, default=20, help="timed steps")
    dlrm.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    balance = _bench_parser(
        bench, "balance", "keys per rank under roundrobin vs hash_roundrobin (strided, power law)"
    )
    balance.add_argument("--world-size", type=int, default=2, help="local ranks (one per GPU)")
    balance.add_argument("--batch-size", type=int, default=8192, help="keys per rank and step")
    balance.add_argument("--steps", type=int, default=8, help="forwards")
    _add_table_parser(bench)
    _add_update_parser(bench)
    add_io_parser(bench)
    add_fuzz_parser(bench)
    add_soak_parser(bench)
    add_readspeed_parser(bench)
    add_delta_parser(bench)
    add_retain_parser(bench)
    add_admission_parser(bench)
    add_tiers_parser(bench)
    return parser


def _add_table_parser(bench: _Subparsers) -> None:
    table = _bench_parser(
        bench,
        "table",
        "hash table ops (lookup, find_or_insert, insert with eviction) in keys/s beside the "
        "same run's copy floor",
        device=True,
    )
    table.add_argument(
        "--capacity-log2",
        type=int,
        help="the table's slots, log2 (default 27, the full size, on a GPU; 20 on the CPU)",
    )
    table.add_argument(
        "--batch", type=int, help="keys per batch (default 1048576 on a GPU, 8192 on the CPU)"
    )
    table.add_argument("--dims", type=int, nargs="+", help="value dims (default 32 128)")
    table.add_argument(
        "--iters", type=int, help="timed batches per op (default 20 on a GPU, 10 on the CPU)"
    )
    table.add_argument(
        "--copy-mib", type=int, help="MiB copied to measure bandwidth (1024 GPU, 512 CPU)"
    )
    table.add_argument(
        "--profile",
        action="store_true",
        help="also print torch.profiler's per-kernel time of lookup and find_or_insert",
    )


def _add_update_parser(bench: _Subparsers) -> None:
    update = _bench_parser(
        bench,
        "update",
        "the fused optimizer update beside the same run's copy floor and a torch update",
        device=True,
        scale="rows and table rows times this (default 1, the full size: 350,000 of 2,000,000 "
        "rows, on a GPU; 0.1 on the CPU)",
    )
    update.add_argument("--rows", type=int, help="override the updated (unique) rows")
    update.add_argument("--table-rows", type=int, help="override the table's rows")
    update.add_argument("--dim", type=int, default=128, help="embedding dim (default 128)")
    update.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        default="float32",
        help="the rows' dtype (default float32)",
    )
    update.add_argument(
        "--optimizers",
        nargs="+",
        choices=_UPDATE_OPTIMIZERS,
        default=list(_UPDATE_OPTIMIZERS),
        metavar="OPT",
        help=f"optimizers timed, in order (default: all of {', '.join(_UPDATE_OPTIMIZERS)})",
    )
    update.add_argument("--iters", type=int, default=10, help="timed calls per figure (10)")
    update.add_argument("--copy-mib", type=int, help="MiB copied to measure bandwidth (512)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``demb``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("train", "serve"):  # their own parsers (their --help)
        from demb_torchrec.train.cli import main_serve, main_train

        return (main_train if argv[0] == "train" else main_serve)(argv[1:])
    args = _parser().parse_args(argv)
    args.argv = argv
    if args.command == "bench":
        runs = {
            "dlrm": _bench_dlrm,
            "balance": _bench_balance,
            "module": _bench_module,
            "table": _bench_table,
            "update": _bench_update,
            "io": _bench_io,
            "fuzz": _bench_fuzz,
            "soak": _bench_soak,
            "readspeed": _bench_readspeed,
            "delta": _bench_delta,
            "retain": _bench_retain,
            "admission": _bench_admission,
            "tiers": _bench_tiers,
        }
        return runs[args.bench](args)
    for name, value in environment_report():
        print(f"{name:<20} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
