"""The metrics log of ``demb train`` (JSONL + TensorBoard) and its plots."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from demb_torchrec.errors import ConfigError, InputError, InputTypeError
from demb_torchrec.train.plots import plot_run
from demb_torchrec.train.report import MetricsLog, read_records, record_scalars
from PIL import Image


def _record(step: int, *, tables: int = 26, eval_: bool = True, loss: float | None = None):
    record: dict[str, Any] = {
        "step": step,
        "samples": step * 4096,
        "seconds": step / 16.0,
        "train": {
            "loss": 0.7 - step / 10_000 if loss is None else loss,
            "auc": 0.6 + step / 20_000,
            "samples_per_s": 65000.0,
        },
        "tables": {
            f"cat_{t}": {
                "size": (t + 1) * step,
                "capacity": 2048 * (1 + step // 400),
                "load_factor": (t + 1) * step / (2048 * (1 + step // 400)),
                "inserts": 100 + t + step % 7,
                "evictions": step // 100 + t % 3,
                "resizing": False,
            }
            for t in range(tables)
        },
    }
    if eval_:
        record["eval"] = {"auc": 0.62 + step / 20_000, "logloss": 0.69 - step / 12_000}
        record["replica"] = {"auc": 0.61 + step / 20_000, "lag_steps": 20}
    return record


def _steps(path: Path) -> list[int]:
    return [r["step"] for r in read_records(path)]


def _write(path: Path, steps: list[int], **kwargs: Any) -> None:
    with MetricsLog(path, **kwargs) as log:
        for step in steps:
            log.write(_record(step, tables=2))


# ---------------------------------------------------------------------------------- JSONL


def test_one_line_per_write_round_trips(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"  # the folder is created
    records = [_record(step, tables=3) for step in (0, 100, 200)]
    with MetricsLog(path) as log:
        for record in records:
            log.write(record)
            # flushed at once: the line is on disk before close
            assert len(path.read_text().splitlines()) == records.index(record) + 1
    assert log.closed
    assert read_records(path) == records
    log.close()  # a second close does nothing
    with pytest.raises(RuntimeError, match="closed"):
        log.write(records[0])


def test_non_finite_floats_become_null(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        log.write({"step": 1, "train": {"loss": math.nan, "auc": math.inf, "x": -math.inf}})
        log.write({"step": 2, "train": {"loss": np.float32(0.5), "n": np.int64(3), "ok": True}})
    text = path.read_text()
    assert "NaN" not in text
    assert "Infinity" not in text

    def strict(name: str) -> None:
        raise AssertionError(f"non-strict JSON constant {name}")

    lines = [json.loads(line, parse_constant=strict) for line in text.splitlines()]
    assert lines[0]["train"] == {"loss": None, "auc": None, "x": None}
    assert lines[1]["train"] == {"loss": 0.5, "n": 3, "ok": True}
    assert read_records(path) == lines


def test_truncated_last_line_is_ignored_and_dropped_on_append(tmp_path):
    path = tmp_path / "m.jsonl"
    _write(path, [100, 200, 300])
    with path.open("a") as file:
        file.write('{"step": 400, "train": {"lo')  # a writer killed mid-line
    assert _steps(path) == [100, 200, 300]
    _write(path, [400], append=True)
    assert _steps(path) == [100, 200, 300, 400]
    assert path.read_text().endswith("}\n")


@pytest.mark.parametrize(
    ("bad", "why"),
    [("not json", "not a metrics record"), ("[1, 2]", "list"), ('{"loss": 1}', "step")],
)
def test_corrupt_middle_line_names_the_file_and_line(tmp_path, bad, why):
    path = tmp_path / "m.jsonl"
    _write(path, [100, 200])
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], bad, lines[1]]) + "\n")
    with pytest.raises(ConfigError, match=rf"m\.jsonl: line 2 .*{why}"):
        read_records(path)
    with pytest.raises(ValueError, match="line 2"):  # ConfigError is a ValueError
        MetricsLog(path, append=True)


def test_nan_literal_is_not_strict_json(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1, "loss": NaN}\n{"step": 2}\n')
    with pytest.raises(ConfigError, match="line 1"):
        read_records(path)


def test_append_keeps_and_resume_truncates(tmp_path):
    path = tmp_path / "m.jsonl"
    _write(path, [100, 200, 300, 400, 500, 600])
    _write(path, [700], append=True)
    assert _steps(path) == [100, 200, 300, 400, 500, 600, 700]
    _write(path, [400, 500], resume_step=300)  # implies append
    assert _steps(path) == [100, 200, 300, 400, 500]
    assert not list(tmp_path.glob(".*tmp"))  # the staged file was renamed over the log
    with MetricsLog(path, append=True) as log:
        log.truncate_after(200)
        assert _steps(path) == [100, 200]
        log.write(_record(250, tables=1))
    assert _steps(path) == [100, 200, 250]
    _write(path, [10])  # no append: truncated
    assert _steps(path) == [10]


def test_write_checks_the_record(tmp_path):
    with MetricsLog(tmp_path / "m.jsonl") as log:
        with pytest.raises(InputError, match="step"):
            log.write({"train": {"loss": 1.0}})
        with pytest.raises(InputError, match="step"):
            log.write({"step": True})
        with pytest.raises(InputTypeError, match=r"train/loss.*item\(\)"):
            log.write({"step": 1, "train": {"loss": object()}})
        with pytest.raises(InputTypeError, match="not a string"):
            log.write({"step": 1, "tables": {3: {"size": 1}}})
    with pytest.raises(InputError, match="resume_step"):
        MetricsLog(tmp_path / "m.jsonl", resume_step=-1)


def test_record_scalars_tags():
    record = {"step": 5, "a": 1, "b": {"c": 2.5, "d": None, "e": True, "f": math.nan}, "g": "x"}
    assert list(record_scalars(record)) == [("a", 1.0), ("b/c", 2.5)]


# ----------------------------------------------------------------------------- TensorBoard


def _scalars(logdir: Path) -> Any:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(logdir))
    accumulator.Reload()
    return accumulator


def test_tensorboard_scalars(tmp_path):
    logdir = tmp_path / "tb"
    with MetricsLog(tmp_path / "m.jsonl", logdir) as log:
        for step in (100, 200, 300):
            record = _record(step, tables=3, eval_=step != 200)
            if step == 300:
                record["train"]["loss"] = math.nan
            log.write(record)
    assert list(logdir.glob("events.out.tfevents.*"))
    acc = _scalars(logdir)
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "eval/auc", "tables/cat_0/size", "tables/cat_2/evictions"} <= tags
    assert "step" not in tags
    assert "tables/cat_0/resizing" not in tags  # a bool
    size = acc.Scalars("tables/cat_2/size")
    assert [e.step for e in size] == [100, 200, 300]
    assert [e.value for e in size] == [300.0, 600.0, 900.0]
    assert [e.step for e in acc.Scalars("eval/auc")] == [100, 300]
    assert [e.step for e in acc.Scalars("train/loss")] == [100, 200]  # NaN left out
    assert acc.Scalars("eval/logloss")[0].value == pytest.approx(0.69 - 100 / 12_000)


def test_tensorboard_resume_hides_later_steps(tmp_path):
    logdir = tmp_path / "tb"
    with MetricsLog(tmp_path / "m.jsonl", logdir) as log:
        for step in (100, 200, 300, 400):
            log.write({"step": step, "train": {"loss": 1.0}})
    # The first run's event file is named by its start time; make it earlier than the resumed
    # run's, as it is when a run resumes in a later process (TensorBoard reads files by name).
    (first,) = logdir.iterdir()
    parts = first.name.split(".")
    parts[3] = f"{int(parts[3]) - 10:010d}"
    first.rename(first.with_name(".".join(parts)))
    with MetricsLog(tmp_path / "m.jsonl", logdir, resume_step=200) as log:
        log.write({"step": 300, "train": {"loss": 0.5}})
    loss = _scalars(logdir).Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(100, 1.0), (200, 1.0), (300, 0.5)]


# ---------------------------------------------------------------------------------- plots


def _image(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        assert image.format == "PNG"
        return np.asarray(image.convert("RGB"))


def _assert_drawn(path: Path, size: tuple[int, int]) -> None:
    pixels = _image(path)
    assert pixels.shape == (size[1], size[0], 3)
    assert pixels.std() > 0
    rgb = pixels.astype(np.uint32)
    colors = np.unique((rgb[..., 0] << 16) | (rgb[..., 1] << 8) | rgb[..., 2])
    assert len(colors) > 20


def test_plots(tmp_path):
    records = [_record(step, eval_=step % 500 == 0) for step in range(0, 5000, 100)]
    paths = plot_run(records, tmp_path / "plots")
    assert [p.name for p in paths] == ["quality.png", "tables.png"]
    _assert_drawn(paths[0], (1000, 700))
    _assert_drawn(paths[1], (1000, 800))


def test_plots_from_the_log_without_eval(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLog(path) as log:
        for step in range(0, 1000, 100):
            log.write(_record(step, tables=4, eval_=False, loss=math.nan if step == 300 else None))
    paths = plot_run(read_records(path), tmp_path, counters="cumulative")
    _assert_drawn(paths[0], (1000, 700))
    _assert_drawn(paths[1], (1000, 800))


@pytest.mark.parametrize(
    "records",
    [[], [{"step": 0}], [{"step": 1, "tables": {"t": {"size": 1}}, "train": {"loss": None}}]],
)
def test_plots_with_nothing_to_draw(tmp_path, records):
    paths = plot_run(records, tmp_path)
    for path, size in zip(paths, [(1000, 700), (1000, 800)], strict=True):
        pixels = _image(path)
        assert pixels.shape == (size[1], size[0], 3)
        assert pixels.std() > 0  # axes and a note saying what is missing
