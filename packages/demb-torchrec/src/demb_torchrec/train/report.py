"""The metrics log of ``demb train``: one JSON line per record, mirrored to TensorBoard.

A *record* is what the training loop reports every few steps: a JSON-able nested mapping with an
integer ``"step"`` and string keys, whose leaves are ``int`` / ``float`` / ``bool`` / ``None``
(nesting depth up to 3), e.g.::

    {"step": 200, "samples": 819200, "seconds": 12.5,
     "train": {"loss": 0.48, "auc": 0.71, "samples_per_s": 65000.0},
     "eval": {"auc": 0.73, "logloss": 0.47},
     "tables": {"cat_0": {"size": 1200, "capacity": 2048, "load_factor": 0.59}},
     "replica": {"auc": 0.72, "lag_steps": 20}}

:class:`MetricsLog` writes records; :func:`read_records` reads the file back (for plots, for a
resumed run, for tests). The file is strict JSON (RFC 8259) line by line: a non-finite float is
written as ``null``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Protocol, Self

from demb_torchrec.errors import ConfigError, InputError, InputTypeError

__all__ = ["MetricsLog", "read_records", "record_scalars"]


class _ScalarWriter(Protocol):
    """The part of ``torch.utils.tensorboard.SummaryWriter`` this module uses."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


def _summary_writer(logdir: Path, purge_step: int | None) -> _ScalarWriter:
    # Imported here: torch.utils.tensorboard pulls in tensorboard (seconds), which a process
    # that only reads records or plots them should not pay for.
    from torch.utils.tensorboard import SummaryWriter

    writer: _ScalarWriter = SummaryWriter(str(logdir), purge_step=purge_step)
    return writer


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _jsonable(value: object, path: str) -> object:
    """``value`` as plain JSON types: a non-finite float becomes ``None``; numpy scalars become
    ``int`` / ``float``. Raises :class:`InputTypeError` on anything else."""
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise InputTypeError(path or "record", f"key {key!r} is not a string")
            out[key] = _jsonable(item, f"{path}/{key}" if path else key)
        return out
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    raise InputTypeError(
        path or "record",
        f"a record's leaves are int, float, bool or None, not {type(value).__name__}"
        " (a tensor: pass tensor.item())",
    )


