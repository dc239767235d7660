"""The argument parsers of ``demb bench io``, ``fuzz``, ``soak``, ``readspeed``, ``delta``,
``retain``, ``admission`` and ``tiers`` (and the parser every ``demb bench`` subcommand starts
from); imported by :mod:`demb_torchrec.cli`.
No torch import: ``demb --help`` stays fast."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    _Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

__all__ = [
    "add_admission_parser",
    "add_delta_parser",
    "add_fuzz_parser",
    "add_io_parser",
    "add_readspeed_parser",
    "add_retain_parser",
    "add_soak_parser",
    "add_tiers_parser",
    "bench_parser",
]


def bench_parser(
    bench: _Subparsers, name: str, summary: str, *, device: bool = False, scale: str | None = None
) -> argparse.ArgumentParser:
    """The parser of ``demb bench NAME`` (``summary``: its help), with ``--out`` and, where
    asked, ``--device`` and ``--scale`` (``scale``: its help)."""
    parser = bench.add_parser(name, help=summary)
    parser.add_argument("--out", help="write the report as JSON here")
    if device:
        parser.add_argument("--device", help="cuda or cpu (default: cuda when visible)")
    if scale is not None:
        parser.add_argument("--scale", type=float, help=scale)
    return parser


def add_io_parser(bench: _Subparsers) -> None:
    """``demb bench io``."""
    io = bench_parser(
        bench, "io", "checkpoint write and read beside raw numpy file writes and reads"
    )
    io.add_argument(
        "--rows",
        type=int,
        default=262_144,
        help="the table's rows (default 262144: 0.14 GB; the full size is 4000000, with "
        "--repeats 16)",
    )
    io.add_argument("--dim", type=int, default=128, help="embedding dim, float32 (128)")
    io.add_argument("--repeats", type=int, default=6, help="timed repeats, even (6)")
    io.add_argument("--dir", help="where to write (default: the system's temporary folder)")


def add_fuzz_parser(bench: _Subparsers) -> None:
    """``demb bench fuzz``."""
    readers = (
        "verify_checkpoint",
        "inspect",
        "read_checkpoint",
        "read_delta",
        "verify_delta",
        "merge",
        "apply",
        "reshard",
        "export",
        "load",
    )  # fmt: skip  (fuzz_readers.READERS, named here without importing it)
    fuzz = bench_parser(
        bench,
        "fuzz",
        "seeded mutations (bytes, JSON numbers, files and folders deleted, swapped, renamed or "
        "added, FIFOs, symlinks) of a real checkpoint and deltas, each read by one reader: "
        "fails on anything but identical content or a typed error within the time limit",
    )
    fuzz.add_argument("--cases", type=int, default=2000, help="cases, in all (2000)")
    fuzz.add_argument("--seed", type=int, default=0, help="the mutations' seed (0)")
    fuzz.add_argument(
        "--readers",
        nargs="+",
        choices=readers,
        default=list(readers),
        metavar="READER",
        help=f"the readers, taking turns (default: all of {', '.join(readers)})",
    )
    fuzz.add_argument(
        "--case",
        type=int,
        metavar="I",
        help="run case I alone (same --seed and --readers), printing its traceback if any",
    )
    fuzz.add_argument("--case-seconds", type=float, default=5.0, help="each case's time limit (5)")
    fuzz.add_argument("--list", type=int, default=20, help="failed cases printed (20)")
    fuzz.add_argument(
        "--reseal",
        type=float,
        default=0.25,
        metavar="P",
        help="the share of mutations (of those without FIFOs or symlinks) whose manifest is "
        "rewritten to match, so the checks behind it see them (0.25)",
    )


def add_soak_parser(bench: _Subparsers) -> None:
    """``demb bench soak``."""
    soak = bench_parser(
        bench,
        "soak",
        "memory over a long training run of a two-table model that evicts every step "
        "(resident, and CUDA allocated/reserved), beside the same run's eval forwards; fails "
        "if a --dump-every round trip is not bit-exact",
        device=True,
    )
    soak.add_argument("--steps", type=int, default=10_000, help="sampled steps per phase")
    soak.add_argument("--warmup", type=int, default=500, help="unsampled steps first (500)")
    soak.add_argument("--every", type=int, default=1_000, help="steps between samples (1000)")
    soak.add_argument(
        "--dump-every",
        type=int,
        default=0,
        metavar="N",
        help="every N training steps, a DynamicEmbDump/DynamicEmbLoad round trip into a "
        "temporary folder, checked bit-exact (default 0: none)",
    )
    soak.add_argument(
        "--dims", type=int, nargs=2, default=[16, 16], metavar="D", help="the two dims (16 16)"
    )
    soak.add_argument(
        "--model",
        choices=["evicting", "reference"],
        default="evicting",
        help="evicting: the two-table model that evicts every step (default); reference: the "
        "reference workload of demb bench module (10 prefilled tables, D=128)",
    )
    soak.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="with --model reference: rows and samples times this (default 1)",
    )


def add_readspeed_parser(bench: _Subparsers) -> None:
    """``demb bench readspeed``."""
    readspeed = bench_parser(
        bench,
        "readspeed",
        "demb-io verify and DynamicEmbLoad of one checkpoint with the current demb-io beside "
        "an older one (--baseline), alternating, each in a fresh process",
    )
    readspeed.add_argument(
        "--baseline",
        required=True,
        metavar="DIR",
        help="a folder holding an older demb_io package (or packages/demb-io/src/demb_io "
        "under it), made with: mkdir DIR && git archive REV packages/demb-io/src | tar -x -C DIR",
    )
    readspeed.add_argument(
        "--gb", type=float, default=1.0, help="the checkpoint's size in GB (1.0)"
    )
    readspeed.add_argument(
        "--repeats", type=int, default=5, help="timed runs of each reader and side (5)"
    )
    readspeed.add_argument("--tables", type=int, default=4, help="tables (4)")
    readspeed.add_argument("--dim", type=int, default=128, help="embedding dim, float32 (128)")
    readspeed.add_argument(
        "--cold",
        action="store_true",
        help="also time each read from the disk (its pages dropped with posix_fadvise)",
    )
    readspeed.add_argument(
        "--limit", type=float, default=1.1, help="pass when current <= LIMIT x baseline (1.1)"
    )
    readspeed.add_argument("--dir", help="where to write (default: the system's temporary folder)")
    readspeed.add_argument(
        "--verify-calls",
        type=int,
        default=5,
        help="timed verify calls per process, their median its time (5; warm cache)",
    )


def add_delta_parser(bench: _Subparsers) -> None:
    """``demb bench delta``."""
    delta = bench_parser(
        bench,
        "delta",
        "incremental_dump and replay_increment of a window of the reference workload's tables "
        "beside D2H / H2D copies of the same bytes, and a non-blocking DynamicEmbDump (the "
        "call beside a D2D copy of the tables; train steps during its write beside steps "
        "before it); fails if a delta or a replay is not exact",
        device=True,
        scale="rows and samples times this (default 1 on a GPU: about 70 GB of GPU memory and "
        "26 GB of disk; 0.01 on the CPU)",
    )
    delta.add_argument(
        "--touched",
        type=float,
        default=0.10,
        help="the share of each table's rows a window trains, then dumps (0.10)",
    )
    delta.add_argument(
        "--repeats", type=int, help="timings of each figure (default 5 on a GPU, 3 on the CPU)"
    )
    delta.add_argument(
        "--dir",
        help="where the dumps' temporary folder goes (default: the system's temporary "
        "folder); removed after",
    )
    delta.add_argument(
        "--load-factor",
        type=float,
        default=0.8,
        help="rows over slots of each filled table (0.8: 2,097,152 slots a table at scale 1)",
    )
    delta.add_argument(
        "--min-steps",
        type=int,
        default=3,
        help="train steps during each background write, at least (3)",
    )
    delta.add_argument("--seed", type=int, default=0, help="windows' and batches' seed (0)")


def add_retain_parser(bench: _Subparsers) -> None:
    """``demb bench retain``."""
    retain = bench_parser(
        bench,
        "retain",
        "the train step of tables that evict every step: DISCARD beside the same step without "
        "the retention hook, and RETAIN_KEY beside DISCARD",
        device=True,
        scale="rows and samples times this (default 1 on a GPU, 0.01 on the CPU)",
    )
    retain.add_argument("--steps", type=int, default=10, help="timed steps a round (10)")
    retain.add_argument("--rounds", type=int, default=5, help="alternating rounds (5)")
    retain.add_argument("--warmup", type=int, default=5, help="untimed steps first (5)")


def add_admission_parser(bench: _Subparsers) -> None:
    """``demb bench admission``."""
    admission = bench_parser(
        bench,
        "admission",
        "the train step with frequency admission (20%% new keys a step) beside the step "
        "without; the admission counter's add beside the table's find_or_insert of the same "
        "keys; the train step of evicting (TIMESTAMP, LFU) tables with a score_function beside "
        "the built-in eviction; fails if a figure's work is not what it should be",
        device=True,
        scale="rows and samples times this (default 1 on a GPU: about 130 GB of GPU memory, "
        "an H200; 0.5 fits an 80 GB H100; 0.01 on the CPU)",
    )
    admission.add_argument("--steps", type=int, default=10, help="timed steps a round (10)")
    admission.add_argument("--rounds", type=int, default=5, help="alternating rounds (5)")
    admission.add_argument("--warmup", type=int, default=5, help="untimed steps first (5)")
    admission.add_argument("--seed", type=int, default=0, help="the batches' seed (0)")


def add_tiers_parser(bench: _Subparsers) -> None:
    """``demb bench tiers``."""
    tiers = bench_parser(
        bench,
        "tiers",
        "the train step and eval forward of caching tables (a device cache of 1.0x and 0.8x a "
        "step's unique ids over a host table) and of hybrid tables (a tenth of the value bytes "
        "on the device; none) beside the all-device tables and beside the copy floor of the "
        "rows that cross between the tiers; fails if a mode evicted or lost a key",
        device=True,
        scale="rows and ids times this (default 1 on a GPU: 10 tables x 3,355,443 rows, "
        "1,048,576 ids a step, about 16 GB of GPU memory and 16 GB of pinned host memory with "
        "Adam; 0.01 on the CPU: about 1 GB, under a minute on 2 cores)",
    )
    tiers.add_argument(
        "--optimizer", choices=["adam", "sgd"], default="adam", help="the optimizer (adam)"
    )
    tiers.add_argument("--steps", type=int, default=20, help="timed steps a mode (20)")
    tiers.add_argument("--warmup", type=int, default=5, help="untimed steps first (5)")
    tiers.add_argument("--seed", type=int, default=0, help="the batches' seed (0)")
