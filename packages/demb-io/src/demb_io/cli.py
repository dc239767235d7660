"""demb-io: inspect, verify, merge, apply, reshard and export checkpoints and deltas.

Every subcommand reads its inputs validated (sizes, CRC-32s) and writes its output atomically;
a bad input ends with a one-line error naming the file and the field (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from demb_io._errors import FormatError, IoError
from demb_io._small import MARKER_BYTES, read_small
from demb_io.checkpoint import Checkpoint
from demb_io.delta import read_delta
from demb_io.export import export_npz, export_parquet
from demb_io.tools import apply_delta, merge_delta_files, reshard

__all__ = ["main"]


def _is_delta(path: Path) -> bool:
    try:
        return read_small(path / "FORMAT", MARKER_BYTES).startswith(b"demb-delta")
    except FormatError:
        return False


def _inspect(args: argparse.Namespace) -> None:
    path = Path(args.path)
    if _is_delta(path):
        print(f"delta {path}")
        print(f"{'collection/table':32s} {'rows':>10s} {'erased':>8s} {'evicted':>8s} dtype x dim")
        for t in read_delta(path, verify=False):
            d = t.meta
            evicted = "-" if d.evicted_rows is None else str(d.evicted_rows)
            name = f"{d.collection}/{d.table}"
            print(
                f"{name:32s} {d.rows:>10d} {d.erased_rows:>8d} {evicted:>8s} "
                f"{d.embedding_dtype} x {d.embedding_dim}"
            )
        return
    ckpt = Checkpoint(path)
    print(f"checkpoint {path}")
    print(f"{'collection/table':32s} {'ranks':>5s} {'rows':>12s} dtype x dim  state  scores")
    for collection in ckpt.collections():
        for table in ckpt.tables(collection):
            shards = ckpt.shards(collection, table)
            m = shards[0]
            rows = sum(s.rows for s in shards)
            state = f"{m.state_width}" if m.state_width else "-"
            print(
                f"{collection + '/' + table:32s} {m.world_size:>5d} {rows:>12d} "
                f"{m.embedding_dtype} x {m.embedding_dim}  {state:>5s}  "
                f"{'+'.join(m.score_strategy)} ({m.dist_type})"
            )


def _verify(args: argparse.Namespace) -> None:
    path = Path(args.path)
    if _is_delta(path):
        tables = read_delta(path, verify=True)
        print(f"ok: delta {path}, {len(tables)} tables, checksums and sizes agree")
        return
    ckpt = Checkpoint(path)
    count = 0
    for collection in ckpt.collections():
        for table in ckpt.tables(collection):
            for _ in ckpt.iter_table(collection, table, verify=True):
                pass
            count += 1
    print(f"ok: checkpoint {path}, {count} tables, checksums and sizes agree")


def _merge(args: argparse.Namespace) -> None:
    merged = merge_delta_files(args.deltas, args.out)
    print(f"wrote {args.out}: {len(merged)} tables from {len(args.deltas)} deltas")


def _apply(args: argparse.Namespace) -> None:
    apply_delta(args.checkpoint, read_delta(args.delta), args.out)
    print(f"wrote {args.out}")


def _reshard(args: argparse.Namespace) -> None:
    reshard(
        args.checkpoint,
        args.out,
        args.world_size,
        args.dist_type,
        num_embeddings=args.num_embeddings,
    )
    print(f"wrote {args.out}: world_size {args.world_size}, {args.dist_type}")


def _export(args: argparse.Namespace) -> None:
    export = export_parquet if args.format == "parquet" else export_npz
    export(args.checkpoint, args.collection, args.table, args.out, float32=not args.raw)
    print(f"wrote {args.out}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="demb-io", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="a summary table of a checkpoint or delta")
    p.add_argument("path")
    p.set_defaults(run=_inspect)
    p = sub.add_parser("verify", help="check every file's size and CRC-32")
    p.add_argument("path")
    p.set_defaults(run=_verify)
    p = sub.add_parser("merge", help="merge deltas, oldest first (later rows win)")
    p.add_argument("out")
    p.add_argument("deltas", nargs="+")
    p.set_defaults(run=_merge)
    p = sub.add_parser("apply", help="apply a delta to a checkpoint, writing a new checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("delta")
    p.add_argument("out")
    p.set_defaults(run=_apply)
    p = sub.add_parser("reshard", help="re-shard a checkpoint to another world size / dist type")
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument(
        "--dist-type", required=True, choices=["continuous", "roundrobin", "hash_roundrobin"]
    )
    p.add_argument("--num-embeddings", type=int, default=None)
    p.set_defaults(run=_reshard)
    p = sub.add_parser("export", help="export a table to .npz (or parquet)")
    p.add_argument("checkpoint")
    p.add_argument("collection")
    p.add_argument("table")
    p.add_argument("out")
    p.add_argument("--raw", action="store_true", help="values as stored (bf16 as uint16 words)")
    p.add_argument(
        "--format", choices=["npz", "parquet"], default="npz", help="parquet needs pyarrow"
    )
    p.set_defaults(run=_export)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (2: a bad input, named on stderr)."""
    args = _parser().parse_args(argv)
    try:
        args.run(args)
    except (IoError, ValueError, OSError, ImportError) as err:
        print(f"demb-io {args.command}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
