"""``demb bench fuzz``: seeded mutations of a real checkpoint and real deltas, each read by one
of demb's readers; every case must end, within a time limit, in identical content or a typed
error.

Case ``i`` runs reader ``readers[i % len(readers)]`` (:data:`~.fuzz_readers.READERS`: the
demb-io CLI's verify, inspect, merge, apply, reshard and export, demb-io's readers,
DynamicEmbLoad) with one of its inputs replaced by a fresh copy damaged by
:func:`~demb_io.mutations.mutate_tree` (bytes, JSON numbers, files and folders deleted,
swapped, renamed or added, FIFOs, symlinks), from a generator seeded with the seed and ``i``:
any case replays alone (``--case I``). A share (``reseal``) of the mutations that leave no FIFO
or symlink are then resealed: the manifest rewritten to match the damaged tree, as a deliberate
edit would, so that what the readers check behind the manifest sees the damage too.

Outcomes: ``identical`` (the content the undamaged inputs give), ``typed_error``
(``demb_io.IoError``; for DynamicEmbLoad any ``DembError``), ``edited`` (a resealed mutation
read back with other content: a consistent edit, such as a collection removed, not a failure),
or a failure: ``changed`` (no error, other content: a table missing, a meta edit accepted, an
unreadable output), ``escaped`` (a tree with a symlink out of it, read), ``partial`` (a typed
error that left a partial output or a changed model), ``untyped`` (any other exception,
``MemoryError`` included) or ``hang`` (over the time limit, interrupted by ``SIGALRM``).
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import shutil
import signal
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from demb_io.mutations import TREE_KINDS, mutate_tree

from demb_torchrec.bench.compare import check_counts, machine_info
from demb_torchrec.bench.fuzz_readers import INPUTS, READERS, Content, DirtyError, diff, leftovers

__all__ = ["FAILURES", "OUTCOMES", "FuzzWorkload", "run", "run_case"]

OUTCOMES = (
    "identical", "typed_error", "edited", "changed", "escaped", "partial", "untyped", "hang",
)  # fmt: skip
"""How a case can end (see the module's docstring)."""
FAILURES = OUTCOMES[3:]
"""The outcomes that fail the run."""
_RESEALABLE = frozenset(TREE_KINDS) - {
    "fifo", "dev_zero", "file_to_folder", "symlink_outside", "symlink_inside",
}  # fmt: skip
"""The mutations a case may reseal (a FIFO or a symlink would block or leave the tree)."""


@dataclass(frozen=True)
class FuzzWorkload:
    """``cases`` mutations from ``seed`` spread over ``readers``, each read within
    ``case_seconds``; ``case``: run that case alone; ``listed``: failed cases printed;
    ``reseal``: the share of mutations resealed (where they can be)."""

    cases: int = 2000
    seed: int = 0
    case_seconds: float = 5.0
    readers: tuple[str, ...] = tuple(READERS)
    case: int | None = None
    listed: int = 20
    reseal: float = 0.25

    def __post_init__(self) -> None:
        check_counts(self, "cases")
        if not self.case_seconds > 0:
            raise ValueError(f"case_seconds={self.case_seconds!r}: must be > 0")
        unknown = sorted(set(self.readers) - set(READERS))
        if unknown or not self.readers:
            raise ValueError(f"readers={self.readers!r}: pick from {', '.join(READERS)}")
        if self.case is not None and self.case < 0:
            raise ValueError(f"case={self.case!r}: must be >= 0")
        if not 0 <= self.reseal <= 1:
            raise ValueError(f"reseal={self.reseal!r}: must be in [0, 1]")


class _Hang(BaseException):
    """The case's time is up (a BaseException: no reader's ``except Exception`` takes it)."""


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`_Hang` in this thread after ``seconds`` (``SIGALRM``, which also breaks
    a blocked ``open`` or ``read``); only on the main thread of a system with ``setitimer``."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return

    def fire(signum: int, frame: object) -> None:
        raise _Hang

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class _Inputs:
    """The undamaged inputs under ``root`` and each reader's content of them."""

    root: Path
    paths: dict[str, Path]
    reference: dict[str, Content] = field(default_factory=dict)

    def fingerprint(self) -> str:
        """A hash of every input's names, kinds and bytes (a reader must change none)."""
        h = hashlib.sha256()
        for p in sorted(self.root.rglob("*")):
            h.update(str(p.relative_to(self.root)).encode())
            h.update(p.read_bytes() if p.is_file() and not p.is_symlink() else b"/")
        return h.hexdigest()


def _scratch() -> str | None:
    """Where cases are written: ``/dev/shm`` where it is a writable folder (the writers fsync
    every file: cheap in memory), else the system's temporary folder."""
    shm = Path("/dev/shm")
    with contextlib.suppress(OSError):
        if shm.is_dir():
            tempfile.TemporaryDirectory(dir=shm).cleanup()
            return str(shm)
    return None


def _prepare(root: Path, readers: tuple[str, ...], seconds: float) -> _Inputs:
    """Write the inputs under ``root`` and compute each reader's reference (twice: it must be
    the same)."""
    inputs = _Inputs(root, {name: root / "inputs" / name for name in INPUTS})
    for name, write in INPUTS.items():
        write(inputs.paths[name])
    for name in readers:
        contents = []
        for attempt in range(2):
            out = root / f"reference-{name}-{attempt}"
            out.mkdir()
            try:
                with _deadline(seconds * 4), warnings.catch_warnings(record=True):
                    contents.append(READERS[name].run(inputs.paths, out))
            except _Hang:
                raise RuntimeError(f"reader {name}: hangs on the undamaged inputs") from None
            shutil.rmtree(out)
        if contents[0] != contents[1]:
            raise RuntimeError(
                f"reader {name}: not deterministic ({diff(contents[0], contents[1])})"
            )
        inputs.reference[name] = contents[0]
    return inputs


def _reseal(tree: Path) -> bool:
    """Rewrite the manifest of the mutated ``tree`` to match it (a deliberate edit, as
    ``demb_io.manifest.reseal`` makes one), so the readers' checks behind the manifest's see
    the mutation; whether it could (not without a marker, nor before demb-io had manifests)."""
    try:
        from demb_io.manifest import reseal
    except ImportError:
        return False
    try:
        reseal(tree)
    except Exception:
        return False
    return True


def run_case(w: FuzzWorkload, i: int, inputs: _Inputs) -> dict[str, Any]:
    """Case ``i``: its reader on a freshly mutated copy of one input; its record."""
    rnd = random.Random(f"{w.seed}/{i}")
    name = w.readers[i % len(w.readers)]
    reader = READERS[name]
    target = rnd.choice(reader.inputs)
    folder = inputs.root / f"case{i}"
    copy = folder / target
    shutil.copytree(inputs.paths[target], copy, symlinks=True)
    mutation = mutate_tree(copy, rnd, folder / "outside")
    resealed = mutation.kind in _RESEALABLE and rnd.random() < w.reseal and _reseal(copy)
    out = folder / "out"
    out.mkdir()
    paths = {**inputs.paths, target: copy}
    error, trace = "", ""
    start = time.perf_counter()
    try:
        with _deadline(w.case_seconds), warnings.catch_warnings(record=True):
            content = reader.run(paths, out)  # warnings recorded (a reader may ask "always")
    except _Hang:
        outcome, error = "hang", f"over {w.case_seconds:g} s"
    except DirtyError as err:
        outcome, error = "partial", str(err)
    except reader.typed as err:
        outcome, error = "typed_error", type(err).__name__
        if left := leftovers(reader, out):
            outcome, error = "partial", f"{error} left {left}"
    except Exception as err:
        outcome, error = "untyped", f"{type(err).__name__}: {err}"
        trace = traceback.format_exc()
    else:
        changed = diff(inputs.reference[name], content)
        outcome = "changed" if changed else "escaped" if mutation.leaves else "identical"
        outcome = "edited" if changed and resealed else outcome
        error = changed or ("read through a symlink out of the tree" if mutation.leaves else "")
    seconds = time.perf_counter() - start
    if seconds > w.case_seconds and outcome != "hang":  # no SIGALRM here, or it came late
        outcome, error = "hang", f"{outcome} after {seconds:.1f} s: {error}"
    shutil.rmtree(folder)
    return {
        "case": i,
        "reader": name,
        "input": target,
        "mutation": mutation.kind + ("+reseal" if resealed else ""),
        "path": mutation.path,
        "detail": mutation.detail,
        "outcome": outcome,
        "error": error,
        "seconds": seconds,
        "traceback": trace,
    }


def _kind_order(kind: str) -> tuple[int, bool]:
    """Mutations in :data:`TREE_KINDS` order, each resealed variant after it."""
    return list(TREE_KINDS).index(kind.removesuffix("+reseal")), kind.endswith("+reseal")


def _replay(w: FuzzWorkload, case: int | str) -> str:
    """The command that runs case ``case`` of ``w`` alone."""
    readers = "" if w.readers == tuple(READERS) else f" --readers {' '.join(w.readers)}"
    return f"demb bench fuzz --seed {w.seed} --case {case}{readers}"


def _case_line(case: dict[str, Any]) -> str:
    detail = f" ({case['detail']})" if case["detail"] else ""
    error = f": {case['error']}" if case["error"] else ""
    return (
        f"  case {case['case']}: {case['reader']}, {case['mutation']} of "
        f"{case['input']}/{case['path']}{detail}, {case['seconds'] * 1e3:.1f} ms: "
        f"{case['outcome']}{error}"
    )


def _table(rows: dict[str, dict[str, int]], first: str) -> list[str]:
    """``rows`` (name -> outcome counts) and their total as aligned lines."""
    total = {o: sum(r[o] for r in rows.values()) for o in OUTCOMES}
    header = (first, "cases", *OUTCOMES)
    body = [
        (name, str(sum(c.values())), *(str(c[o]) for o in OUTCOMES))
        for name, c in [*rows.items(), ("all", total)]
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return [
        "  "
        + "  ".join(
            [r[0].ljust(widths[0])] + [v.rjust(n) for v, n in zip(r[1:], widths[1:], strict=True)]
        )
        for r in [header, *body]
    ]


def _print(w: FuzzWorkload, report: dict[str, Any]) -> None:
    what = f"case {w.case}" if w.case is not None else f"{report['cases']:,} cases"
    print(
        f"fuzz: {what} (seed {w.seed}) of {len(w.readers)} readers on mutated checkpoints and "
        f"deltas: {report['seconds']:.2f} s"
    )
    print("\n".join(_table(report["readers"], "reader")))
    if w.case is None:
        print("\n".join(_table(report["kinds"], "mutation")))
    typed = ", ".join(f"{k} {v:,}" for k, v in report["typed_errors"].items()) or "none"
    print(f"typed errors by class: {typed}")
    slowest = report["slowest"]
    print(f"slowest case (limit {w.case_seconds:g} s):\n{_case_line(slowest)}")
    if report["edited"]:
        print("edited (resealed mutations read back as edited; not failures), the first:")
        for case in report["edited"][:5]:
            print(_case_line(case))
    if report["pristine_changed"]:
        print("FAILED: a reader changed its undamaged inputs")
    if report["groups"]:
        print("FAILED: failures by outcome, mutation and reader (count, first case):")
        for g in report["groups"]:
            print(
                f"  {g['outcome']:8s} {g['mutation']:16s} {g['reader']:18s} {g['count']:6,}  "
                f"case {g['first_case']}: {g['example']}"
            )
        print(f"first {len(report['failures'])} failed cases (replay: {_replay(w, 'I')}):")
        for case in report["failures"]:
            print(_case_line(case))
            if w.case is not None and case["traceback"]:
                print(case["traceback"])


def run(w: FuzzWorkload, directory: str | Path | None = None) -> dict[str, Any]:
    """Run the cases of ``w`` (or its one ``case``) in a temporary folder under ``directory``
    (default: ``/dev/shm`` where there is one); print the counts per reader, mutation and
    outcome, and the failures; return the report (its ``failed``: any failure outcome, or an
    undamaged input changed)."""
    readers = {name: dict.fromkeys(OUTCOMES, 0) for name in w.readers}
    kinds = {kind: dict.fromkeys(OUTCOMES, 0) for kind in TREE_KINDS}
    typed: dict[str, int] = {}
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    edited: list[dict[str, Any]] = []
    slowest: dict[str, Any] = {"seconds": -1.0}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="demb_fuzz_", dir=directory or _scratch()) as tmp:
        inputs = _prepare(Path(tmp), w.readers, w.case_seconds)
        before = inputs.fingerprint()
        for i in range(w.cases) if w.case is None else [w.case]:
            case = run_case(w, i, inputs)
            outcome = case["outcome"]
            readers[case["reader"]][outcome] += 1
            kinds.setdefault(case["mutation"], dict.fromkeys(OUTCOMES, 0))[outcome] += 1
            if outcome == "typed_error":
                typed[case["error"]] = typed.get(case["error"], 0) + 1
            if case["seconds"] > slowest["seconds"]:
                slowest = case
            if outcome in FAILURES:
                key = (outcome, case["mutation"], case["reader"])
                group = groups.setdefault(
                    key, {"count": 0, "first_case": case["case"], "example": case["error"]}
                )
                group["count"] += 1
                if len(failures) < w.listed:
                    failures.append(case)
            elif outcome == "edited" and len(edited) < w.listed:
                edited.append(case)
        pristine_changed = inputs.fingerprint() != before
    outcomes = {o: sum(r[o] for r in readers.values()) for o in OUTCOMES}
    report = {
        "benchmark": "fuzz",
        "machine": machine_info(),
        "workload": asdict(w),
        "seconds": time.perf_counter() - start,
        "cases": sum(outcomes.values()),
        "outcomes": outcomes,
        "readers": readers,
        "kinds": dict(sorted(kinds.items(), key=lambda kv: _kind_order(kv[0]))),
        "typed_errors": dict(sorted(typed.items())),
        "slowest": slowest,
        "pristine_changed": pristine_changed,
        "failed": pristine_changed or any(outcomes[o] for o in FAILURES),
        "groups": [
            {"outcome": o, "mutation": k, "reader": r, **g}
            for (o, k, r), g in sorted(groups.items(), key=lambda kv: -kv[1]["count"])
        ],
        "failures": failures,
        "edited": edited,
    }
    _print(w, report)
    return report
