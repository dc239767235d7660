"""The `demb` command."""

from __future__ import annotations

import json

import pytest


def test_cli_reports_the_environment(capsys):
    from demb_torchrec.cli import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "demb CPU kernels     built" in out
    assert "torch                2.11.0" in out
    assert "device" in out


@pytest.mark.multiproc
def test_bench_dlrm_writes_its_report(tmp_path):
    """``demb bench dlrm`` runs a rank process and writes the report (tiny sizes; no timing is
    checked)."""
    from demb_torchrec.cli import main

    out = tmp_path / "dlrm.json"
    args = ["bench", "dlrm", "--batch-size", "32", "--scale", "0.0001", "--steps", "1"]
    assert main([*args, "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "gloo"
    assert len(report["table_rows"]) == 26
    assert report["step_ms"] > 0
    assert report["command"].startswith("demb bench dlrm")


@pytest.mark.parametrize(
    ("field", "value"),
    [("world_size", 0), ("batch_size", -1), ("steps", 0), ("warmup", -1), ("scale", 0.0)],
)
def test_dlrm_workload_names_a_bad_field(field, value):
    from demb_torchrec.bench.dlrm_bench import DlrmWorkload

    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        DlrmWorkload(**{field: value})
