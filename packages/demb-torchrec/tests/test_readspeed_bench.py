"""``demb bench readspeed`` at a tiny size: the baseline is a copy of the current ``demb_io``
in a temporary folder (no git needed); the report holds, per reader, the current and the
baseline medians, their ratio and the pass column (no speed is checked)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import demb_io
import pytest
from demb_torchrec.bench.readspeed_bench import ReadspeedWorkload, baseline_root


@pytest.fixture
def baseline(tmp_path):
    root = tmp_path / "base" / "packages" / "demb-io" / "src"
    shutil.copytree(
        Path(demb_io.__file__).parent,
        root / "demb_io",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return tmp_path / "base"


@pytest.mark.slow  # four fresh processes importing torch: about 17 s on a 2-core machine
def test_readspeed_reports_each_reader_beside_the_baseline(baseline, tmp_path):
    """``demb bench readspeed --gb 0.002 --repeats 1``: both readers ran on both sides, each
    child imported the demb_io it was meant to."""
    from demb_torchrec.cli import main

    out = tmp_path / "readspeed.json"
    args = ["bench", "readspeed", "--baseline", str(baseline), "--gb", "0.002"]
    assert main([*args, "--repeats", "1", "--dir", str(tmp_path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "readspeed"
    assert report["command"].startswith("demb bench readspeed")
    assert report["bytes"] > 0
    assert report["rows"] > 0
    assert report["baseline_demb_io"] == str(baseline_root(baseline) / "demb_io")
    assert report["baseline_reads"]["reads"] == "the same checkpoint"  # the same demb_io
    assert [(r["reader"], r["cache"]) for r in report["results"]] == [
        ("verify", "warm"),
        ("load", "warm"),
    ]
    for r in report["results"]:
        for side in ("current", "baseline"):
            assert r[side]["errors"] == [], r
            assert len(r[side]["seconds"]) == 1
            assert r[side]["median_s"] > 0
            assert r[side]["gb_per_s"] > 0
            assert r[side]["stubbed"] == []
        assert r["ratio"] == pytest.approx(r["current"]["median_s"] / r["baseline"]["median_s"])
        assert isinstance(r["pass"], bool)
        if r["reader"] == "load":
            assert r["current"]["rows"] == r["baseline"]["rows"] == [report["rows"]]


def test_baseline_root_finds_the_package_or_refuses(baseline, tmp_path):
    root = baseline / "packages" / "demb-io" / "src"
    assert baseline_root(baseline) == root
    assert baseline_root(root) == root
    with pytest.raises(ValueError, match="no demb_io package"):
        baseline_root(tmp_path / "nowhere")


def test_readspeed_workload_refuses_bad_sizes():
    with pytest.raises(ValueError, match="gb"):
        ReadspeedWorkload(baseline=".", gb=0)
    with pytest.raises(ValueError, match="repeats"):
        ReadspeedWorkload(baseline=".", repeats=0)
