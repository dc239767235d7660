"""``demb bench fuzz`` over every reader: seeded mutations of a real checkpoint and real deltas
(bytes, JSON numbers, files and folders deleted, swapped, renamed or added, FIFOs, symlinks)
end in identical content or a typed error, within the time limit, for the demb-io CLI's verify,
inspect, merge, apply, reshard and export, demb-io's readers and DynamicEmbLoad (2,000 cases by
default, 20,000 under the ``slow`` marker); and the harness itself tells each failure (an
untyped error, a hang, a table missing, a symlink out read, a partial output) apart, counts
every case and replays any case alone."""

from __future__ import annotations

import json
import os
import random
import shutil

import pytest
from demb_io import FormatError
from demb_io.mutations import TREE_KINDS, fuzz_checkpoint, mutate_tree
from demb_torchrec.bench.fuzz_bench import FAILURES, OUTCOMES, FuzzWorkload, run
from demb_torchrec.bench.fuzz_readers import READERS, Reader, checkpoint_content


def _summary(report):
    groups = [
        f"{g['count']} x {g['outcome']} {g['mutation']} {g['reader']} "
        f"(case {g['first_case']}: {g['example']})"
        for g in report["groups"]
    ]
    return "\n".join(groups)


@pytest.mark.parametrize("cases", [2_000, pytest.param(20_000, marks=pytest.mark.slow)])
def test_every_reader_gives_identical_content_or_a_typed_error(cases):
    report = run(FuzzWorkload(cases=cases, seed=0))
    assert report["cases"] == cases
    assert {name: sum(c.values()) for name, c in report["readers"].items()} == dict.fromkeys(
        READERS, cases // len(READERS)
    )
    assert all(sum(report["kinds"][k].values()) > 0 for k in TREE_KINDS)
    assert not report["pristine_changed"]
    assert report["slowest"]["seconds"] < 5
    assert report["failed"] is False, _summary(report)
    assert report["outcomes"]["typed_error"] > cases // 2
    assert report["outcomes"]["identical"] > 0


