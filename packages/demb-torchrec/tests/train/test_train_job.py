"""``demb train`` end to end, as a user runs it (a subprocess each): the default job at a small
size learns (its AUC rises well past its first evaluation), writes its JSONL, TensorBoard
events and plots, and a replica following its deltas reaches the trainer's AUC at the same
step; a run killed with SIGKILL and resumed ends exactly where an uninterrupted run does; two
ranks through torchrun follow the one-rank run."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _job import SMALL, command, env, final_dense, final_tables, records, run
from matplotlib.image import imread
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small default job with a replica beside it."""
    out = tmp_path_factory.mktemp("run")
    done = run("--out", str(out), *SMALL, "--replica")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "demb train: 120 steps of 256 samples" in done.stdout
    return out


def test_the_model_learns_and_everything_is_logged(small_run: Path) -> None:
    found = records(small_run)
    assert [r["step"] for r in found] == [20, 40, 60, 80, 100, 120]  # one line per interval
    evals = [r["eval"] for r in found if "eval" in r]
    assert [r["step"] for r in found if "eval" in r] == [20, 40, 80, 120]
    # the stream's labels come from a hidden model whose own AUC is ~0.8: a model that learns
    # it goes from near chance at its first evaluation to well above
    assert evals[0]["auc"] < 0.7
    assert evals[-1]["auc"] > evals[0]["auc"] + 0.1
    assert evals[-1]["logloss"] < evals[0]["logloss"]
    for r in found:
        assert set(r["tables"]) == {f"cat_{i}" for i in range(26)}
        assert 0 < r["train"]["loss"] < 1
    sizes = sum(t["size"] for t in found[-1]["tables"].values())
    inserts = sum(r["tables"][n]["inserts"] for r in found for n in r["tables"])
    evictions = sum(r["tables"][n]["evictions"] for r in found for n in r["tables"])
    assert sizes == inserts - evictions > 0

    events = EventAccumulator(str(small_run / "tensorboard"))
    events.Reload()
    auc = events.Scalars("eval/auc")
    assert [e.step for e in auc] == [20, 40, 80, 120]
    assert auc[-1].value == pytest.approx(evals[-1]["auc"])
    assert "tables/cat_3/size" in events.Tags()["scalars"]

    for name in ("quality.png", "tables.png"):
        image = imread(small_run / "plots" / name)
        assert image.shape[0] > 400
        assert image.shape[1] > 600
        assert image.std() > 0.05
        assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20


def test_the_replica_reaches_the_trainers_auc(small_run: Path) -> None:
    trainer = {r["step"]: r["eval"] for r in records(small_run) if "eval" in r}
    replica = [r for r in records(small_run, "replica.jsonl") if "auc" in r["replica"]]
    assert replica, "the replica evaluated nothing"
    last = replica[-1]
    assert last["step"] == 120  # caught up with the trainer's last delta
    assert last["replica"]["lag_steps"] == 0
    for r in replica:
        assert abs(r["replica"]["auc"] - trainer[r["step"]]["auc"]) < 0.01
    # the same tables and dense part give the same predictions: the same AUC, not just close
    assert last["replica"]["auc"] == pytest.approx(trainer[120]["auc"], abs=1e-6)


