"""The one-screen summary ``demb train`` prints at the end of a run."""

from __future__ import annotations

from typing import Any

from demb_torchrec.train.config import Settings
from demb_torchrec.train.loop import RunSummary
from demb_torchrec.train.report import read_records

__all__ = ["print_summary"]


def _eval(e: dict[str, float]) -> str:
    return f"AUC {e['auc']:.4f}, log loss {e['logloss']:.4f}" if e else "none"


def print_summary(summary: RunSummary, settings: Settings) -> None:
    """Print what the run did: steps and speed, eval quality first and last, the tables, the
    replica, the files written."""
    root = summary.output
    records = read_records(root / "train.jsonl")
    last: dict[str, Any] = records[-1] if records else {}
    tables = last.get("tables", {})
    size = sum(t["size"] for t in tables.values())
    capacity = sum(t["capacity"] for t in tables.values())
    evictions = sum(r["tables"][n]["evictions"] for r in records for n in r.get("tables", {}))
    inserts = sum(r["tables"][n]["inserts"] for r in records for n in r.get("tables", {}))
    admitted, rejected = (
        sum(r["tables"][n].get(k, 0) for r in records for n in r.get("tables", {}))
        for k in ("admitted", "rejected")
    )
    batch = int(settings["data"]["batch_size"])
    source = settings["data"]["path"] or "synthetic click stream"
    print()
    print(f"demb train: {summary.steps} steps of {batch} samples from {source}")
    print(f"  time            {summary.seconds:.1f} s this process")
    if "train" in last:
        print(f"  last interval   {last['train']['samples_per_s']:,.0f} samples/s")
    print(f"  eval first      {_eval(summary.first_eval)}")
    print(f"  eval last       {_eval(summary.last_eval)}")
    print(f"  tables          {len(tables)} dynamic, {size:,} keys in {capacity:,} slots")
    print(f"  inserts         {inserts:,} keys inserted, {evictions:,} evicted (whole run)")
    if admitted or rejected:
        print(f"  admission       {admitted:,} missing keys admitted, {rejected:,} rejected")
    hits, below, new, backs = (
        sum(r["tables"][n].get(k, 0) for r in records for n in r.get("tables", {}))
        for k in ("cache_hits", "storage_hits", "cache_misses", "write_backs")
    )
    if hits or below or new:
        stored = sum(t.get("stored", 0) for t in tables.values())
        looked = hits + below + new
        print(
            f"  caches          {hits / looked:.1%} of keys found in the device caches, "
            f"{below:,} read from the storage, {backs:,} rows written back; "
            f"{stored:,} keys below the caches"
        )
    replica = root / "replica.jsonl"
    if replica.exists():
        seen = [r for r in read_records(replica) if "auc" in r.get("replica", {})]
        if seen:
            r = seen[-1]
            print(f"  replica         AUC {r['replica']['auc']:.4f} at step {r['step']}")
    deltas = sorted((root / "deltas").glob("*.delta"))
    ckpts = sorted((root / "ckpt").glob("*.tables"))
    print(f"  output          {root}/")
    print(f"    train.jsonl   {summary.records} records")
    if settings["output"]["tensorboard"]:
        print("    tensorboard/  tensorboard --logdir " + str(root / "tensorboard"))
    for p in summary.plots:
        print(f"    plots/        {p.name}")
    print(f"    deltas/       {len(deltas)} deltas;  ckpt/ {len(ckpts)} checkpoints")
