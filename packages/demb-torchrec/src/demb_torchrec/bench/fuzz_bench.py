"""``demb bench fuzz``: seeded single mutations of a small checkpoint and a small delta, each
read back by demb-io's readers; every case must end, within a time limit, in one of demb-io's
typed errors (``FormatError`` or another ``IoError``) or in a read.

Case ``i`` damages the checkpoint (even ``i``) or the delta (odd ``i``) written by
:mod:`demb_io.mutations`: one file is picked and mutated
(:func:`~demb_io.mutations.mutate`) by a generator seeded with the seed and ``i``
(any case can be replayed alone), the reader reads everything back (CRCs checked), and the
file is restored. Outcomes: ``typed_error``; ``identical_read``: the rows read back are the
undamaged files' (the mutation was harmless: whitespace, a hyper-parameter, bytes left equal);
``changed_read``: the reader accepted a meta edit that changes what it reads (listed, not a
failure: a meta is plain JSON, and some edits are consistent, e.g. ``admission_rows: null``
drops a shard's admission counters); ``other``: any other exception. Any ``other`` case, or any
case over the time limit, fails the command.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from demb_io import Checkpoint, DeltaTable, IoError, ShardData, read_delta
from demb_io.mutations import mutate, small_checkpoint, small_delta

from demb_torchrec.bench.compare import check_counts, machine_info

__all__ = ["OUTCOMES", "READERS", "FuzzWorkload", "read_checkpoint", "read_delta_rows", "run"]

OUTCOMES = ("typed_error", "identical_read", "changed_read", "other")
"""How a case can end (see the module's docstring)."""
_LISTED = 20
"""Failed (and changed-read) cases listed in the report; all are counted."""

Rows = tuple[tuple[str, str, tuple[int, ...], bytes], ...]
"""What a reader read: each array's name, dtype, shape and bytes, in reading order."""


def _arrays(where: str, data: ShardData | DeltaTable) -> Rows:
    """The array fields of ``data`` (a None field as an empty entry)."""
    rows = []
    for f in dataclasses.fields(data):
        value = getattr(data, f.name)
        if value is None:
            rows.append((f"{where}.{f.name}", "none", (), b""))
        elif isinstance(value, np.ndarray):
            rows.append((f"{where}.{f.name}", value.dtype.str, value.shape, value.tobytes()))
    return tuple(rows)


def read_checkpoint(path: Path) -> Rows:
    """Open the checkpoint at ``path``, list it and read every table (CRCs checked); the rows
    read."""
    ckpt = Checkpoint(path)
    rows: Rows = ()
    for collection in ckpt.collections():
        for table in ckpt.tables(collection):
            rows += _arrays(f"{collection}/{table}", ckpt.read_table(collection, table))
    return rows


def read_delta_rows(path: Path) -> Rows:
    """Read the delta at ``path`` (CRCs checked); the rows read."""
    rows: Rows = ()
    for table in read_delta(path):
        rows += _arrays(f"{table.meta.collection}/{table.meta.table}", table)
    return rows


READERS: dict[str, tuple[Callable[[Path], None], Callable[[Path], Rows]]] = {
    "checkpoint": (small_checkpoint, read_checkpoint),
    "delta": (small_delta, read_delta_rows),
}
"""Each reader's name: the function writing its small files, and the reader (looked up at each
case)."""


@dataclass(frozen=True)
class FuzzWorkload:
    """``cases`` mutations from ``seed``, each read back within ``case_seconds``."""

    cases: int = 2000
    seed: int = 0
    case_seconds: float = 5.0

    def __post_init__(self) -> None:
        check_counts(self, "cases")
        if not self.case_seconds > 0:
            raise ValueError(f"case_seconds={self.case_seconds!r}: must be > 0")


@dataclass
class _Target:
    """A reader's files: their undamaged bytes and the rows they read back."""

    root: Path
    original: dict[Path, bytes]
    rows: Rows


def _target(name: str, root: Path) -> _Target:
    write, read = READERS[name]
    write(root)
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return _Target(root, {p: p.read_bytes() for p in files}, read(root))


def _case(w: FuzzWorkload, i: int, reader: str, target: _Target) -> dict[str, Any]:
    """Mutate one file of ``target``, read it back, restore it; the case's outcome."""
    rnd = random.Random(f"{w.seed}/{i}")
    victim = rnd.choice(sorted(target.original))
    blob = target.original[victim]
    victim.write_bytes(mutate(victim, blob, rnd))
    error = ""
    start = time.perf_counter()
    try:
        rows = READERS[reader][1](target.root)
    except IoError as err:
        outcome, error = "typed_error", type(err).__name__
    except Exception as err:
        outcome, error = "other", f"{type(err).__name__}: {err}"
    else:
        outcome = "identical_read" if rows == target.rows else "changed_read"
    seconds = time.perf_counter() - start
    victim.write_bytes(blob)
    return {
        "case": i,
        "reader": reader,
        "file": victim.relative_to(target.root).as_posix(),
        "outcome": outcome,
        "error": error,
        "seconds": seconds,
    }


def _case_line(case: dict[str, Any]) -> str:
    error = f": {case['error']}" if case["error"] else ""
    return (
        f"  case {case['case']} ({case['reader']}, {case['file']}, {case['seconds']:.3f} s): "
        f"{case['outcome']}{error}"
    )


def _print(w: FuzzWorkload, report: dict[str, Any]) -> None:
    print(
        f"fuzz: {w.cases:,} single mutations (seed {w.seed}) of a small checkpoint and a small "
        f"delta, each read back: {report['seconds']:.2f} s"
    )
    header = ("reader", "cases", *OUTCOMES)
    table = [
        (name, str(sum(c.values())), *(str(c[o]) for o in OUTCOMES))
        for name, c in [*report["readers"].items(), ("all", report["outcomes"])]
    ]
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for r in [header, *table]:
        cells = [r[0].ljust(widths[0])] + [
            v.rjust(n) for v, n in zip(r[1:], widths[1:], strict=True)
        ]
        print("  " + "  ".join(cells))
    typed = ", ".join(f"{k} {v:,}" for k, v in report["typed_errors"].items()) or "none"
    print(f"typed errors by class: {typed}")
    print(
        f"slowest case {report['slowest_case_seconds'] * 1e3:.1f} ms "
        f"(limit {w.case_seconds:g} s; over it: {report['slow_cases']})"
    )
    if report["changed"]:
        print("changed reads (a meta edit the reader accepts changes the rows read):")
        for case in report["changed"]:
            print(_case_line(case))
    if report["failed"]:
        other, slow = report["outcomes"]["other"], report["slow_cases"]
        print(f"FAILED: {other} case(s) ended in another exception, {slow} over the time limit:")
        for case in report["failures"]:
            print(_case_line(case))


def run(w: FuzzWorkload) -> dict[str, Any]:
    """Run the cases of ``w`` in a temporary folder; print the counts per outcome and reader
    (and the changed-read and failed cases) and return the report (its ``failed``: any
    ``other`` outcome or any case over ``w.case_seconds``)."""
    names = list(READERS)
    readers = {name: dict.fromkeys(OUTCOMES, 0) for name in names}
    typed: dict[str, int] = {}
    failures: list[dict[str, Any]] = []
    changed: list[dict[str, Any]] = []
    slow, slowest = 0, 0.0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="demb_fuzz_") as tmp:
        targets = {name: _target(name, Path(tmp) / name) for name in names}
        for i in range(w.cases):
            reader = names[i % len(names)]
            case = _case(w, i, reader, targets[reader])
            outcome = case["outcome"]
            readers[reader][outcome] += 1
            if outcome == "typed_error":
                typed[case["error"]] = typed.get(case["error"], 0) + 1
            over = case["seconds"] > w.case_seconds
            slow += over
            slowest = max(slowest, case["seconds"])
            failing = outcome == "other" or over
            listed = failures if failing else changed if outcome == "changed_read" else None
            if listed is not None and len(listed) < _LISTED:
                listed.append(case)
    outcomes = {o: sum(r[o] for r in readers.values()) for o in OUTCOMES}
    report = {
        "benchmark": "fuzz",
        "machine": machine_info(),
        "workload": asdict(w),
        "seconds": time.perf_counter() - start,
        "outcomes": outcomes,
        "readers": readers,
        "typed_errors": dict(sorted(typed.items())),
        "slow_cases": slow,
        "slowest_case_seconds": slowest,
        "failed": bool(outcomes["other"] or slow),
        "failures": failures,
        "changed": changed,
    }
    _print(w, report)
    return report
