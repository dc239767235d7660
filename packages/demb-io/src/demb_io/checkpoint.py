"""A whole checkpoint: a directory with a folder per embedding collection and, per table and
rank, the files of :mod:`demb_io.shard`. Written into a temporary directory and committed
atomically; readable whatever the world size that wrote it.
"""

from __future__ import annotations

import glob
import shutil
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

import numpy as np
import numpy.typing as npt

from demb_io._errors import FormatError, IoError
from demb_io._staging import staging_path
from demb_io.manifest import Manifest, commit_with_manifest, open_tree
from demb_io.meta import CHECKPOINT_FORMAT, FORMAT_VERSION, ShardMeta, read_meta
from demb_io.shard import ShardData, ShardWriter, check_meta_sizes, iter_shard, read_shard

__all__ = ["Checkpoint", "CheckpointWriter", "commit_checkpoint"]

_MARKER = f"{CHECKPOINT_FORMAT} {FORMAT_VERSION}"


def commit_checkpoint(staged: Path, target: Path) -> None:
    """Commit the complete staging directory ``staged`` (collection folders of shards, each
    meta written) to ``target``: its manifest written (the data files' sizes and CRC-32s taken
    from their metas), then its marker, then one rename or exchange
    (:func:`demb_io.manifest.commit_with_manifest`)."""
    commit_with_manifest(staged, target, _MARKER, lambda meta: read_meta(meta).files.values())


class CheckpointWriter:
    """Writes a checkpoint into ``<path>.tmp-<id>`` and commits it to ``path`` on a clean exit
    (:func:`commit_directory`); on an exception the temporary directory is removed and ``path``
    is untouched.

    Example:
        >>> with CheckpointWriter(path) as ckpt:  # doctest: +SKIP
        ...     ckpt.write_shard(meta, chunks)
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.staged = staging_path(self.path)
        self.written: list[ShardMeta] = []
        self._open = False
        self._opened: set[str] = set()
        self._shards: list[ShardWriter] = []

    def __enter__(self) -> CheckpointWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.staged.mkdir()
        self._open = True
        return self

    def open_shard(self, meta: ShardMeta) -> ShardWriter:
        """A writer for one table's shard (one rank's rows) in the collection
        ``meta.collection``; several may be open at once. Close each (``close()``) before the
        with-block ends.

        Raises:
            IoError: outside a ``with`` block, or the shard was opened already.
            ValueError: a collection name that is not a plain folder name.
        """
        if not self._open:
            raise IoError(f"{self.path}: a shard written outside the writer's with-block")
        if not meta.collection or "/" in meta.collection or meta.collection.startswith("."):
            raise ValueError(f"collection {meta.collection!r}: must be a plain folder name")
        folder = self.staged / meta.collection
        folder.mkdir(exist_ok=True)
        name = f"{meta.collection}/{meta.stem}"
        if name in self._opened:
            raise IoError(f"{self.path}: {name} written twice")
        self._opened.add(name)
        shard = ShardWriter(folder, meta)
        self._shards.append(shard)
        return shard

    def write_shard(self, meta: ShardMeta, chunks: Iterable[ShardData]) -> ShardMeta:
        """Write one table's shard from ``chunks`` (see :meth:`open_shard`; with
        ``meta.slot_layout``, every chunk carries ``slots``).

        Raises:
            IoError: outside a ``with`` block, or the shard was written already.
            ValueError: chunks that do not match ``meta`` (see :class:`demb_io.ShardWriter`).
        """
        written = self.open_shard(meta).write_all(chunks)
        self.written.append(written)
        return written

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._open = False
        unclosed = [s.meta.stem for s in self._shards if not s.closed]
        if kind is not None or unclosed:
            for shard in self._shards:  # no descriptor left open in the dropped staging
                shard.abort()
            shutil.rmtree(self.staged, ignore_errors=True)
            if kind is None:
                raise IoError(f"{self.path}: shards not closed, nothing written: {unclosed}")
            return
        try:
            commit_checkpoint(self.staged, self.path)
        except BaseException:
            shutil.rmtree(self.staged, ignore_errors=True)
            raise


class Checkpoint:
    """A committed checkpoint, opened for reading.

    Raises:
        FormatError: ``path`` is not a committed checkpoint (no marker, or another format).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.manifest: Manifest = open_tree(self.path, _MARKER, "checkpoint")

    def collections(self) -> list[str]:
        """The embedding collections, sorted."""
        return sorted(p.name for p in self.path.iterdir() if p.is_dir())

    def shards(self, collection: str, table: str | None = None) -> list[ShardMeta]:
        """The shards of a collection (of one table), sorted by table then rank; each table's
        ranks must be ``0 .. W-1`` of one world size and one layout.

        Raises:
            FormatError: a bad meta, a missing or repeated rank, or ranks that disagree.
        """
        folder = self.path / collection
        if not folder.is_dir():
            raise FormatError(folder, "", "no such collection in the checkpoint")
        pattern = "*.meta.json" if table is None else f"{glob.escape(table)}.rank*-of-*.meta.json"
        metas = [self._read_meta(p) for p in sorted(folder.glob(pattern))]
        if table is not None:
            metas = [m for m in metas if m.table == table]  # a name may hold ".rank"
            if not metas:
                raise FormatError(folder, "", f"no table {table!r} in the collection")
        metas.sort(key=lambda m: (m.table, m.rank))
        for name in sorted({m.table for m in metas}):
            _check_ranks(folder, [m for m in metas if m.table == name])
        return metas

    def _read_meta(self, path: Path) -> ShardMeta:
        meta = self.manifest.read_meta(path, read_meta)
        if meta.collection != path.parent.name:
            raise FormatError(path, "collection", f"differs from its folder {path.parent.name!r}")
        if path.name != f"{meta.stem}.meta.json":  # a meta moved or swapped with another's
            raise FormatError(path, "table", f"{meta.stem!r} is not the shard its file names")
        self.manifest.check_files(path, meta.files)
        check_meta_sizes(path, meta)
        return meta

    def tables(self, collection: str) -> list[str]:
        """The tables of a collection, sorted."""
        return sorted({m.table for m in self.shards(collection)})

    def read_table(
        self,
        collection: str,
        table: str,
        *,
        verify: bool = True,
        expect_dtype: str | None = None,
        expect_dim: int | None = None,
    ) -> ShardData:
        """All of a table's rows, every rank's shard concatenated in rank order
        (``expect_dtype`` / ``expect_dim``: see :func:`demb_io.iter_shard`).

        ``slots`` are returned only for a table of one shard that has them: a slot is local to
        its rank's table, so the slots of several ranks, concatenated, would not say which
        table each one is of (None then: read them per rank, with :meth:`iter_table` or
        :func:`demb_io.read_shard`, beside each shard's ``slot_layout``).
        """
        folder = self.path / collection
        parts = [
            read_shard(folder, m, verify=verify, expect_dtype=expect_dtype, expect_dim=expect_dim)
            for m in self.shards(collection, table)
        ]
        return _concat(parts, slots=len(parts) == 1)

    def iter_table(
        self,
        collection: str,
        table: str,
        chunk_rows: int = 1 << 20,
        *,
        verify: bool = True,
        reuse: bool = False,
    ) -> Iterable[tuple[ShardMeta, ShardData]]:
        """A table's rows in bounded chunks, rank by rank, with the meta of each chunk's
        shard (``reuse``: see :func:`demb_io.iter_shard`)."""
        folder = self.path / collection
        for meta in self.shards(collection, table):
            for chunk in iter_shard(folder, meta, chunk_rows, verify=verify, reuse=reuse):
                yield meta, chunk


