"""The `demb` command."""

from __future__ import annotations

import json

import pytest
import torch


def test_cli_reports_the_environment(capsys):
    from demb_torchrec.cli import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "demb CPU kernels     built" in out
    assert "torch                2.11.0" in out
    assert "device" in out


@pytest.mark.slow  # the DLRM path runs by default in tests/train/test_train_job.py
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


@pytest.mark.multiproc
def test_bench_dlrm_scaling_sets_each_world_size_beside_one_rank(tmp_path, capsys):
    """``--world-size 1,2`` runs 1 then 2 gloo ranks (the smallest batch): the JSON holds both
    reports, and each scaling row's efficiency is its samples/s over W x the 1-rank figure of
    the same run, as the printed table shows it."""
    from demb_torchrec.cli import main

    out = tmp_path / "dlrm.json"
    args = ["bench", "dlrm", "--world-size", "1,2", "--batch-size", "1", "--scale", "0.0001"]
    assert main([*args, "--steps", "1", "--warmup", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"].startswith("demb bench dlrm --world-size 1,2")
    assert report["world_sizes"] == [1, 2]
    reports = report["reports"]
    assert [r["workload"]["world_size"] for r in reports] == [1, 2]
    assert all(r["backend"] == "gloo" and r["workload"]["batch_size"] == 1 for r in reports)
    base = reports[0]["samples_per_s"]
    assert base == pytest.approx(1 / (reports[0]["step_ms"] / 1e3))
    printed = capsys.readouterr().out
    for row, r, c in zip(report["scaling"], reports, report["comparisons"], strict=True):
        w = r["workload"]["world_size"]
        assert row["world_size"] == w
        assert row["samples_per_s"] == r["samples_per_s"] > 0
        assert row["w_times_one_rank_samples_per_s"] == pytest.approx(w * base)
        assert row["efficiency"] == pytest.approx(r["samples_per_s"] / (w * base))
        assert c["ratio"] == pytest.approx(row["efficiency"])
        assert f"world size {w} " in printed
        assert f"{row['efficiency']:.3g}x" in printed
    assert report["scaling"][0]["efficiency"] == pytest.approx(1.0)
    assert "dlrm on cpu x 2 (gloo)" in printed


def test_bench_dlrm_world_sizes_parse_an_int_or_a_list_with_one(capsys):
    """A single world size keeps working; a list must hold 1 (the scaling baseline), each size
    once; ``scaling`` divides each figure by W x the 1-rank figure."""
    from demb_torchrec.bench.dlrm_bench import scaling
    from demb_torchrec.cli import _world_sizes, main

    assert _world_sizes("2") == [2]
    assert _world_sizes("1,2,4") == [1, 2, 4]
    for bad in ("2,4", "1,1", "0", "1,x", ""):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "dlrm", "--world-size", bad])
        assert exit_info.value.code == 2, bad
    assert "--world-size" in capsys.readouterr().err
    reports = [
        {"workload": {"world_size": w}, "samples_per_s": s} for w, s in ((2, 150.0), (1, 100.0))
    ]
    assert [c.ratio for c in scaling(reports)] == [0.75, 1.0]
    assert [c.baseline for c in scaling(reports)] == [200.0, 100.0]
    with pytest.raises(ValueError, match="world size 1"):
        scaling(reports[:1])


@pytest.mark.parametrize(
    ("field", "value"),
    [("world_size", 0), ("batch_size", -1), ("steps", 0), ("warmup", -1), ("scale", 0.0)],
)
def test_dlrm_workload_names_a_bad_field(field, value):
    from demb_torchrec.bench.dlrm_bench import DlrmWorkload

    with pytest.raises(ValueError, match=f"{field}={value!r}"):
        DlrmWorkload(**{field: value})


@pytest.mark.slow
@pytest.mark.multiproc
def test_bench_balance_counts_the_keys_each_rank_holds(tmp_path):
    """``demb bench balance`` on 2 CPU ranks: keys that are all multiples of the world size go
    to rank 0 alone under roundrobin and spread under hash_roundrobin; every drawn key is held
    by exactly one rank (the counts add up to the distinct keys drawn)."""
    import torch
    from demb_torchrec.bench.balance_bench import BalanceWorkload, _keys
    from demb_torchrec.cli import main

    out = tmp_path / "balance.json"
    args = ["bench", "balance", "--world-size", "2", "--batch-size", "512", "--steps", "2"]
    assert main([*args, "--out", str(out)]) == 0
    tables = json.loads(out.read_text())["tables"]
    w = BalanceWorkload(world_size=2, batch_size=512, steps=2)
    for stream in ("strided", "power_law"):
        drawn = torch.cat([_keys(w, stream, r, s) for r in range(2) for s in range(2)])
        distinct = int(drawn.unique().numel())
        for dist_type in ("roundrobin", "hash_roundrobin"):
            assert sum(tables[f"{stream}/{dist_type}"]["keys_per_rank"]) == distinct
    assert tables["strided/roundrobin"]["keys_per_rank"][1] == 0
    assert tables["strided/roundrobin"]["max_over_mean"] == 2.0
    assert tables["strided/hash_roundrobin"]["max_over_mean"] < 1.2


