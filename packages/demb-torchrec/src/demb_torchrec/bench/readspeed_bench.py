"""``demb bench readspeed``: checkpoint reads of the current demb-io beside an older demb-io's
(the baseline), side by side in one run: ``demb-io verify`` and
:func:`~demb_torchrec.DynamicEmbLoad` of one checkpoint of about ``gb`` GB.

The baseline is a folder holding an older ``demb_io`` package, for example::

    mkdir /tmp/base && git archive <rev> packages/demb-io/src | tar -x -C /tmp/base

(``--baseline /tmp/base``: the folder holding ``demb_io/``, or a folder above it where
``packages/demb-io/src/demb_io`` is, as ``git archive`` lays it out).

The checkpoint is written once, by the current code: :func:`~demb_torchrec.DynamicEmbDump` of a
CPU :class:`~demb_torchrec.DynamicEmbeddingTables` of ``tables`` tables of ``dim`` float32
(sgd: no optimizer state), filled with distinct keys and random rows. Each timed read runs in a
fresh Python process: the current one with the environment as it is; the baseline one with the
baseline folder first on ``PYTHONPATH``, so only ``demb_io`` is the older one (demb-torchrec,
its kernels and demb-planner stay current). Each process checks which ``demb_io`` it imported,
reads the checkpoint's files once untimed (a warm page cache; with ``cold``, it drops their
pages with ``posix_fadvise(DONTNEED)`` instead), then times one call: ``demb_io.cli.main(
["verify", path])``, or ``DynamicEmbLoad(path, model)`` into a model built before the timer
starts. Current and baseline alternate, ``repeats`` of each, the one going first rotating.

When the baseline cannot read the new checkpoint (a newer marker, a manifest it does not know),
it reads a copy of it whose data files are hard links to the same files (the same page cache),
whose ``FORMAT`` marker is the baseline's and without the checkpoint's other top-level files
(the manifest); the report says so. When importing demb-torchrec with the baseline ``demb_io``
fails on a name the baseline lacks (one the current dump or another module imports), the
baseline process stubs that name (a stub raises if called) and retries; the report lists the
stubbed names, and a load that calls one fails, reported with its error.

Figures are medians (seconds and GB/s of the checkpoint's bytes); each current figure stands
beside the baseline's, with ``current / baseline`` seconds and a pass column for ``<= limit``
(default 1.1).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["ReadspeedWorkload", "baseline_root", "child_main", "run"]

_READERS = ("verify", "load")
_SIDES = ("current", "baseline")
_SCORE_BYTES = 8  # one int64 score column (TIMESTAMP)
_FILL_CHUNK = 1 << 18


@dataclass(frozen=True)
class ReadspeedWorkload:
    """One checkpoint of about ``gb`` GB (``tables`` tables of ``dim`` float32), read
    ``repeats`` times by each reader with the current and the ``baseline`` demb-io."""

    baseline: str
    gb: float = 1.0
    repeats: int = 5
    tables: int = 4
    dim: int = 128
    cold: bool = False
    limit: float = 1.1
    directory: str | None = None
    verify_calls: int = 5
    """Timed verify calls per process (warm cache only), their median the process's time: one
    verify of 1 GB takes a fifth of a second, which a VM's scheduling noise can double."""

    def __post_init__(self) -> None:
        if not self.gb > 0:
            raise ValueError(f"gb={self.gb!r}: must be > 0")
        for name in ("repeats", "tables", "dim", "verify_calls"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be a positive integer")

    @property
    def rows_per_table(self) -> int:
        """Rows per table: ``gb`` GB over the tables' rows (key, values, one score word)."""
        return max(1, round(self.gb * 1e9 / (8 + 4 * self.dim + _SCORE_BYTES) / self.tables))

    @property
    def capacity(self) -> int:
        """Each table's slots: a power of two at least twice its rows."""
        return 1 << (2 * self.rows_per_table - 1).bit_length()

    def model_spec(self) -> dict[str, int]:
        """What a process needs to build the model the checkpoint loads into."""
        return {"tables": self.tables, "dim": self.dim, "capacity": self.capacity}

    def as_dict(self) -> dict[str, Any]:
        """The workload as JSON fields."""
        return {**asdict(self), "rows_per_table": self.rows_per_table, "capacity": self.capacity}


def baseline_root(path: str | Path) -> Path:
    """The folder to put on ``PYTHONPATH`` for the baseline: ``path`` itself when it holds
    ``demb_io/__init__.py``, else ``path/packages/demb-io/src`` (``git archive``'s layout).

    Raises:
        ValueError: neither holds a ``demb_io`` package.
    """
    base = Path(path).absolute()
    for root in (base, base / "packages" / "demb-io" / "src"):
        if (root / "demb_io" / "__init__.py").is_file():
            return root
    raise ValueError(
        f"--baseline {path}: no demb_io package there (nor under packages/demb-io/src); make "
        "one with: git archive <rev> packages/demb-io/src | tar -x -C <folder>"
    )


def _build_model(spec: dict[str, int]) -> Any:  # noqa: ANN401 (a DynamicEmbeddingTables)
    from demb_torchrec import DynamicEmbeddingTables, DynamicEmbTableOptions

    capacity = spec["capacity"]
    options = [
        DynamicEmbTableOptions(dim=spec["dim"], max_capacity=capacity, init_capacity=capacity)
        for _ in range(spec["tables"])
    ]
    names = [f"t{t}" for t in range(spec["tables"])]
    return DynamicEmbeddingTables(options, table_names=names, device="cpu", optimizer="sgd")


def _write_checkpoint(w: ReadspeedWorkload, path: Path) -> int:
    """Fill the model of ``w`` (distinct keys, random rows) and dump it to ``path`` with the
    current code; the rows written."""
    import torch

    from demb_torchrec import DynamicEmbDump

    model = _build_model(w.model_spec())
    gen = torch.Generator().manual_seed(0)
    tables, n_tables, rows = model.tables, w.tables, w.rows_per_table
    for t in range(n_tables):
        words = max(tables.configs[t].score_layout.index_words) + 1
        for begin in range(0, rows, _FILL_CHUNK):
            keys = torch.arange(begin, min(rows, begin + _FILL_CHUNK)) * n_tables + t
            values: list[torch.Tensor | None] = [None] * n_tables
            values[t] = torch.randn(keys.numel(), w.dim, generator=gen)
            scores = keys.expand(words, -1).contiguous()
            tables.insert_or_assign(keys, torch.full_like(keys, t), scores, values)
    held = sum(tables.size(t) for t in range(n_tables))
    DynamicEmbDump(path, model)
    return int(held)


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file())


