"""``demb bench table``, ``demb bench update`` and ``demb bench io`` at tiny sizes on the CPU:
each writes its report, every figure sits beside its same-run baseline with the ratio of the
two, and the figures agree with the timings they came from (no speed is checked).
``demb bench module --profile`` reports the top ops of a profiled step, and ``demb bench fuzz``
counts its cases' outcomes and fails on an untyped error."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch


def _run(args, tmp_path, name):
    from demb_torchrec.cli import main

    out = tmp_path / f"{name}.json"
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["command"] == "demb " + " ".join([*args, "--out", str(out)])
    assert report["benchmark"] == name
    return report


def _check_comparisons(report):
    """Every comparison: positive, finite figure, baseline and ratio, the ratio the figure over
    the baseline. Returns them by (case, baseline_name)."""
    found = {}
    assert report["comparisons"]
    for c in report["comparisons"]:
        for key in ("figure", "baseline", "ratio"):
            assert math.isfinite(c[key]), (c, key)
            assert c[key] > 0, (c, key)
        assert c["ratio"] == pytest.approx(c["figure"] / c["baseline"], rel=1e-9)
        assert c["unit"]
        assert c["baseline_name"]
        found[c["case"], c["baseline_name"]] = c
    assert len(found) == len(report["comparisons"])
    return found


def test_bench_table_reports_each_op_beside_the_copy_floor(tmp_path, capsys):
    from demb_torchrec.bench.table_bench import floor_bytes_per_key

    args = ["bench", "table", "--device", "cpu", "--capacity-log2", "12", "--batch", "512"]
    args += ["--dims", "8", "16", "--iters", "2", "--copy-mib", "8", "--profile"]
    report = _run(args, tmp_path, "table")
    found = _check_comparisons(report)
    bandwidth = report["copy_bandwidth_bytes_per_s"]
    assert bandwidth > 0
    rows = report["results"]
    ops = ["lookup", "lookup+touch", "find_or_insert", "find_or_insert", "insert_evict"]
    assert [r["op"] for r in rows] == ops * 2
    assert [r["dim"] for r in rows] == [8] * 5 + [16] * 5
    assert len(found) == len(rows)  # the CPU times eagerly only: one comparison per op
    by_case = {case: c for (case, _), c in found.items()}
    for r in rows:
        assert r["eager_keys_per_second"] == pytest.approx(512 / r["eager_seconds_per_batch"])
        c = by_case[f"{r['op']} D={r['dim']} lf {r['load_factor']:.1f} eager"]
        assert c["figure"] == r["eager_keys_per_second"]
        assert c["baseline"] == pytest.approx(bandwidth / floor_bytes_per_key(r["dim"]))
        assert c["unit"] == "keys/s"
        assert "graph_keys_per_second" not in r
    assert floor_bytes_per_key(8) == 8 + 2 * 8 * 4
    assert all(r["evicted_fraction"] > 0.9 for r in rows if r["op"] == "insert_evict")
    assert "lookup" in report["profile"]
    out = capsys.readouterr().out
    assert "copy floor" in out
    assert "per-kernel time" in out


def test_bench_update_reports_each_optimizer_beside_the_floor_and_torch(tmp_path):
    from demb_torchrec.bench.update_bench import OPTIMIZERS, moved_bytes

    args = ["bench", "update", "--device", "cpu", "--rows", "200", "--table-rows", "1000"]
    args += ["--dim", "8", "--iters", "2", "--copy-mib", "8"]
    report = _run(args, tmp_path, "update")
    found = _check_comparisons(report)
    bandwidth = report["copy_bandwidth_bytes_per_s"]
    rows = report["results"]
    assert [r["optimizer"] for r in rows] == list(OPTIMIZERS)
    assert len(found) == 3 * len(rows)
    for r in rows:
        assert r["bytes"] == moved_bytes(200, r["row_width"], 4, 8)
        case = f"{r['optimizer']} float32 D=8"
        floor = found[case, "copy bandwidth (floor)"]
        assert floor["figure"] == pytest.approx(r["bytes"] / r["seconds"])
        assert floor["baseline"] == bandwidth
        plain = found[case, "torch update (same rows)"]
        assert plain["figure"] == floor["figure"]
        assert plain["baseline"] == pytest.approx(r["bytes"] / r["torch_seconds"])
        assert plain["ratio"] == pytest.approx(r["torch_seconds"] / r["seconds"])
        checked = found[f"{case} check=True", "check=False"]
        assert checked["figure"] == pytest.approx(r["bytes"] / r["seconds_with_check"])
        assert checked["baseline"] == floor["figure"]
        assert r["fraction_of_copy_bandwidth"] == pytest.approx(floor["ratio"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["adam", "ftrl", "sgd", "adagrad", "rowwise_adagrad"])
def test_torch_update_baseline_does_the_fused_update(name, dtype):
    """The baseline does the work it is compared with: the same rows as apply_update's."""
    from demb_optim import SPEC_TYPES, OptimizerKind, apply_update
    from demb_torchrec.bench.update_bench import torch_update

    spec = SPEC_TYPES[OptimizerKind(name)]()
    dim = 8
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(50, dim + spec.state_dim(dim, dtype), generator=gen).to(dtype)
    slots = torch.randperm(50, generator=gen)[:20]
    grads = torch.randn(20, dim, generator=gen)
    fused, plain = values.clone(), values.clone()
    apply_update(spec, [fused], [slots], [grads], [dim], [3])
    torch_update(spec, plain, slots, grads, dim, 3)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(plain.float(), fused.float(), rtol=tol, atol=tol)
    assert not torch.equal(plain, values)