_LAYOUT = (
    "world_size",
    "dist_type",
    "embedding_dtype",
    "score_strategy",
    "optimizer",
    "optim_state_dtype",
    "state_width",
)


def _check_ranks(folder: Path, metas: list[ShardMeta]) -> None:
    first = metas[0]
    for m in metas:
        for name in _LAYOUT:
            if getattr(m, name) != getattr(first, name):
                raise FormatError(
                    folder / f"{m.stem}.meta.json",
                    name,
                    f"{getattr(m, name)!r} differs from rank {first.rank}'s "
                    f"{getattr(first, name)!r}",
                )
        if not first.legacy and m.embedding_dim != first.embedding_dim:
            raise FormatError(folder / f"{m.stem}.meta.json", "embedding_dim", "differs by rank")
    ranks = [m.rank for m in metas]
    if len(ranks) != first.world_size or ranks != list(range(len(ranks))):  # sized by files
        raise FormatError(
            folder,
            "rank",
            f"table {first.table!r} has ranks {ranks}; world_size {first.world_size} needs all",
        )


def _concat(parts: list[ShardData], *, slots: bool) -> ShardData:
    """``parts``' rows (and admission counters) concatenated in order; an optional array only
    when every part has it (``slots``: only if asked for, i.e. all parts are of one table)."""

    def cat(name: str) -> npt.NDArray[np.generic] | None:
        arrays = [getattr(p, name) for p in parts]
        if any(a is None for a in arrays):
            return None
        return np.concatenate(arrays)

    return ShardData(
        np.concatenate([p.keys for p in parts]),
        np.concatenate([p.values for p in parts]),
        np.concatenate([p.scores for p in parts]),
        cat("state"),
        cat("admit_keys"),  # type: ignore[arg-type]
        cat("admit_counts"),  # type: ignore[arg-type]
        cat("slots") if slots else None,  # type: ignore[arg-type]
    )
