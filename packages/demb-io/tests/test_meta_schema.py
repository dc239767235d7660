"""A meta JSON holds exactly its format's keys and known score names: a misspelt or
bit-flipped key, a score column of no known name, another format's name, is a FormatError
naming the file and the field (they used to read as absent, and verify said "ok")."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from demb_io import Checkpoint, FormatError, LayoutError, merge_deltas, read_delta, write_delta
from demb_io.manifest import reseal
from demb_io.mutations import small_checkpoint, small_delta

META = {"checkpoint": "ebc/t.rank0-of-2.meta.json", "delta": "ebc/t.meta.json"}


def _read(kind: str, root: Path) -> None:
    if kind == "checkpoint":
        Checkpoint(root).read_table("ebc", "t")
    else:
        read_delta(root)


def _edit(kind: str, root: Path, change) -> None:
    path = root / META[kind]
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


def _rename(old: str, new: str):
    def change(d):
        d[new] = d.pop(old)

    return change


def _set(key: str, value: object):
    def change(d):
        d[key] = value

    return change


CASES = {
    "flipped_key": (_rename("rows", "rowS"), "rowS"),
    "unknown_key": (_set("capacityy", 7), "capacityy"),
    "score_name": (_set("score_strategy", ["TIMESTAMQ"]), "score_strategy"),
    "two_scores": (_set("score_strategy", ["STEP", "LFU"]), "score_strategy"),
    "format": (_set("format", "demb-other"), "format"),
}


@pytest.mark.parametrize("kind", sorted(META))
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_meta_with_a_field_of_no_format_is_a_format_error(tmp_path, kind, case):
    root = tmp_path / kind
    (small_checkpoint if kind == "checkpoint" else small_delta)(root)
    change, field = CASES[case]
    if kind == "delta" and case == "flipped_key":
        change, field = _rename("evicted_rows", "evicted_rowS"), "evicted_rowS"
    _edit(kind, root, change)
    with pytest.raises(FormatError) as bad:
        _read(kind, root)
    assert bad.value.path == root / META[kind]
    assert bad.value.field == field


def test_the_compound_score_reads_in_either_order(tmp_path):
    """TIMESTAMP with LFU, in either order, is the one two-column strategy: not refused."""
    root = tmp_path / "c"
    small_checkpoint(root)
    metas = sorted((root / "ebc").glob("t.rank*.meta.json"))
    assert json.loads(metas[0].read_text())["score_strategy"] == ["TIMESTAMP", "LFU"]
    for meta in metas:
        d = json.loads(meta.read_text())
        d["score_strategy"] = ["LFU", "TIMESTAMP"]
        meta.write_text(json.dumps(d))
    reseal(root)  # an edit on purpose: the manifest rewritten to it
    assert Checkpoint(root).shards("ebc", "t")[0].score_strategy == ("LFU", "TIMESTAMP")


def _files_entry(part: str, name: str):
    def change(d):
        d["files"][part] = {"name": name, "bytes": 0, "crc32": []}

    return change


VALUE_CASES = {
    "checkpoint": {
        "hyper_nan": (_set("hyper_parameters", {"lr": float("nan")}), "hyper_parameters.lr"),
        "hyper_text": (_set("hyper_parameters", {"lr": "0.1"}), "hyper_parameters.lr"),
        "hyper_huge": (_set("hyper_parameters", {"lr": 2**63}), "hyper_parameters.lr"),
        "state_without_width": (_set("state_width", 0), "state_width"),
        "admission_null": (_set("admission_rows", None), "admission_rows"),
        "world_huge": (_set("world_size", 2**64), "world_size"),
        "admit_calls_negative": (_set("admit_calls", -1), "admit_calls"),
        "admit_calls_text": (_set("admit_calls", "4"), "admit_calls"),
    },
    "delta": {
        "score_2_63": (_set("current_score", 2**63), "current_score"),
        "score_negative": (_set("current_score", -1), "current_score"),
        "capacity_buckets": (_set("current_capacity", 200), "current_capacity"),
        "capacity_zero": (_set("current_capacity", 0), "current_capacity"),
        "rows_over_capacity": (_set("row_capacity", [300, 100]), "row_capacity"),
        "no_tier": (_set("row_capacity", []), "row_capacity"),
        "options_nested": (_set("table_options", {"dim": {"a": 1}}), "table_options.dim"),
        "options_inf": (_set("table_options", {"x": float("inf")}), "table_options.x"),
        "evicted_null": (_set("evicted_rows", None), "evicted_rows"),
        "state_without_width": (_set("state_width", 0), "state_width"),
        "extra_part": (_files_entry("admit_keys", "t.admit_keys"), "files.admit_keys"),
    },
}


@pytest.mark.parametrize(
    ("kind", "case"), [(k, c) for k, cases in VALUE_CASES.items() for c in sorted(cases)]
)
def test_meta_values_out_of_range_are_format_errors(tmp_path, kind, case):
    """Values a reader cannot use (a NaN hyper-parameter, a score past int64, a capacity that
    is no whole number of buckets, a file the meta's fields say is absent) are FormatErrors
    naming the field, before any row is read; they used to be taken as they were."""
    root = tmp_path / kind
    (small_checkpoint if kind == "checkpoint" else small_delta)(root)
    change, field = VALUE_CASES[kind][case]
    _edit(kind, root, change)
    with pytest.raises(FormatError) as bad:
        _read(kind, root)
    assert bad.value.path == root / META[kind]
    assert bad.value.field == field


def _poke(path: Path, row: int, value: int, width: int = 1, column: int = 0) -> None:
    data = np.frombuffer(path.read_bytes(), dtype="<i8").copy().reshape(-1, width)
    data[row, column] = value
    path.write_bytes(data.tobytes())


@pytest.mark.parametrize(
    ("part", "value", "match"),
    [
        ("keys", -1, "the empty key"),
        ("erased", -1, "the empty key"),
        ("evicted", -1, "the empty key"),
        ("slots", 256, "slot outside"),
        ("slots", -3, "slot outside"),
        ("scores", 100, "TIMESTAMP age outside"),
        ("scores", -1, "TIMESTAMP age outside"),
    ],
)
def test_delta_values_a_table_cannot_hold_are_format_errors(tmp_path, part, value, match):
    """A delta row of the empty key, a slot past current_capacity (256), a TIMESTAMP age past
    current_score (99) or below 0: a FormatError naming the file, even unverified (the CRCs
    would catch a damaged file; these are values a writer must not have written)."""
    root = tmp_path / "d"
    small_delta(root)
    _poke(root / "ebc" / f"t.{part}", 0, value)
    with pytest.raises(FormatError, match=match) as bad:
        read_delta(root, verify=False)
    assert bad.value.path == root / "ebc" / f"t.{part}"
    assert bad.value.field == part


def test_the_delta_writer_refuses_values_a_table_cannot_hold(tmp_path):
    table = read_delta_table(tmp_path)
    table.scores[0, 0] = table.meta.current_score + 1
    with pytest.raises(ValueError, match="TIMESTAMP age outside"):
        write_delta(tmp_path / "out", [table])
    assert not (tmp_path / "out").exists()


def read_delta_table(tmp_path: Path):
    small_delta(tmp_path / "d")
    return read_delta(tmp_path / "d")[0]


def test_merging_deltas_whose_clock_goes_back_is_a_layout_error(tmp_path):
    """TIMESTAMP ages are rebased from the older delta's current_score to the newer one's; a
    newer delta of a smaller current_score (out of order, or another clock) is refused, where
    merge used to write negative ages."""
    import dataclasses

    table = read_delta_table(tmp_path)
    older = dataclasses.replace(table, meta=dataclasses.replace(table.meta, current_score=500))
    with pytest.raises(LayoutError, match="current_score goes back"):
        merge_deltas([[older], [table]])
