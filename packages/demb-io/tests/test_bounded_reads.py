"""The readers read a checkpoint's or a delta's small files (``FORMAT``, the meta JSONs) only
when they are regular files of a bounded size: a FIFO, a device, a folder or a huge file in
their place is a FormatError naming the file, raised at once (never a hang or MemoryError)."""

from __future__ import annotations

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
