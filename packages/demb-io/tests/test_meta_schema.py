"""A meta JSON holds exactly its format's keys and known score names: a misspelt or
bit-flipped key, a score column of no known name, another format's name, is a FormatError
naming the file and the field (they used to read as absent, and verify said "ok")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from demb_io import Checkpoint, FormatError, read_delta
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