def test_the_cli_counts_every_case_and_a_case_replays_alone(tmp_path, capsys):
    from demb_torchrec.cli import main

    out = tmp_path / "fuzz.json"
    args = ["bench", "fuzz", "--cases", "30", "--seed", "7", "--readers", "read_delta", "inspect"]
    assert main([*args, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "fuzz"
    assert report["command"].startswith("demb bench fuzz --cases 30 --seed 7")
    assert set(report["outcomes"]) == set(OUTCOMES)
    assert {k: sum(c.values()) for k, c in report["readers"].items()} == {
        "read_delta": 15,
        "inspect": 15,
    }
    assert sum(sum(c.values()) for c in report["kinds"].values()) == 30
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()]
    rows = {words[0]: words[1:] for words in lines}
    assert rows["reader"] == ["cases", *OUTCOMES]
    assert rows["read_delta"] == [
        "15",
        *(str(report["readers"]["read_delta"][o]) for o in OUTCOMES),
    ]
    again: dict[str, dict[str, int]] = {}
    for i in range(30):  # each case alone: the same reader, mutation and outcome
        one = run(FuzzWorkload(seed=7, readers=("read_delta", "inspect"), case=i))
        assert one["cases"] == 1
        for reader, counts in one["readers"].items():
            for outcome, n in counts.items():
                again.setdefault(reader, dict.fromkeys(OUTCOMES, 0))[outcome] += n
    assert again == report["readers"]


def _on_mutated(read):
    """A reader that reads the undamaged checkpoint as ``checkpoint_content`` does and calls
    ``read(paths, out)`` on a mutated one."""

    def reader(paths, out):
        if "inputs" in paths["checkpoint"].parts:  # the undamaged input: the reference
            return checkpoint_content(paths["checkpoint"])
        return read(paths, out)

    return reader


def test_untyped_errors_hangs_and_partial_outputs_fail_the_run(monkeypatch, capsys):
    def untyped(paths, out):
        raise KeyError("forced")

    def blocked(paths, out):
        os.mkfifo(out / "fifo")
        with open(out / "fifo", "rb"):  # no writer: blocks until SIGALRM
            pass

    def partial(paths, out):
        (out / "half").write_bytes(b"x")
        raise FormatError(out / "half", "", "forced")

    for name, read in [("untyped", untyped), ("blocked", blocked), ("partial", partial)]:
        reader = Reader(("checkpoint",), _on_mutated(read), atomic=True)
        monkeypatch.setitem(READERS, name, reader)
    readers = ("read_checkpoint", "untyped", "blocked", "partial")
    report = run(FuzzWorkload(cases=8, readers=readers, case_seconds=0.3))
    assert report["failed"] is True
    assert report["readers"]["untyped"]["untyped"] == 2
    assert report["readers"]["blocked"]["hang"] == 2
    assert report["readers"]["partial"]["partial"] == 2
    assert sum(report["readers"]["read_checkpoint"][o] for o in FAILURES) == 0
    assert {(g["outcome"], g["reader"]) for g in report["groups"]} == {
        ("untyped", "untyped"),
        ("hang", "blocked"),
        ("partial", "partial"),
    }
    assert [f["case"] for f in report["failures"]] == [1, 2, 3, 5, 6, 7]
    assert all("KeyError: 'forced'" in f["error"] for f in report["failures"][::3])
    assert "['half']" in report["failures"][2]["error"]
    assert all(f["seconds"] < 1 for f in report["failures"])
    printed = capsys.readouterr().out
    assert "FAILED: failures by outcome, mutation and reader" in printed
    assert "demb bench fuzz --seed 0 --case I --readers" in printed


def test_a_table_missing_and_a_symlink_out_read_fail_the_run(monkeypatch):
    """A reader that drops a table reads ``changed`` (the table named missing); one that reads
    the same content whatever the tree is ``escaped`` where the tree has a symlink out."""

    def dropping(paths, out):
        return tuple(e for e in checkpoint_content(paths["checkpoint"]) if "ec/u" not in e[0])

    def constant(paths, out):
        return (("rows", 1),)

    monkeypatch.setitem(READERS, "dropping", Reader(("checkpoint",), _on_mutated(dropping)))
    monkeypatch.setitem(READERS, "constant", Reader(("checkpoint",), constant))
    report = run(FuzzWorkload(cases=200, readers=("dropping", "constant"), reseal=0.0))
    dropping_counts, constant_counts = report["readers"]["dropping"], report["readers"]["constant"]
    assert dropping_counts["changed"] + dropping_counts["typed_error"] == 100
    assert dropping_counts["changed"] > 0
    changed = [g for g in report["groups"] if g["reader"] == "dropping"]
    assert all(g["example"].startswith("missing ec/u") for g in changed)
    escaped = constant_counts["escaped"]
    assert escaped > 0
    assert escaped + constant_counts["identical"] == 100
    kinds = {g["mutation"] for g in report["groups"] if g["reader"] == "constant"}
    assert kinds == {"symlink_outside"}


def test_tree_mutations_are_seeded_and_touch_only_their_copy(tmp_path):
    pristine = tmp_path / "pristine"
    fuzz_checkpoint(pristine)
    before = {p: p.read_bytes() for p in pristine.rglob("*") if p.is_file()}
    seen: set[str] = set()
    for i in range(400):  # until every kind was seen; the first 30 twice (same record)
        if seen == set(TREE_KINDS) and i >= 30:
            break
        records = []
        for attempt in range(2 if i < 30 else 1):
            case = tmp_path / f"case{attempt}"
            shutil.copytree(pristine, case / "c")
            m = mutate_tree(case / "c", random.Random(i), case / "outside")
            listing = sorted(
                (p.relative_to(case).as_posix(), p.is_symlink(), p.is_dir())
                for p in case.rglob("*")
            )
            records.append((m.kind, m.path, m.detail.replace(str(case), ""), listing))
            assert m.leaves == (m.kind == "symlink_outside")
            shutil.rmtree(case)
        assert records[0] == records[-1]
        seen.add(records[0][0])
    assert seen == set(TREE_KINDS)
    assert {p: p.read_bytes() for p in pristine.rglob("*") if p.is_file()} == before
