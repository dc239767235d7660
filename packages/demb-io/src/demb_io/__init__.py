"""demb-io: the on-disk checkpoint and delta formats of dynamic embedding tables, their writers
and validated readers, and offline tools (merge, apply, reshard, export; CLI ``demb-io``).
numpy and demb-planner only, no torch import. See ``docs/format.md``.

A checkpoint is a directory: a folder per embedding collection; per table and rank, files of
keys, values (in the table's ``embedding_dtype``), optional optimizer state, scores and optional
admission counters, and a meta JSON with their sizes and CRC-32s.
"""

from demb_io._errors import FormatError, IoError, LayoutError
from demb_io._staging import MARKER, commit_directory, staging_path
from demb_io.checkpoint import Checkpoint, CheckpointWriter, commit_checkpoint
from demb_io.delta import (
    DELTA_FORMAT,
    DeltaMeta,
    DeltaTable,
    DeltaWriter,
    iter_delta,
    read_delta,
    write_delta,
)
from demb_io.dtypes import DTYPES, from_float32, itemsize, storage_dtype, to_float32
from demb_io.export import export_npz, export_parquet
from demb_io.manifest import MANIFEST, Manifest
from demb_io.meta import (
    CHECKPOINT_FORMAT,
    FORMAT_VERSION,
    PARTS,
    FileEntry,
    ShardMeta,
    read_meta,
    shard_stem,
)
from demb_io.shard import ShardData, ShardWriter, iter_shard, read_shard, write_shard
from demb_io.tools import apply_delta, merge_delta_files, merge_deltas, reshard

__all__ = [
    "CHECKPOINT_FORMAT",
    "DELTA_FORMAT",
    "DTYPES",
    "FORMAT_VERSION",
    "MANIFEST",
    "MARKER",
    "PARTS",
    "Checkpoint",
    "CheckpointWriter",
    "DeltaMeta",
    "DeltaTable",
    "DeltaWriter",
    "FileEntry",
    "FormatError",
    "IoError",
    "LayoutError",
    "Manifest",
    "ShardData",
    "ShardMeta",
    "ShardWriter",
    "apply_delta",
    "commit_checkpoint",
    "commit_directory",
    "export_npz",
    "export_parquet",
    "from_float32",
    "itemsize",
    "iter_delta",
    "iter_shard",
    "merge_delta_files",
    "merge_deltas",
    "read_delta",
    "read_meta",
    "read_shard",
    "reshard",
    "shard_stem",
    "staging_path",
    "storage_dtype",
    "to_float32",
    "write_delta",
    "write_shard",
]
