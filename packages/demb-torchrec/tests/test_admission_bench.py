"""``demb bench admission`` at a tiny size on the CPU, through the CLI: the report holds each
figure beside its baseline with their ratio and target, and the benchmark's own checks
passed: admission asked about exactly the new keys and rejected some, the tables grew by the
admitted keys, the counter and the table did the same work. The batches' new keys are checked
on their own. No time is checked."""

from __future__ import annotations

import json
import math

import pytest
import torch
from demb_torchrec.bench._admission_parts import NewKeyBatches
from demb_torchrec.bench.admission_bench import AdmissionWorkload

TARGETS = {
    "train step with admission": 1.15,
    "counter add, new keys": 1.25,
    "counter add, keys present": 1.25,
    "train step with score_function": 1.1,
}


def _check_timed(f):
    for side in (f, f["baseline"]):
        assert len(side["seconds"]) == 1  # one round
        assert side["min"] <= side["median"] <= side["max"]
        assert all(s > 0 and math.isfinite(s) for s in side["seconds"])
    assert f["ratio"] == pytest.approx(f["median"] / f["baseline"]["median"])
    assert f["meets_target"] == (f["ratio"] <= f["target"])
    assert f["baseline_name"]


def test_admission_cli_reports_every_figure_beside_its_baseline(tmp_path, capsys):
    from demb_torchrec.cli import main

    out = tmp_path / "admission.json"
    args = ["bench", "admission", "--device", "cpu", "--scale", "0.002", "--steps", "2"]
    assert main([*args, "--rounds", "1", "--warmup", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "admission"
    assert report["command"].startswith("demb bench admission")
    assert report["machine"]["device"] == "cpu"
    w = report["workload"]
    assert (w["tables"], w["dim"], w["rows"], w["optimizer"]) == (10, 128, 3355, "adam")
    assert w["capacity"] >= 2 * w["rows"]
    assert w["counter_slots"] >= w["counter_capacity"] >= 32 * w["new_keys_per_table_step"]
    assert 0.15 < w["new_keys_per_table_step"] / w["unique_keys_per_table_step"] < 0.25
    figures = {f["figure"]: f for f in report["figures"]}
    assert set(figures) == set(TARGETS)
    for name, target in TARGETS.items():
        assert figures[name]["target"] == target
    for name in ("train step with admission", "counter add, new keys", "counter add, keys present"):
        _check_timed(figures[name])
    for name in ("counter add, new keys", "counter add, keys present"):
        f = figures[name]
        assert f["throughput_ratio"] == pytest.approx(1 / f["ratio"])
        assert f["throughput_target"] == pytest.approx(0.8)

    a = report["checks"]["admission"]
    # warm-up plus one round of two steps; each new key asked about once
    assert a["admitted"] + a["rejected"] == a["new_keys_asked"] > 0
    assert a["rejected"] > 0
    assert a["keys_added"]["admission"] == a["admitted"]
    assert a["keys_added"]["no admission"] == a["new_keys_asked"]  # no eviction at load 0.5
    assert a["train_path"] == {"admission": "DirectRows", "no admission": "DirectRows"}
    c = report["checks"]["counter"]
    assert c["calls_checked"] == 4 * 3  # 2 sides x 2 regimes x (1 warm-up + 2 timed) steps
    assert c["counter_evictions"] == 0

    _check_timed(figures["train step with score_function"])
    evicted = report["checks"]["score_function"]["evicted_in_a_step"]
    assert set(evicted) == {"score_function", "built-in"}
    assert all(min(per_table) > 0 for per_table in evicted.values())
    printed = capsys.readouterr().out
    assert "train step with admission" in printed
    assert "M keys/s" in printed


def test_new_key_batches_replace_a_share_of_unique_ids_by_fresh_ones():
    """Each step's new ids are a range of their own above the rows; the other ids are the base
    batch's; every occurrence of a chosen id becomes the same new id (its frequency carries
    over)."""
    ref = AdmissionWorkload(scale=0.002).reference
    batches = NewKeyBatches(ref, torch.device("cpu"), seed=0, share=0.2)
    seen: set[int] = set()  # the new ids of earlier steps
    for step in range(6):
        this_step: set[int] = set()
        indices, offsets = batches.batch(step)
        base, base_offsets = batches.base[step % 4]
        assert torch.equal(offsets, base_offsets)
        per_table = indices.view(ref.tables, ref.samples)
        for t in range(ref.tables):
            ids = per_table[t]
            new = ids >= ref.rows
            fresh = set(ids[new].tolist())
            assert len(fresh) == batches.new_keys[step % 4][t]
            assert not fresh & seen
            low = ref.rows + step * batches.span
            assert all(low <= k < low + batches.span for k in fresh)
            this_step |= fresh
            old = base.view(ref.tables, ref.samples)[t]
            assert torch.equal(ids[~new], old[~new])
            # the same base id maps to the same new id: the occurrence counts carry over
            pairs = set(zip(old[new].tolist(), ids[new].tolist(), strict=True))
            assert len(pairs) == len(fresh)
        seen |= this_step
    assert batches.asked(6) == sum(sum(batches.new_keys[s % 4]) for s in range(6))
