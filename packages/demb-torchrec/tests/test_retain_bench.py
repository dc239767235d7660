"""``demb bench retain`` at a tiny size on the CPU, through the CLI: the report holds the three
variants' step times and both ratios, the retaining model really retained (and popped) evicted
keys, and the step without the hook ran without it. No time is checked."""

from __future__ import annotations

import json

from demb_torchrec.bench import retain_bench


def test_retain_cli_reports_the_three_variants(tmp_path, monkeypatch):
    from demb_torchrec.cli import main

    hooked: list[bool] = []
    real_run = retain_bench._Variant.run

    def run(self, steps, device, timed_round):  # which variants ran with the hook
        hooked.append(self.hook)
        real_run(self, steps, device, timed_round)
        assert "record_evictions" not in vars(self.model.tables)  # the no-op is removed after

    monkeypatch.setattr(retain_bench._Variant, "run", run)
    out = tmp_path / "retain.json"
    args = ["bench", "retain", "--device", "cpu", "--scale", "0.002", "--steps", "2"]
    assert main([*args, "--rounds", "1", "--warmup", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["step_ms"]) == {"discard", "no hook", "retain"}
    assert all(ms > 0 for ms in report["step_ms"].values())
    assert report["discard_vs_no_hook"] > 0
    assert report["retain_vs_discard"] > 0
    assert report["retained_keys_popped"] > 0  # every step evicts, and the keys were kept
    assert hooked == [True, False, True, True, False, True]
    assert report["command"].startswith("demb bench retain")