def test_bench_io_reports_each_step_beside_raw_file_io(tmp_path):
    args = ["bench", "io", "--rows", "1000", "--dim", "8", "--repeats", "2"]
    report = _run([*args, "--dir", str(tmp_path)], tmp_path, "io")
    found = _check_comparisons(report)
    total = report["workload"]["bytes"]
    assert total == 1000 * (8 + 4 * 8 + 16)
    rates, seconds = report["bytes_per_s"], report["seconds"]
    for kind, times in seconds.items():
        assert len(times) == 2
        assert rates[kind] == pytest.approx(total / statistics.median(times))
    assert len(found) == 7
    write = found["write", "raw numpy write + fsync"]
    assert (write["figure"], write["baseline"]) == (rates["write"], rates["raw_write"])
    cold = found["read from disk, CRC checked", "raw read from disk"]
    assert (cold["figure"], cold["baseline"]) == (rates["verified_cold"], rates["raw_read_cold"])
    warm = found["read from page cache", "raw read from page cache"]
    assert (warm["figure"], warm["baseline"]) == (rates["read"], rates["raw_read"])
    assert [p for p in tmp_path.iterdir() if p.name.startswith("demb_io_bench_")] == []


def test_bench_module_profile_reports_the_top_ops(tmp_path, capsys):
    """``--profile --trace`` on the CPU: after the normal report, the phases and the top ops by
    self host time (each with positive times, ranked), no device table; the Chrome trace holds
    the phases' ranges."""
    from demb_torchrec.bench.module_profile import PHASES
    from demb_torchrec.cli import main

    out, trace = tmp_path / "module.json", tmp_path / "trace.json"
    args = ["bench", "module", "--device", "cpu", "--tables", "2", "--rows", "200"]
    args += ["--samples", "100", "--steps", "1", "--warmup", "0", "--no-baseline"]
    assert main([*args, "--profile", "--trace", str(trace), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["demb"]["train_ms"] > 0  # the normal report is still there
    profile = report["profile"]
    assert profile["device"] == "cpu"
    assert profile["trace"] == str(trace)
    assert set(profile["phases"]) == set(PHASES)
    assert all(p["host_us"] > 0 for p in profile["phases"].values())
    assert all(p["device_busy_us"] == 0 for p in profile["phases"].values())  # no device
    ops = profile["by_host"]
    assert 0 < len(ops) <= 15
    for op in ops:
        assert op["name"] not in PHASES
        assert op["calls_per_step"] > 0
        assert op["self_host_us"] > 0
        assert op["host_us"] >= op["self_host_us"] * 0.999
    assert [op["self_host_us"] for op in ops] == sorted(
        (op["self_host_us"] for op in ops), reverse=True
    )
    assert any(op["name"].startswith("demb::") for op in ops)
    assert profile["by_device"] == []
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert set(PHASES) <= names
    printed = capsys.readouterr().out
    assert printed.index("demb adam:") < printed.index("top ops by self host time")
    assert ops[0]["name"][:60] in printed
    assert "top ops by self device time" not in printed


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("table", ["--device", "--capacity-log2", "--batch", "--dims", "--profile", "--out"]),
        ("update", ["--device", "--scale", "--rows", "--dtype", "--optimizers", "--out"]),
        ("io", ["--rows", "--dim", "--repeats", "--dir", "--out"]),
        ("module", ["--profile", "--trace", "--out"]),
        ("dlrm", ["--world-size", "1,2,4", "NCCL_NVLS_ENABLE=0", "--out"]),
        ("fuzz", ["--cases", "--seed", "--out"]),
    ],
)
def test_bench_commands_have_help(command, flags, capsys):
    from demb_torchrec.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for flag in flags:
        assert flag in out, flag


def test_the_cli_offers_every_optimizer_the_update_bench_times():
    from demb_torchrec import cli
    from demb_torchrec.bench.update_bench import OPTIMIZERS

    assert cli._UPDATE_OPTIMIZERS == OPTIMIZERS


def test_bench_workloads_name_a_bad_field():
    from demb_torchrec.bench.io_bench import IoWorkload
    from demb_torchrec.bench.table_bench import TableWorkload
    from demb_torchrec.bench.update_bench import UpdateWorkload

    with pytest.raises(ValueError, match="batch=4096"):
        TableWorkload(capacity_log2=12, batch=4096)
    with pytest.raises(ValueError, match="rows=10"):
        UpdateWorkload(rows=10, table_rows=5)
    with pytest.raises(ValueError, match="optimizers="):
        UpdateWorkload(optimizers=("lamb",))
    with pytest.raises(ValueError, match="repeats=3"):
        IoWorkload(repeats=3)