def _drop_cached(files: list[Path]) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_through(files: list[Path]) -> None:
    buf = bytearray(1 << 22)
    for p in files:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def _stub_missing_names() -> list[str]:
    """Import demb-torchrec; while it fails on a name the imported ``demb_io`` lacks, stub
    that name (calling the stub raises) and retry. The names stubbed."""
    stubbed: list[str] = []
    pattern = re.compile(r"cannot import name '(\w+)' from '(demb_io[\w.]*)'")
    for _ in range(64):
        try:
            import demb_torchrec.dump  # noqa: F401
        except ImportError as err:
            found = pattern.search(str(err))
            if found is None or found.group(2) not in sys.modules:
                raise
            name, module = found.groups()

            def stub(*args: object, _name: str = name, **kwargs: object) -> None:
                raise NotImplementedError(f"{_name} is not in the baseline demb_io (stubbed)")

            setattr(sys.modules[module], name, stub)
            stubbed.append(f"{module}.{name}")
            for key in [k for k in sys.modules if k.startswith("demb_torchrec")]:
                del sys.modules[key]
            continue
        return stubbed
    raise ImportError(f"demb_torchrec still fails to import after stubbing {stubbed}")


def child_main(argv: list[str] | None = None) -> None:
    """The timed process: ``argv[0]`` is a JSON job (reader, path, cache, expected
    ``demb_io`` root, model spec, result file); writes the result JSON to the result file."""
    job = json.loads((argv if argv is not None else sys.argv[1:])[0])
    result: dict[str, Any] = {"stubbed": []}
    try:
        import contextlib
        import io

        import demb_io

        result["demb_io"] = str(Path(demb_io.__file__).parent)
        if not Path(demb_io.__file__).resolve().is_relative_to(Path(job["root"]).resolve()):
            raise RuntimeError(f"imported demb_io from {demb_io.__file__}, not {job['root']}")
        path = Path(job["path"])
        files = _files(path)
        if job["reader"] == "load":
            result["stubbed"] = _stub_missing_names()
            import logging

            from demb_torchrec import DynamicEmbLoad
            from demb_torchrec.dump import dynamic_tables

            model = _build_model(job["model"])
            logging.disable(logging.WARNING)  # fbgemm_gpu's import notices
            dynamic_tables(model)  # untimed: its first call imports TorchRec
            logging.disable(logging.NOTSET)
        _read_through(files)  # untimed: the files in the page cache ...
        if job["cache"] == "cold":
            _drop_cached(files)  # ... or dropped from it
        if job["reader"] == "verify":
            from demb_io.cli import main

            calls = []
            for _ in range(job["calls"] if job["cache"] == "warm" else 1):
                out, err = io.StringIO(), io.StringIO()
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    status = main(["verify", str(path)])
                calls.append(time.perf_counter() - t0)
                if status:
                    raise RuntimeError(f"demb-io verify exited {status}: {err.getvalue().strip()}")
            result["seconds"] = statistics.median(calls)
            result["calls"] = calls
        else:
            t0 = time.perf_counter()
            DynamicEmbLoad(path, model)
            result["seconds"] = time.perf_counter() - t0
            result["rows"] = sum(model.tables.size(t) for t in range(model.num_tables))
    except Exception as err:
        result["error"] = f"{type(err).__name__}: {err}"
    Path(job["result"]).write_text(json.dumps(result))


