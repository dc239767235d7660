"""``demb bench soak`` at a tiny size on the CPU: the report holds each phase's memory
samples, the growth figures of training beside the eval baseline with their difference, and
every dump/load round trip bit-exact (no memory or time threshold is checked)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from demb_torchrec.bench.soak_bench import SoakWorkload, growth, run, slope

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm"
)


def test_soak_reports_samples_growth_and_exact_round_trips():
    """200 steps a phase, a sample every 100, a round trip every 100 (and one before
    sampling): three samples a phase, the growth rows of RSS, three exact round trips."""
    w = SoakWorkload(steps=200, every=100, warmup=20, dump_every=100)
    report = run(w, torch.device("cpu"))
    json.dumps(report)  # JSON-able
    assert report["benchmark"] == "soak"
    assert report["metrics"] == ["rss_mb"]
    for phase in ("train", "eval"):
        samples = report["samples"][phase]
        assert [s["step"] for s in samples] == [0, 100, 200]
        assert all(s["rss_mb"] > 0 for s in samples)
    assert {(r["metric"], r["kind"]) for r in report["growth"]} == {
        ("rss_mb", "per_1000_steps"),
        ("rss_mb", "total"),
    }
    for row in report["growth"]:
        assert math.isfinite(row["train"])
        assert math.isfinite(row["baseline"])
        assert row["difference"] == pytest.approx(row["train"] - row["baseline"])
    assert report["ms_per_step"]["train"] > 0
    assert report["ms_per_step"]["eval"] > 0
    dump = report["dump"]
    assert dump["round_trips"] == 3
    assert dump["exact"] == 3
    assert dump["mismatches"] == []


def test_soak_cli_writes_its_report(tmp_path):
    """``demb bench soak`` without round trips: exit 0, the report written, ``dump`` null."""
    from demb_torchrec.cli import main

    out = tmp_path / "soak.json"
    args = ["bench", "soak", "--device", "cpu", "--steps", "20", "--every", "10"]
    assert main([*args, "--warmup", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("demb bench soak")
    assert report["dump"] is None
    assert len(report["samples"]["train"]) == 3


def test_growth_is_the_least_squares_slope_per_thousand_steps():
    samples = [{"step": s, "m": 5.0 + 0.002 * s + (0.1 if s == 500 else 0)} for s in (0, 500, 1000)]
    assert slope([0, 1, 2], [1, 3, 5]) == pytest.approx(2)
    g = growth(samples, "m")
    assert g["per_1000_steps"] == pytest.approx(2.0)
    assert g["total"] == pytest.approx(2.0)


def test_soak_workload_refuses_bad_counts():
    with pytest.raises(ValueError, match="every"):
        SoakWorkload(steps=10, every=20)
    with pytest.raises(ValueError, match="dump_every"):
        SoakWorkload(dump_every=-1)


def test_soak_of_the_reference_workload_samples_both_phases():
    """``--model reference`` (scaled down): the module bench's prefilled tables and batches;
    no round trips there (refused), samples of both phases."""
    w = SoakWorkload(steps=20, every=10, warmup=2, model="reference", scale=0.001)
    report = run(w, torch.device("cpu"))
    assert report["workload"]["model"] == "reference"
    assert [s["step"] for s in report["samples"]["train"]] == [0.0, 10.0, 20.0]
    assert [s["step"] for s in report["samples"]["eval"]] == [0.0, 10.0, 20.0]
    assert report["dump"] is None
    with pytest.raises(ValueError, match="dump_every"):
        SoakWorkload(model="reference", dump_every=10)
    with pytest.raises(ValueError, match="model="):
        SoakWorkload(model="other")
