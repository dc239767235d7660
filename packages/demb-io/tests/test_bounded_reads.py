"""The readers read a checkpoint's or a delta's small files (``FORMAT``, the meta JSONs) only
when they are regular files of a bounded size: a FIFO, a device, a folder or a huge file in
their place is a FormatError naming the file, raised at once (never a hang or MemoryError)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from demb_io import Checkpoint, FormatError, read_delta
from demb_io.mutations import small_checkpoint, small_delta

READERS: dict[str, tuple[Callable[[Path], None], Callable[[Path], object]]] = {
    "checkpoint": (small_checkpoint, lambda p: Checkpoint(p).shards("ebc")),
    "delta": (small_delta, read_delta),
}
SMALL = {
    "checkpoint": ("FORMAT", "ebc/t.rank0-of-2.meta.json"),
    "delta": ("FORMAT", "ebc/t.meta.json"),
}


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.unlink()
    path.symlink_to("/dev/zero")


def _huge(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(3 << 30)  # sparse: 3 GiB read as zeros, no disk used


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


REPLACEMENTS = {"fifo": _fifo, "dev_zero": _dev_zero, "huge": _huge, "folder": _folder}


def _raises_at_once(read: Callable[[], object]) -> FormatError:
    """The FormatError ``read`` raises, within 5 s (a read that blocks fails the test)."""
    caught: list[BaseException] = []

    def run() -> None:
        try:
            read()
        except BaseException as err:  # the test asserts what it was
            caught.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(5)
    assert not worker.is_alive(), "the read blocked"
    assert len(caught) == 1
    assert isinstance(caught[0], FormatError), repr(caught[0])
    return caught[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo") or not Path("/dev/zero").exists(), reason="POSIX")
@pytest.mark.parametrize("kind", sorted(READERS))
@pytest.mark.parametrize("which", [0, 1], ids=["marker", "meta"])
@pytest.mark.parametrize("replacement", sorted(REPLACEMENTS))
def test_a_small_file_that_is_not_a_bounded_regular_file_is_a_format_error(
    tmp_path, kind, which, replacement
):
    make, read = READERS[kind]
    root = tmp_path / kind
    make(root)
    victim = root / SMALL[kind][which]
    REPLACEMENTS[replacement](victim)
    error = _raises_at_once(lambda: read(root))
    assert error.path == victim


HUGE = [2**40, 2**63, 2**64, -(2**63)]
"""Counts no file holds (2**31 - 1 is left out: were the bug back, it would take ~16 GB first)."""


@pytest.mark.parametrize("every", [False, True], ids=["one_rank", "every_rank"])
@pytest.mark.parametrize("field", ["world_size", "rows", "rank", "embedding_dim"])
@pytest.mark.parametrize("value", HUGE, ids=str)
def test_a_huge_or_negative_count_in_a_meta_is_a_format_error(tmp_path, field, value, every):
    """A meta count no file can hold, in one rank's meta or in every rank's, is refused by the
    reader before it sizes anything by it (never MemoryError or OverflowError)."""
    root = tmp_path / "c"
    small_checkpoint(root)
    metas = sorted((root / "ebc").glob("t.rank*.meta.json"))
    for meta in metas if every else metas[:1]:
        d = json.loads(meta.read_text())
        d[field] = value
        meta.write_text(json.dumps(d))

    def read_all() -> None:
        ckpt = Checkpoint(root)
        ckpt.read_table("ebc", "t")

    _raises_at_once(read_all)


DATA = {
    "checkpoint": ["ebc/t.rank0-of-2.keys", "ebc/t.rank1-of-2.values"],
    "delta": ["ebc/t.values", "ebc/t.erased"],
}


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="POSIX")
@pytest.mark.parametrize(
    ("kind", "part"), [(k, p) for k, parts in sorted(DATA.items()) for p in parts]
)
@pytest.mark.parametrize("replacement", ["fifo", "folder"])
def test_a_data_file_that_is_not_a_regular_file_is_a_format_error(
    tmp_path, kind, part, replacement
):
    """A FIFO or a folder in place of a data file is a FormatError naming it, raised at once
    (a folder whose size happened to match used to give IsADirectoryError; a FIFO of the
    expected size 0 would block the read)."""
    make, read = READERS[kind]
    root = tmp_path / kind
    make(root)
    victim = root / part
    REPLACEMENTS[replacement](victim)
    read_all = (
        (lambda: Checkpoint(root).read_table("ebc", "t"))
        if kind == "checkpoint"
        else (lambda: read(root))
    )
    assert _raises_at_once(read_all).path == victim