def _launch(job: dict[str, Any], pythonpath: str | None, work: Path) -> dict[str, Any]:
    """Run one timed process; its result (``error`` set when it failed)."""
    result_file = work / "result.json"
    result_file.unlink(missing_ok=True)
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    # This file run as a script (-P: its folder not on sys.path): the demb_torchrec package
    # is imported only once the child has checked which demb_io it got.
    args = [sys.executable, "-P", __file__, json.dumps({**job, "result": str(result_file)})]
    t0 = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if not result_file.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"the process exited {done.returncode}: {' / '.join(tail)}"}
    result: dict[str, Any] = json.loads(result_file.read_text())
    result["process_seconds"] = wall
    return result


def _baseline_copy(ckpt: Path, copy: Path, marker: str) -> list[str]:
    """A copy of ``ckpt`` for an older reader: its data files hard-linked, ``FORMAT`` holding
    ``marker``, its other top-level files left out; the names left out."""
    copy.mkdir()
    left_out = []
    for entry in sorted(ckpt.iterdir()):
        if entry.is_dir():
            shutil.copytree(entry, copy / entry.name, copy_function=os.link)
        elif entry.name != "FORMAT":
            left_out.append(entry.name)
    (copy / "FORMAT").write_text(marker + "\n")
    return left_out


def _baseline_marker(root: Path, ckpt: Path) -> str:
    """The checkpoint marker the baseline writes (``<format> <version>``); if it cannot say,
    the first two words of the checkpoint's own."""
    code = "from demb_io.meta import CHECKPOINT_FORMAT as F, FORMAT_VERSION as V; print(F, V)"
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode == 0 and done.stdout.strip():
        return done.stdout.strip()
    return " ".join((ckpt / "FORMAT").read_text().split()[:2])


