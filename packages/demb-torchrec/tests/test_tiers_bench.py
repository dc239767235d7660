"""``demb bench tiers`` at a tiny size on the CPU: through the CLI, the report holds every mode
(the all-device baseline, the caching modes and the hybrid modes), each tiered mode's figures
beside their baselines, and rows that crossed between the tiers; with SGD, the rows are the
embedding alone. No time is checked."""

from __future__ import annotations

import json
import math

import pytest
import torch
from demb_torchrec.bench._tiers_parts import HYBRID_MODES, PREFETCH_MODES, PUBLISHED
from demb_torchrec.bench.tiers_bench import TiersWorkload, run

PREFETCHING = [f"caching 1.0, prefetch {how}" for how in PREFETCH_MODES]
MEASURED = ["all-device", "caching 1.0", "caching 0.8", *PREFETCHING, *HYBRID_MODES]


def _check_figure(f: dict, target: float | None) -> None:
    for side in (f, f["baseline"]):
        assert side["min"] <= side["median"] <= side["max"]
        assert all(s >= 0 and math.isfinite(s) for s in side["seconds"])
    assert f["baseline_name"]
    assert f["target"] == target
    if f["baseline"]["median"] > 0:
        assert f["ratio"] == pytest.approx(f["median"] / f["baseline"]["median"])
    if target is not None:
        assert f["meets_target"] == (f["ratio"] <= target)


def _check_report(report: dict, steps: int, row: int) -> None:
    w = report["workload"]
    assert (w["tables"], w["dim"], w["row_bytes"]) == (10, 128, row)
    assert w["max_capacity"] >= 2 * w["rows"]
    assert w["init_capacity"] >= 2 * max(w["distinct_keys_per_table"])
    assert w["ids_per_step"] == 10 * w["samples"]
    modes = {m["mode"]: m for m in report["modes"]}
    assert list(modes) == MEASURED
    for m in modes.values():
        assert len(m["step"]["seconds"]) == len(m["eval"]["seconds"]) == steps
        assert m["keys_held"] == w["distinct_keys_per_table"]
    assert not modes["all-device"]["caching"]
    unique = w["unique_keys_per_table_step"]
    caching = [("caching 1.0", 1.0), ("caching 0.8", 0.8), *((p, 1.0) for p in PREFETCHING)]
    for name, ratio in caching:
        m = modes[name]
        assert m["caching"]
        assert m["budget_bytes"] == math.ceil(ratio * unique) * row
        assert all(0 < c <= m["budget_bytes"] // row for c in m["cache_rows"])
        s = m["cache_stats"]
        crossed = s["storage_hits"] + s["write_backs"]
        assert crossed > 0
        assert m["bytes_per_step"] == pytest.approx(crossed * row / steps, abs=2)
        assert m["bytes_per_step"] > 0
        assert s["evictions"] == 0
        floor = m["floor"]
        assert floor["h2d_bytes"] + floor["d2h_bytes"] == m["bytes_per_step"]
        assert floor["seconds"] == min(floor["h2d_seconds"]) + min(floor["d2h_seconds"])
    tenth, none = (modes[name] for name in HYBRID_MODES)
    assert tenth["kind"] == none["kind"] == "hybrid"
    assert tenth["device_rows"] == math.ceil(w["init_capacity"] / 10)
    assert none["device_rows"] == 0  # a budget below one row
    for m in (tenth, none):
        assert not m["caching"]
        assert m["capacity"] == [w["init_capacity"]] * 10
        assert m["bytes_per_step"] == 2 * round(m["host_rows_per_step"] * row)
    assert none["host_rows_per_step"] == pytest.approx(unique * 10, rel=0.1)  # every row is there
    assert 0 < tenth["host_rows_per_step"] <= none["host_rows_per_step"]
    figures = {f["figure"]: f for f in report["figures"]}
    for name in MEASURED[1:]:
        _check_figure(figures[f"{name}: train step"], 2.0)
        assert figures[f"{name}: train step"]["bytes"] == modes[name]["bytes_per_step"]
        _check_figure(figures[f"{name}: train step vs all-device"], None)
        _check_figure(figures[f"{name}: eval forward vs all-device"], None)
    over, serial = (modes[name] for name in PREFETCHING)
    assert (over["prefetch"], serial["prefetch"]) == PREFETCH_MODES
    # the same batches: the same hits, misses and write-backs with or without prefetch
    for name in PREFETCHING:
        got = dict(modes[name]["cache_stats"], prefetched=0)
        assert got == dict(modes["caching 1.0"]["cache_stats"], prefetched=0)
    assert over["prefetch_alone"] is None
    if steps == 1:  # the only step has no next batch: nothing prefetched, no figure
        assert serial["prefetch_alone"] is None
        assert len(figures) == 3 * (len(MEASURED) - 1)
        return
    assert over["cache_stats"]["prefetched"] > 0
    assert len(serial["prefetch_alone"]["seconds"]) == steps - 1
    hidden = figures[f"{PREFETCHING[0]}: the prefetch's time not hidden (overlapped step - "
                     "serial step without its prefetch)"]  # fmt: skip
    _check_figure(hidden, 1 - 0.7)
    assert hidden["baseline"]["seconds"] == serial["prefetch_alone"]["seconds"]
    alone = hidden["baseline"]["seconds"]
    rest = [t - p for t, p in zip(serial["step"]["seconds"][: steps - 1], alone, strict=True)]
    overlapped = over["step"]["seconds"][: steps - 1]
    want = [max(0.0, o - r) for o, r in zip(overlapped, rest, strict=True)]
    assert hidden["seconds"] == pytest.approx(want)
    assert hidden["hidden_share"] == pytest.approx(1 - hidden["ratio"])
    _check_figure(figures[f"{PREFETCHING[0]}: train step vs without prefetch"], None)
    assert len(figures) == 3 * (len(MEASURED) - 1) + 2
    assert set(report["published"]["figures"]) == {"caching 0.8", "caching 1.0", *HYBRID_MODES}
    assert "not measured here" in report["published"]["what"]


def test_tiers_cli_reports_every_mode_and_writes_json(tmp_path, capsys):
    from demb_torchrec.cli import main

    out = tmp_path / "tiers.json"
    args = ["bench", "tiers", "--device", "cpu", "--scale", "0.001", "--steps", "2"]
    assert main([*args, "--warmup", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "tiers"
    assert report["command"].startswith("demb bench tiers")
    assert report["machine"]["device"] == "cpu"
    assert report["workload"]["optimizer"] == "adam"
    assert report["workload"]["rows"] == 3355
    _check_report(report, steps=2, row=3 * 128 * 4)  # Adam: embedding, m and v
    printed = capsys.readouterr().out
    for name in MEASURED:
        assert name in printed
    assert "not measured here" in printed
    assert f"{PUBLISHED['figures']['caching 1.0']['train_ms']:g}" in printed


def test_sgd_rows_are_the_embedding_alone():
    w = TiersWorkload(scale=0.001, optimizer="sgd", steps=1, warmup=1, copy_iters=2)
    report = run(w, torch.device("cpu"))
    _check_report(report, steps=1, row=128 * 4)


@pytest.mark.parametrize(
    "bad",
    [{"optimizer": "adagrad"}, {"scale": 0.0}, {"steps": 0}, {"warmup": -1}, {"ratios": ()}],
)
def test_bad_workloads_are_refused(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=f"^{name}="):
        TiersWorkload(**bad)
