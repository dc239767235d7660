"""``demb bench delta`` at a tiny size on the CPU, through the CLI: the report holds every
figure beside its baseline with their ratio and the issue's target, and the benchmark's own
checks passed (each delta held exactly its window's keys, each replay left the replica equal
to the source for them); the replica check itself is shown to catch a differing row. No time
is checked."""

from __future__ import annotations

import json
import math

import pytest
import torch
from demb_torchrec.bench.delta_bench import (
    DeltaCheckError,
    DeltaWorkload,
    _check_replay,
    _present_keys,
    _train_on,
    build,
)
from demb_torchrec.bench.module_bench import prefill
from demb_torchrec.incremental import incremental_dump
from demb_torchrec.replay import replay_increment
from demb_torchrec.scores import get_score

FIGURES = {
    "incremental_dump": 2.0,
    "replay_increment": 2.0,
    "dump call (blocking=False) returns": 2.0,
    "train step during the background write": 1.15,
}
ROW_COPIES = ("incremental_dump (vs its row gather)", "replay_increment (vs its row scatter)")
"""Figures for information: each call beside the random-row copy inside it (no target)."""


def test_delta_cli_reports_every_figure_beside_its_baseline(tmp_path):
    """``demb bench delta --device cpu --scale 0.0005 --repeats 1``: exit 0, the report
    written with each figure's samples, its baseline's, the ratio of their medians and the
    target; the checks ran on the warm-up window and the timed one; the dumps' folder under
    ``--dir`` is gone."""
    from demb_torchrec.cli import main

    out = tmp_path / "delta.json"
    dumps = tmp_path / "dumps"
    args = ["bench", "delta", "--device", "cpu", "--scale", "0.0005", "--repeats", "1"]
    assert main([*args, "--dir", str(dumps), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "delta"
    assert report["command"].startswith("demb bench delta")
    assert report["device"] == "cpu"
    assert report["machine"]["device"] == "cpu"
    w = report["workload"]
    assert (w["tables"], w["dim"], w["rows"], w["repeats"]) == (10, 128, 839, 1)
    assert w["capacity"] >= w["rows"]
    assert w["capacity"] % 128 == 0
    assert w["touched_rows"] == 84
    figures = {f["figure"]: f for f in report["figures"]}
    # the pageable and snapshot-done rows are CUDA's
    assert set(figures) == set(FIGURES) | set(ROW_COPIES)
    for name, call in zip(ROW_COPIES, ("incremental_dump", "replay_increment"), strict=True):
        f = figures[name]
        assert f["target"] is None
        assert f["meets_target"] is None
        assert f["seconds"] == figures[call]["seconds"]
        assert f["baseline"]["median"] > 0
        assert f["bytes"] == figures[call]["bytes"]
    for name, target in FIGURES.items():
        f = figures[name]
        assert f["target"] == target
        assert len(f["seconds"]) == len(f["baseline"]["seconds"]) == 1
        assert f["median"] > 0
        assert f["baseline"]["median"] > 0
        assert f["ratio"] == pytest.approx(f["median"] / f["baseline"]["median"])
        assert math.isfinite(f["ratio"])
        assert f["meets_target"] == (f["ratio"] <= target)
        assert f["baseline_name"]
    delta_bytes = figures["incremental_dump"]["bytes"]
    assert delta_bytes == figures["replay_increment"]["bytes"]
    # keys, slots (int64), Adam rows (128 + 256 float32) and one TIMESTAMP score per row
    assert delta_bytes == 10 * 84 * (8 + 8 + 8 + 4 * 384)
    assert (
        figures["dump call (blocking=False) returns"]["bytes"]
        == report["background_write"]["table_bytes"]
    )
    write = report["background_write"]
    assert len(write["seconds"]) == 1
    assert write["checkpoint_bytes"] > 0
    assert write["steps_during"][0] >= 3
    assert 1 <= write["steps_before"][0] <= write["steps_during"][0]
    assert report["checks"] == {"deltas": 2, "replays": 2}
    assert list(dumps.iterdir()) == []


def test_replay_check_catches_a_differing_row():
    """The replica check the benchmark runs after each replay: quiet on an exact replay,
    DeltaCheckError once a replayed row of the replica differs from the source's."""
    w = DeltaWorkload(scale=0.0002, repeats=1)
    device = torch.device("cpu")
    model, replica = build(w, device), build(w, device)
    for m in (model, replica):
        prefill(m, w.reference)
    window = [k[: w.touched_rows] for k in _present_keys(model, w.reference.rows)]
    threshold = get_score(model)
    assert threshold is not None
    _train_on(model, window, w.reference.samples)
    replay_increment(replica, incremental_dump(model, threshold))
    _check_replay(model, replica, threshold)
    slots = replica.tables.find(window[3][:1], torch.full((1,), 3))
    row = replica.tables.read(3, slots)
    replica.tables.write(3, slots, row + 1)
    with pytest.raises(DeltaCheckError, match="table_3: the replica's values"):
        _check_replay(model, replica, threshold)


def test_delta_workload_refuses_bad_settings():
    with pytest.raises(ValueError, match="touched"):
        DeltaWorkload(touched=0)
    with pytest.raises(ValueError, match="repeats"):
        DeltaWorkload(repeats=0)
    with pytest.raises(ValueError, match="load_factor"):
        DeltaWorkload(load_factor=1.5)
    with pytest.raises(ValueError, match="scale"):
        DeltaWorkload(scale=0)