def _compatible_path(ckpt: Path, root: Path, work: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint the baseline reads (``ckpt``, or a copy it can read) and how it got it;
    the first (untimed) baseline verify."""
    job = {"reader": "verify", "path": str(ckpt), "cache": "warm", "root": str(root), "calls": 1}
    first = _launch(job, str(root), work)
    if "error" not in first:
        return ckpt, {"reads": "the same checkpoint"}
    copy = work / "baseline_ckpt"
    left_out = _baseline_copy(ckpt, copy, _baseline_marker(root, ckpt))
    second = _launch({**job, "path": str(copy)}, str(root), work)
    how: dict[str, Any] = {
        "reads": "a copy: data files hard-linked, FORMAT the baseline's marker, "
        f"without {left_out}",
        "refused_the_checkpoint": first["error"],
        "left_out": left_out,
    }
    if "error" in second:
        how["refused_the_copy"] = second["error"]
    return copy, how


def _row(
    w: ReadspeedWorkload, reader: str, cache: str, got: dict[str, list[dict[str, Any]]], size: int
) -> dict[str, Any]:
    row: dict[str, Any] = {"reader": reader, "cache": cache}
    for side in _SIDES:
        runs = got[side]
        errors = sorted({r["error"] for r in runs if "error" in r})
        seconds = [r["seconds"] for r in runs if "error" not in r]
        row[side] = {
            "seconds": seconds,
            "median_s": statistics.median(seconds) if seconds else None,
            "min_s": min(seconds, default=None),
            "max_s": max(seconds, default=None),
            "process_seconds": [r["process_seconds"] for r in runs if "process_seconds" in r],
            "gb_per_s": size / 1e9 / statistics.median(seconds) if seconds else None,
            "errors": errors,
            "stubbed": sorted({n for r in runs for n in r.get("stubbed", [])}),
        }
        if reader == "load":
            row[side]["rows"] = sorted({r["rows"] for r in runs if "rows" in r})
    cur, base = row["current"]["median_s"], row["baseline"]["median_s"]
    row["ratio"] = cur / base if cur is not None and base else None
    row["pass"] = row["ratio"] is not None and row["ratio"] <= w.limit
    return row


def _print(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(
        f"checkpoint reads, current vs baseline demb_io ({report['baseline_demb_io']}): "
        f"{report['bytes'] / 1e9:.3g} GB, {report['rows']:,} rows in {w['tables']} tables x "
        f"{w['dim']} float32; median of {w['repeats']} each, alternating"
    )
    if report["baseline_reads"]["reads"] != "the same checkpoint":
        print(f"  the baseline reads {report['baseline_reads']['reads']}")
    head = ("reader", "cache", "current", "baseline", "current GB/s", "baseline GB/s", "ratio")
    print(f"  {head[0]:<8}{head[1]:<7}" + "".join(f"{h:>14}" for h in head[2:]) + "  pass")
    for r in report["results"]:
        cells = [
            f"{r[s]['median_s']:.3f} s" if r[s]["median_s"] is not None else "failed"
            for s in _SIDES
        ]
        cells += [f"{r[s]['gb_per_s']:.3g}" if r[s]["gb_per_s"] else "-" for s in _SIDES]
        cells.append(f"{r['ratio']:.3f}x" if r["ratio"] is not None else "-")
        verdict = "yes" if r["pass"] else "NO"
        print(f"  {r['reader']:<8}{r['cache']:<7}" + "".join(f"{c:>14}" for c in cells), verdict)
        for side in _SIDES:
            for e in r[side]["errors"]:
                print(f"    {side} {r['reader']} failed: {e}")
            if r[side]["stubbed"]:
                print(f"    {side} {r['reader']}: stubbed {', '.join(r[side]['stubbed'])}")
    print(f"  pass: current <= {w['limit']} x baseline seconds; page cache warm = read once first")


def run(w: ReadspeedWorkload) -> dict[str, Any]:
    """Write the checkpoint, time each reader with the current and the baseline demb-io in
    alternation; print the table and return the report."""
    import demb_io

    from demb_torchrec.bench.compare import machine_info

    root = baseline_root(w.baseline)
    current_root = Path(demb_io.__file__).parent.parent
    work = Path(tempfile.mkdtemp(prefix="demb_readspeed_", dir=w.directory))
    try:
        ckpt = work / "ckpt"
        rows = _write_checkpoint(w, ckpt)
        size = sum(p.stat().st_size for p in _files(ckpt))
        base_path, how = _compatible_path(ckpt, root, work)
        caches = ("warm", "cold") if w.cold else ("warm",)
        got: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {
            (r, c): {s: [] for s in _SIDES} for r in _READERS for c in caches
        }
        sides = {
            "current": (ckpt, None, current_root),
            "baseline": (base_path, str(root), root),
        }
        spec = w.model_spec()
        for rep in range(w.repeats):
            for reader in _READERS:
                for cache in caches:
                    order = _SIDES[rep % 2 :] + _SIDES[: rep % 2]
                    for side in order:
                        path, pythonpath, expect = sides[side]
                        job: dict[str, Any] = {"reader": reader, "path": str(path), "cache": cache}
                        job |= {"root": str(expect), "model": spec, "calls": w.verify_calls}
                        result = _launch(job, pythonpath, work)
                        got[reader, cache][side].append(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = [_row(w, r, c, got[r, c], size) for r, c in got]
    report: dict[str, Any] = {
        "benchmark": "readspeed",
        "machine": machine_info(),
        "workload": w.as_dict(),
        "current_demb_io": str(current_root / "demb_io"),
        "baseline_demb_io": str(root / "demb_io"),
        "bytes": size,
        "rows": rows,
        "baseline_reads": how,
        "results": results,
        "passed": all(r["pass"] for r in results),
    }
    _print(report)
    return report


if __name__ == "__main__":
    child_main()