def record_scalars(record: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """The record's numeric leaves as ``(tag, value)``, the tag being the keys' path joined by
    ``"/"`` (``"tables/cat_0/size"``, ``"eval/auc"``), in the record's order. ``None``, ``bool``,
    strings and non-finite values are left out, and so is the top-level ``"step"``."""
    return _scalars(record, "")


def _scalars(mapping: Mapping[str, Any], prefix: str) -> Iterator[tuple[str, float]]:
    for key, value in mapping.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _scalars(value, f"{tag}/")
        elif _is_number(value) and (prefix or key != "step"):
            number = float(value)
            if math.isfinite(number):
                yield tag, number


def _record_step(record: Mapping[str, Any]) -> int:
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise InputError("record", f"needs an integer 'step' >= 0, got {step!r}")
    return int(step)


def _parse(path: Path, data: bytes) -> list[tuple[bytes, dict[str, Any]]]:
    """Each complete line of ``data`` (the file ``path``) with its record. An unterminated last
    line (a writer killed mid-line) is kept if it parses, ignored if not; blank lines are skipped;
    any other bad line raises :class:`ConfigError` naming the file and the line."""
    lines = data.split(b"\n")
    out: list[tuple[bytes, dict[str, Any]]] = []
    for index, raw in enumerate(lines):
        if not raw.strip():
            continue
        unterminated = index == len(lines) - 1
        try:
            record = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
            _record_step(record)
        except (ValueError, InputError) as exc:
            if unterminated:
                break
            raise ConfigError(f"{path}: line {index + 1} is not a metrics record: {exc}") from exc
        out.append((raw, record))
    return out


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not strict JSON")


def read_records(jsonl: Path) -> list[dict[str, Any]]:
    """The records of a metrics log, in file order.

    A truncated last line (the writer was killed mid-line) is ignored; any other line that is
    not a JSON object with an integer ``"step"`` raises :class:`~demb_torchrec.errors.ConfigError`
    (a ``ValueError``) naming the file and the line number (1-based). Blank lines are skipped.
    """
    path = Path(jsonl)
    return [record for _, record in _parse(path, path.read_bytes())]


def _rewrite(path: Path, max_step: int | None) -> None:
    """Keep the records of ``path`` whose step is <= ``max_step`` (all when ``None``) and drop an
    unterminated last line; the file is replaced atomically (a sibling written, fsynced, renamed)
    and left alone when nothing changes."""
    data = path.read_bytes()
    kept = [raw for raw, rec in _parse(path, data) if max_step is None or rec["step"] <= max_step]
    new = b"".join(raw + b"\n" for raw in kept)
    if new == data:
        return
    staged = path.with_name(f".{path.name}.tmp")
    with staged.open("wb") as file:
        file.write(new)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staged, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class MetricsLog:
    """Writes records to a JSONL file (one strict-JSON line per record, flushed at once, so a
    killed process loses at most the line it was writing) and, with ``logdir``, every numeric
    leaf to TensorBoard as a scalar tagged by its path (``"tables/cat_0/size"``) at
    ``global_step=record["step"]``.

    Args:
        jsonl: the log file; its folder is created. Truncated on open unless ``append`` or
            ``resume_step``.
        logdir: a TensorBoard log folder (a ``SummaryWriter`` writes an event file there), or
            ``None`` for no TensorBoard.
        append: keep the file's records and add after them (an unterminated last line, left by
            a killed writer, is dropped first).
        resume_step: a resumed run's step: implies ``append``, and first rewrites the file
            (atomically) keeping only the records with step <= ``resume_step``; TensorBoard
            hides the events of steps > ``resume_step`` written before (``purge_step``).

    Raises:
        ConfigError: ``append`` / ``resume_step`` and an existing file with a bad line.

    Example::

        with MetricsLog(run / "metrics.jsonl", run / "tb") as log:
            log.write({"step": 100, "train": {"loss": 0.5}})
    """

    def __init__(
        self,
        jsonl: Path,
        logdir: Path | None = None,
        *,
        append: bool = False,
        resume_step: int | None = None,
    ) -> None:
        if resume_step is not None and (isinstance(resume_step, bool) or resume_step < 0):
            raise InputError("resume_step", f"must be an integer >= 0, got {resume_step!r}")
        self.path = Path(jsonl)
        self.logdir = None if logdir is None else Path(logdir)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        keep = append or resume_step is not None
        if keep and self.path.exists():
            _rewrite(self.path, resume_step)
        self._file: IO[str] | None = self.path.open("a" if keep else "w", encoding="utf-8")
        self._writer: _ScalarWriter | None = None
        if self.logdir is not None:
            purge = None if resume_step is None else resume_step + 1
            try:
                self._writer = _summary_writer(self.logdir, purge)
            except BaseException:
                self._file.close()
                raise

    def write(self, record: Mapping[str, Any]) -> None:
        """Append ``record`` as one JSON line (flushed) and its numeric leaves to TensorBoard.

        Raises:
            InputError: no integer ``"step"`` >= 0.
            InputTypeError: a non-string key, or a leaf that is not a number, bool, str or None.
            RuntimeError: the log is closed.
        """
        if self._file is None:
            raise RuntimeError(f"metrics log {self.path} is closed")
        step = _record_step(record)
        line = json.dumps(_jsonable(record, ""), allow_nan=False, separators=(",", ":"))
        self._file.write(line + "\n")
        self._file.flush()
        if self._writer is not None:
            for tag, value in record_scalars(record):
                self._writer.add_scalar(tag, value, global_step=step)
            self._writer.flush()

    def truncate_after(self, step: int) -> None:
        """Drop the records with step > ``step`` from the file (rewritten atomically) and hide
        the TensorBoard events of those steps (a new event file purging them); later writes
        append. Same as opening with ``resume_step=step``."""
        if self._file is None:
            raise RuntimeError(f"metrics log {self.path} is closed")
        self._file.close()
        self._file = None
        _rewrite(self.path, step)
        self._file = self.path.open("a", encoding="utf-8")
        if self._writer is not None and self.logdir is not None:
            self._writer.close()
            self._writer = None
            self._writer = _summary_writer(self.logdir, step + 1)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._file is None

    def close(self) -> None:
        """Flush and close the file and the TensorBoard writer; a second call does nothing."""
        file, writer = self._file, self._writer
        self._file = self._writer = None
        try:
            if writer is not None:
                writer.close()
        finally:
            if file is not None:
                file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
