"""Every checkpoint and delta carries a manifest of its files, checksummed by its marker, and
every reader checks the tree against it: a collection folder, a table's meta or a data file
deleted, a file added, renamed or swapped, a symlink leaving the directory, a FIFO in a file's
place, a damaged manifest: each is a FormatError naming the path; verify never says "ok" with a
table missing. A directory written before manifests (its marker names none) reads as before,
with one warning."""

from __future__ import annotations

import json
import os
import shutil
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from demb_io import MANIFEST, Checkpoint, FormatError, read_delta
from demb_io.cli import main
from demb_io.manifest import reseal
from demb_io.mutations import small_checkpoint, small_delta


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    small_checkpoint(tmp_path / "c")
    return tmp_path / "c"


@pytest.fixture
def delta(tmp_path: Path) -> Path:
    small_delta(tmp_path / "d")
    return tmp_path / "d"


def read_all(path: Path) -> list[np.ndarray]:
    c = Checkpoint(path)
    arrays = []
    for collection in c.collections():
        for table in c.tables(collection):
            data = c.read_table(collection, table)
            arrays += [data.keys, data.values, data.scores, data.state]
    return arrays


def test_the_manifest_lists_every_file_and_the_marker_its_crc(ckpt, delta):
    for root in (ckpt, delta):
        files = json.loads((root / MANIFEST).read_text())["files"]
        on_disk = sorted(p.relative_to(root).as_posix() for p in root.glob("*/*"))
        assert sorted(files) == on_disk
        for name, entry in files.items():
            data = (root / name).read_bytes()
            assert entry["bytes"] == len(data)
            assert entry["crc32"] == ([zlib.crc32(data)] if data else [])
        words = (root / "FORMAT").read_text().split()
        assert words[2:] == ["manifest", f"{zlib.crc32((root / MANIFEST).read_bytes()):08x}"]