def test_balance_workload_names_a_bad_field():
    from demb_torchrec.bench.balance_bench import BalanceWorkload

    with pytest.raises(ValueError, match="world_size=0"):
        BalanceWorkload(world_size=0)
    with pytest.raises(ValueError, match=r"alpha=1\.0"):
        BalanceWorkload(alpha=1.0)


def test_bench_module_writes_its_report(tmp_path):
    """``demb bench module`` on the CPU at a tiny scale: the report holds every phase (eval after
    each training step and eval back to back), the workload's lookups and unique keys, and the
    floor bytes of a step (no timing is checked)."""
    from demb_torchrec.cli import main

    out = tmp_path / "module.json"
    args = ["bench", "module", "--device", "cpu", "--tables", "2", "--rows", "500"]
    args += ["--samples", "300", "--steps", "2", "--warmup", "1", "--no-baseline"]
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    demb = report["demb"]
    for phase in ("forward", "backward", "train", "step", "eval", "eval_loop"):
        assert demb[f"{phase}_ms"] > 0, phase
    assert demb["lookups"] == 2 * 300  # NONE pooling: one id per sample and table
    assert 0 < demb["unique"] <= 2 * 300
    assert demb["bytes_train"] > demb["bytes_eval"] > 0
    assert "torchrec" not in report
    assert "profile" not in report


def test_bench_module_no_check_gradients_builds_an_unchecked_module(tmp_path):
    """``--no-check-gradients`` reaches the module (its check_gradients option) and the report's
    workload; without it the module checks."""
    from demb_torchrec.bench.module_bench import build
    from demb_torchrec.bench.workload import Workload
    from demb_torchrec.cli import main

    w = Workload(tables=1, dim=4, rows=50, samples=20)
    assert build(w, torch.device("cpu")).check_gradients
    unchecked = Workload(**{**w.as_dict(), "check_gradients": False})
    assert not build(unchecked, torch.device("cpu")).check_gradients
    out = tmp_path / "module.json"
    args = ["bench", "module", "--device", "cpu", "--tables", "1", "--rows", "50"]
    args += ["--samples", "20", "--steps", "1", "--warmup", "0", "--no-baseline"]
    assert main([*args, "--no-check-gradients", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["workload"]["check_gradients"] is False


def test_bench_module_steps_train_the_module_on_either_thread():
    """The benchmark's timed steps (the CUDA run also times them with the backward on the
    calling thread): every step updates the rows its batch looked up, both ways give the same
    rows, and autograd's multithreading setting is restored afterwards."""
    from demb_torchrec.bench.module_bench import _train_phases, ready
    from demb_torchrec.bench.workload import Workload

    w = Workload(tables=2, dim=8, rows=50, samples=40)
    rows = []
    for caller_thread in (False, True):
        torch.manual_seed(0)  # the output gradient (and any unseeded initializer)
        module, batches, grad = ready(w, torch.device("cpu"), count=2)
        before = [v.clone() for v in module.tables.values]
        phases = _train_phases(module, batches, grad, 2, 1, "test", caller_thread=caller_thread)
        assert [len(v) for v in phases.values()] == [2, 2, 2, 2]
        assert torch.autograd.is_multithreading_enabled()
        after = module.tables.values
        assert all(not torch.equal(b, v) for b, v in zip(before, after, strict=True))
        rows.append([v.clone() for v in after])
    assert all(torch.equal(a, b) for a, b in zip(*rows, strict=True))


def test_bench_module_whole_steps_train_as_the_timed_phases_do():
    """The train steps timed whole (forward then backward, no sync between) update the tables
    exactly as the same number of phase-timed steps do, on either thread."""
    from demb_torchrec.bench.module_bench import _step_loop, _train_phases, ready
    from demb_torchrec.bench.workload import Workload

    w = Workload(tables=2, dim=8, rows=50, samples=40)
    rows = []
    for whole, caller_thread in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        module, batches, grad = ready(w, torch.device("cpu"), count=2)
        before = [v.clone() for v in module.tables.values]
        if whole:
            times = _step_loop(module, batches, grad, 2, 1, caller_thread=caller_thread)
            assert len(times) == 2
            assert all(t > 0 for t in times)
        else:
            _train_phases(module, batches, grad, 2, 1, "test", caller_thread=False)
        assert torch.autograd.is_multithreading_enabled()
        after = [v.clone() for v in module.tables.values]
        assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
        rows.append(after)
    for other in rows[1:]:
        assert all(torch.equal(a, b) for a, b in zip(rows[0], other, strict=True))