def _wait_for(path: Path, proc: subprocess.Popen[bytes], timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, "the run ended before it was killed"
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_then_resume_ends_where_an_uninterrupted_run_does(
    small_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        command("--out", str(out), *SMALL),
        env=env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for(out / "deltas" / "00000080.pt", proc)  # mid-run: after the full delta
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "DONE").exists()
    resumed = run("--out", str(out), *SMALL, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    # the loss trajectory and evaluations equal the uninterrupted run's, bit for bit
    def trajectory(path: Path) -> list[tuple[int, float, float | None]]:
        return [
            (r["step"], r["train"]["loss"], r.get("eval", {}).get("auc")) for r in records(path)
        ]

    assert trajectory(out) == trajectory(small_run)
    # and so does the final model: every table's keys, rows, optimizer state and scores, and
    # the dense parameters
    a, b = final_tables(out, 120), final_tables(small_run, 120)
    assert a.keys() == b.keys()
    for name in a:
        for part in ("keys", "values", "state", "scores"):
            assert np.array_equal(a[name][part], b[name][part]), (name, part)
    da, db = final_dense(out, 120), final_dense(small_run, 120)
    assert da.keys() == db.keys()
    for name in da:
        assert torch.equal(da[name], db[name]), name


@pytest.mark.slow
@pytest.mark.multiproc
def test_two_ranks_through_torchrun_follow_the_one_rank_run(
    small_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "two"
    done = run("--out", str(out), *SMALL, "--world-size", "2", "--replica", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = records(small_run), records(out)
    replica = records(out, "replica.jsonl")[-1]  # two replica ranks, through torchrun too
    assert replica["step"] == 120
    assert replica["replica"]["auc"] == pytest.approx(two[-1]["eval"]["auc"], abs=1e-6)
    assert [r["step"] for r in two] == [r["step"] for r in one]
    for r1, r2 in zip(one, two, strict=True):
        assert r2["train"]["loss"] == pytest.approx(r1["train"]["loss"], rel=1e-5)
        if "eval" in r1:
            assert r2["eval"]["auc"] == pytest.approx(r1["eval"]["auc"], abs=1e-4)
            assert r2["eval"]["logloss"] == pytest.approx(r1["eval"]["logloss"], rel=1e-5)
        size1 = sum(t["size"] for t in r1["tables"].values())
        size2 = sum(t["size"] for t in r2["tables"].values())
        assert size2 == size1  # the same keys, split over two ranks


@pytest.mark.slow
def test_the_job_on_a_tsv_file_and_on_its_parquet_twin(tmp_path: Path) -> None:
    """``--data``: the same rows as Criteo TSV and as Parquet train the same run (its held-out
    tail evaluated), with an AUC above chance on a planted rule."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    rows = []
    for _ in range(6000):
        ints = [str(rng.randint(-2, 500)) if rng.random() > 0.1 else "" for _ in range(13)]
        cats = [
            f"{rng.randrange(300 + 50 * j):08x}" if rng.random() > 0.05 else "" for j in range(26)
        ]
        label = int((int(cats[0] or "0", 16) % 5 == 0) != (rng.random() < 0.1))
        rows.append([str(label), *ints, *cats])
    tsv = tmp_path / "day_0.tsv"
    tsv.write_text("".join("\t".join(r) + "\n" for r in rows))
    columns = {"label": [int(r[0]) for r in rows]}
    for i in range(13):
        columns[f"I{i + 1}"] = [int(r[1 + i]) if r[1 + i] else None for r in rows]
    for j in range(26):
        columns[f"C{j + 1}"] = [r[14 + j] or None for r in rows]
    parquet = tmp_path / "day_0.parquet"
    pq.write_table(pa.table(columns), parquet)
    args = ["--steps", "20", "--batch-size", "256", "--log-every", "5", "--eval-every", "5",
            "--delta-every", "10", "--ckpt-every", "20", "--no-progress",
            "--set", "data.eval_samples=512"]  # fmt: skip
    runs = {}
    for name, path in (("tsv", tsv), ("parquet", parquet)):
        out = tmp_path / name
        done = run("--data", str(path), "--out", str(out), *args)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = records(out)
    assert runs["tsv"] == [
        {
            **r,
            "seconds": t["seconds"],
            "train": {**r["train"], "samples_per_s": t["train"]["samples_per_s"]},
        }
        for r, t in zip(runs["parquet"], runs["tsv"], strict=True)
    ]
    assert runs["tsv"][-1]["eval"]["auc"] > 0.6
    too_long = run("--data", str(tsv), "--out", str(tmp_path / "x"), "--steps", "500")
    assert too_long.returncode == 2
    assert "train.steps=500" in too_long.stderr