def test_a_deleted_collection_fails_verify_and_apply(ckpt, delta, tmp_path, capsys):
    shutil.rmtree(ckpt / "ebc")
    assert main(["verify", str(ckpt)]) == 2
    assert "missing (the manifest lists it)" in capsys.readouterr().err
    assert main(["apply", str(ckpt), str(delta), str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["t.rank1-of-2.meta.json", "t.rank0-of-2.state"])
def test_a_deleted_file_is_named(ckpt, name, capsys):
    (ckpt / "ebc" / name).unlink()
    with pytest.raises(FormatError, match="missing") as bad:
        Checkpoint(ckpt)
    assert bad.value.path == ckpt / "ebc" / name
    assert main(["verify", str(ckpt)]) == 2
    assert main(["inspect", str(ckpt)]) == 2


def test_a_delta_missing_a_table_meta_does_not_merge(delta, tmp_path):
    small_delta(tmp_path / "d2")
    (delta / "ebc" / "t.meta.json").unlink()
    assert main(["merge", str(tmp_path / "m"), str(delta), str(tmp_path / "d2")]) == 2
    assert not (tmp_path / "m").exists()
    with pytest.raises(FormatError, match="missing"):
        read_delta(delta)


@pytest.mark.parametrize("kind", ["extra_file", "renamed_file", "extra_folder", "root_file"])
def test_an_extra_or_renamed_entry_is_named(ckpt, kind):
    folder = ckpt / "ebc"
    if kind == "extra_file":
        bad = folder / "t.rank2-of-2.keys"
        bad.write_bytes(b"")
    elif kind == "renamed_file":
        bad = folder / "u.rank0-of-2.keys"
        (folder / "t.rank0-of-2.keys").rename(bad)
    elif kind == "extra_folder":
        bad = folder / "sub"
        bad.mkdir()
    else:
        bad = ckpt / "notes.txt"
        bad.write_text("x")
    with pytest.raises(FormatError) as err:
        read_all(ckpt)
    assert err.value.path in (bad, folder / "t.rank0-of-2.keys")


def test_swapped_metas_and_data_files_are_caught(ckpt):
    folder = ckpt / "ebc"
    for a, b in [("t.rank0-of-2.meta.json", "t.rank1-of-2.meta.json"), ("t.rank0-of-2.keys",) * 2]:
        pa, pb = folder / a, folder / b
        da, db = pa.read_bytes(), pb.read_bytes()
        pa.write_bytes(db)
        pb.write_bytes(da)
        if a != b:
            with pytest.raises(FormatError):
                read_all(ckpt)
        pa.write_bytes(da)
        pb.write_bytes(db)
    read_all(ckpt)


def test_symlinks_leaving_the_directory_and_fifos_are_refused(ckpt, tmp_path):
    keys = ckpt / "ebc" / "t.rank0-of-2.keys"
    outside = tmp_path / "outside.keys"
    shutil.copy(keys, outside)  # the same bytes, but outside the checkpoint
    keys.unlink()
    keys.symlink_to(outside)
    with pytest.raises(FormatError, match="a symlink leaving the directory") as bad:
        read_all(ckpt)
    assert bad.value.path == keys
    keys.unlink()
    inside = ckpt / "ebc" / "t.rank0-of-2.values"
    keys.symlink_to(inside)  # inside, but another file: its size or CRC differs
    with pytest.raises(FormatError):
        read_all(ckpt)
    keys.unlink()
    os.mkfifo(keys)
    with pytest.raises(FormatError, match="not a regular file"):
        read_all(ckpt)


def test_the_manifest_itself_is_checked(ckpt):
    manifest = ckpt / MANIFEST
    text = manifest.read_text()
    manifest.write_text(text.replace('"bytes"', ' "bytes"', 1))
    with pytest.raises(FormatError, match="CRC-32 is not the"):
        Checkpoint(ckpt)
    manifest.unlink()
    with pytest.raises(FormatError, match=MANIFEST):
        Checkpoint(ckpt)
    marker = ckpt / "FORMAT"
    marker.write_text("demb-checkpoint 1\n")
    manifest.write_text(text)  # a marker cut short while the manifest is there
    with pytest.raises(FormatError, match="names no manifest"):
        Checkpoint(ckpt)


def test_a_manifest_of_a_bad_schema_is_named(ckpt):
    """A manifest whose marker checksum matches but whose content is wrong (written by
    another tool): its field is named."""
    d = json.loads((ckpt / MANIFEST).read_text())
    for change, field in [
        (lambda d: d.update(content="demb-delta"), "content"),
        (lambda d: d.update(extra=1), "extra"),
        (lambda d: d["files"].update({"../x": {"bytes": 0, "crc32": []}}), "files.../x"),
        (lambda d: d["files"]["ebc/t.rank0-of-2.keys"].update(bytes=2**70), "bytes"),
    ]:
        bad = json.loads(json.dumps(d))
        change(bad)
        text = json.dumps(bad).encode()
        (ckpt / MANIFEST).write_bytes(text)
        (ckpt / "FORMAT").write_text(f"demb-checkpoint 1 manifest {zlib.crc32(text):08x}\n")
        with pytest.raises(FormatError) as err:
            Checkpoint(ckpt)
        assert err.value.field == field


def test_a_checkpoint_without_a_manifest_reads_with_one_warning(ckpt, delta):
    before = read_all(ckpt)
    rows = read_delta(delta)
    for root, word in [(ckpt, "demb-checkpoint"), (delta, "demb-delta")]:
        (root / MANIFEST).unlink()
        (root / "FORMAT").write_text(f"{word} 1\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        after = read_all(ckpt)
    assert [str(w.message).count("without a manifest") for w in caught] == [1]
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.warns(UserWarning, match="a delta without a manifest"):
        again = read_delta(delta)
    np.testing.assert_array_equal(again[0].values, rows[0].values)
    outside = ckpt.parent / "outside.keys"
    keys = ckpt / "ebc" / "t.rank0-of-2.keys"
    shutil.copy(keys, outside)
    keys.unlink()
    keys.symlink_to(outside)
    with (
        pytest.warns(UserWarning, match="without a manifest"),
        pytest.raises(FormatError, match="symlink leaving"),
    ):
        read_all(ckpt)


def test_writes_through_every_tool_carry_a_manifest(ckpt, delta, tmp_path):
    small_delta(tmp_path / "d2")
    assert main(["merge", str(tmp_path / "m"), str(delta), str(tmp_path / "d2")]) == 0
    assert main(["reshard", str(ckpt), str(tmp_path / "r"), "--world-size", "3",
                 "--dist-type", "roundrobin"]) == 0  # fmt: skip
    for out in ("m", "r"):
        assert (tmp_path / out / MANIFEST).is_file()
        assert "manifest" in (tmp_path / out / "FORMAT").read_text()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "without a manifest" warning
        read_all(tmp_path / "r")
        read_delta(tmp_path / "m")


def test_a_resealed_copy_of_a_collection_is_refused(ckpt):
    """A collection folder copied (or swapped) and the manifest rewritten to it: its metas
    name another collection, a FormatError naming the meta and the field (it read as extra
    tables, and reshard failed writing them twice)."""
    shutil.copytree(ckpt / "ebc", ckpt / "ebc2")
    reseal(ckpt)
    with pytest.raises(FormatError, match="differs from its folder") as bad:
        read_all(ckpt)
    assert bad.value.field == "collection"
    shutil.rmtree(ckpt / "ebc2")
    folder = ckpt / "ebc"
    a, b = folder / "t.rank0-of-2.meta.json", folder / "t.rank1-of-2.meta.json"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)
    reseal(ckpt)
    with pytest.raises(FormatError, match="is not the shard its file names") as bad:
        read_all(ckpt)
    assert bad.value.field == "table"


def test_a_resealed_row_count_is_refused_by_every_reader(ckpt, capsys):
    """A meta whose rows disagree with the sizes it lists (edited and resealed) is refused
    when the meta is read, by inspect too, which reads no rows."""
    meta = ckpt / "ebc" / "t.rank0-of-2.meta.json"
    d = json.loads(meta.read_text())
    d["rows"] += 1
    meta.write_text(json.dumps(d))
    reseal(ckpt)
    assert main(["inspect", str(ckpt)]) == 2
    assert "[files.keys]: 32 bytes listed, 40 implied by rows" in capsys.readouterr().err
