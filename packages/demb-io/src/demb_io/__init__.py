"""demb-io: the on-disk checkpoint format of dynamic embedding tables, its writer and validated
readers (numpy only, no torch import). See ``FORMAT.md``.

A checkpoint is a directory: a folder per embedding collection; per table and rank, files of
keys, values (in the table's ``embedding_dtype``), optional optimizer state, scores and optional
admission counters, and a meta JSON with their sizes and CRC-32s.
"""

from demb_io._errors import FormatError, IoError
from demb_io.checkpoint import MARKER, Checkpoint, CheckpointWriter, commit_directory
from demb_io.dtypes import DTYPES, from_float32, itemsize, storage_dtype, to_float32
from demb_io.meta import (
    CHECKPOINT_FORMAT,
    FORMAT_VERSION,
    PARTS,
    FileEntry,
    ShardMeta,
    read_meta,
    shard_stem,
)
from demb_io.shard import ShardData, iter_shard, read_shard, write_shard

__all__ = [
    "CHECKPOINT_FORMAT",
    "DTYPES",
    "FORMAT_VERSION",
    "MARKER",
    "PARTS",
    "Checkpoint",
    "CheckpointWriter",
    "FileEntry",
    "FormatError",
    "IoError",
    "ShardData",
    "ShardMeta",
    "commit_directory",
    "from_float32",
    "itemsize",
    "iter_shard",
    "read_meta",
    "read_shard",
    "shard_stem",
    "storage_dtype",
    "to_float32",
    "write_shard",
]
