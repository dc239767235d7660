"""Small demb-io files and seeded random mutations of them: what ``demb bench fuzz`` and
demb-io's robustness tests read back to check that a damaged checkpoint or delta ends in a
typed error (or reads back the same rows), never in anything else.

:func:`small_checkpoint` and :func:`small_delta` write one table, a few rows of every kind of
array; :func:`fuzz_checkpoint` two collections of two tables, and :func:`fuzz_delta` a delta
(or the next one) of two of its tables. :func:`mutate` damages one file: a meta edited as JSON,
or the bytes truncated, extended or flipped. :func:`mutate_tree` damages a tree in one of the
:data:`TREE_KINDS` ways: a file's bytes or JSON (numbers made huge, negative or not finite), a
file or folder deleted, swapped, renamed or added, a file replaced by a FIFO, a folder or a
symlink. Nothing is undone: mutate a fresh copy of the undamaged tree.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from demb_io.checkpoint import CheckpointWriter
from demb_io.delta import DeltaMeta, DeltaTable, write_delta
from demb_io.meta import ShardMeta
from demb_io.shard import ShardData

__all__ = [
    "FUZZ_COLLECTIONS",
    "FUZZ_TABLES",
    "JSON_NUMBERS",
    "JSON_VALUES",
    "TREE_KINDS",
    "Mutation",
    "fuzz_checkpoint",
    "fuzz_delta",
    "mutate",
    "mutate_bytes",
    "mutate_json",
    "mutate_json_tree",
    "mutate_numbers",
    "mutate_tree",
    "small_checkpoint",
    "small_delta",
]

JSON_VALUES: tuple[Any, ...] = (
    None, True, 0, -1, 1, 2**70, 1.5, "", "x", "float16", [], ["LFU"], [1, 2], {},
)  # fmt: skip
"""The values :func:`mutate_json` sets a field to: wrong types, sizes and names."""

JSON_NUMBERS: tuple[int | float, ...] = (
    2**31 - 1, 2**31, 2**32, 2**40, 2**53 + 1, 2**62 + 1, 2**63 - 1, 2**63, 2**64, -1, -2,
    -(2**31), -(2**63), -(2**63) - 1, 1e308, -1e308, float("nan"), float("inf"), float("-inf"),
    0.5,
)  # fmt: skip
"""The values :func:`mutate_numbers` sets a number to (NaN and the infinities are written as
the bare JSON tokens ``NaN``, ``Infinity``, ``-Infinity``)."""


def small_checkpoint(path: Path) -> None:
    """Write a checkpoint at ``path``: collection ``ebc``, table ``t`` on two ranks
    (``hash_roundrobin``), 4 and 5 bfloat16 rows of dim 3 with two scores, adagrad state of
    width 3 and admission counters."""
    rng = np.random.default_rng(0)
    with CheckpointWriter(path) as w:
        for rank in range(2):
            meta = ShardMeta(
                collection="ebc",
                table="t",
                rank=rank,
                world_size=2,
                dist_type="hash_roundrobin",
                embedding_dtype="bfloat16",
                embedding_dim=3,
                rows=0,
                score_strategy=("TIMESTAMP", "LFU"),
                optimizer="adagrad",
                optim_state_dtype="float32",
                state_width=3,
                admission_rows=0,
            )
            n = 4 + rank
            w.write_shard(
                meta,
                [
                    ShardData(
                        np.arange(n, dtype=np.int64) * 2 + rank,
                        rng.integers(0, 2**16, (n, 3), dtype=np.uint16),
                        rng.integers(0, 99, (n, 2), dtype=np.int64),
                        rng.standard_normal((n, 3)).astype(np.float32),
                        np.array([7, 8], dtype=np.int64),
                        np.array([1, 2], dtype=np.int64),
                    )
                ],
            )


def small_delta(path: Path) -> None:
    """Write a delta at ``path``: table ``t`` of collection ``ebc``, 5 float16 rows of dim 2
    with their slots, one score, float16 state of width 1, an erased key and two evicted
    ones."""
    rng = np.random.default_rng(1)
    meta = DeltaMeta(
        collection="ebc",
        table="t",
        embedding_dtype="float16",
        embedding_dim=2,
        score_strategy=("TIMESTAMP",),
        current_score=99,
        current_capacity=256,
        row_capacity=(256,),
        bucket_capacity=128,
        world_size=2,
        dist_type="roundrobin",
        optim_state_dtype="float16",
        state_width=1,
        evicted_rows=0,
    )
    write_delta(
        path,
        [
            DeltaTable(
                meta,
                np.arange(5, dtype=np.int64),
                rng.standard_normal((5, 2)).astype(np.float16),
                np.arange(5, dtype=np.int64)[:, None],
                np.arange(5, dtype=np.int64),
                rng.standard_normal((5, 1)).astype(np.float16),
                np.array([9], dtype=np.int64),
                np.array([11, 12], dtype=np.int64),
            )
        ],
    )


FUZZ_TABLES: dict[str, tuple[str, int, tuple[str, ...], dict[str, Any]]] = {
    "t": ("bfloat16", 3, ("TIMESTAMP", "LFU"), {"num_embeddings": 1000, "admission_rows": 0}),
    "u": ("float32", 2, ("LFU", "TIMESTAMP"), {}),
}
"""The tables of :func:`fuzz_checkpoint` (in both collections): embedding dtype, dim, score
columns and other meta fields; both hold adagrad state (float32, one word per dim)."""
FUZZ_COLLECTIONS: dict[str, tuple[int, str]] = {
    "ebc": (2, "hash_roundrobin"),
    "ec": (1, "roundrobin"),
}
"""The collections of :func:`fuzz_checkpoint`: world size and dist type of their tables."""


def _layout(collection: str, table: str) -> dict[str, Any]:
    """The meta fields a fuzz table has in the checkpoint and in the deltas alike."""
    dtype, dim, scores, _ = FUZZ_TABLES[table]
    world_size, dist_type = FUZZ_COLLECTIONS[collection]
    return {
        "collection": collection, "table": table, "world_size": world_size,
        "dist_type": dist_type, "embedding_dtype": dtype, "embedding_dim": dim,
        "score_strategy": scores, "optim_state_dtype": "float32", "state_width": dim,
    }  # fmt: skip


def _values(rng: np.random.Generator, dtype: str, n: int, dim: int) -> np.ndarray[Any, Any]:
    values = rng.standard_normal((n, dim)).astype(np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" else values


def fuzz_checkpoint(path: Path, seed: int = 0) -> None:
    """Write a checkpoint at ``path``: collections ``ebc`` (tables on two ranks,
    ``hash_roundrobin``) and ``ec`` (one rank), each with the tables :data:`FUZZ_TABLES`
    (``t``: 3 + rank bfloat16 rows of dim 3, TIMESTAMP and LFU scores, admission counters;
    ``u``: 2 + rank float32 rows of dim 2, LFU and TIMESTAMP), adagrad state and
    hyper-parameters. Another ``seed``: other rows, keys shifted by ``seed`` (some shared)."""
    rng = np.random.default_rng(seed)
    with CheckpointWriter(path) as w:
        for collection, (world_size, _) in FUZZ_COLLECTIONS.items():
            for table, (dtype, dim, scores, extra) in FUZZ_TABLES.items():
                for rank in range(world_size):
                    n = (3 if table == "t" else 2) + rank
                    meta = ShardMeta(
                        **_layout(collection, table),
                        rank=rank,
                        rows=0,
                        optimizer="adagrad",
                        hyper_parameters={"learning_rate": 0.05, "eps": 1e-8},
                        **extra,
                    )
                    admission = "admission_rows" in extra
                    chunk = ShardData(
                        np.arange(n, dtype=np.int64) * world_size + rank + 1 + seed,
                        _values(rng, dtype, n, dim),
                        rng.integers(0, 99, (n, len(scores)), dtype=np.int64),
                        rng.standard_normal((n, dim)).astype(np.float32),
                        np.array([70 + rank, 80], dtype=np.int64) if admission else None,
                        np.array([1, 2 + rank], dtype=np.int64) if admission else None,
                    )
                    w.write_shard(meta, [chunk])


def fuzz_delta(path: Path, later: bool = False) -> None:
    """Write a delta at ``path`` that applies to :func:`fuzz_checkpoint`'s: tables ``ebc/t``
    (with evicted keys) and ``ec/u``, each updating two of the checkpoint's keys, adding new
    ones and erasing one; ``later``: the next delta of the same tables (a later
    ``current_score``, other rows, some keys of the first)."""
    rng = np.random.default_rng(2 if later else 1)
    tables = []
    for collection, table in (("ebc", "t"), ("ec", "u")):
        dtype, dim, scores, _ = FUZZ_TABLES[table]
        keys = np.array([1, 2, 50, 51] if later else [1, 3, 40], dtype=np.int64)
        n = keys.size
        meta = DeltaMeta(
            **_layout(collection, table),
            current_score=120 if later else 99,
            current_capacity=128,
            row_capacity=(128,),
            bucket_capacity=128,
            evicted_rows=0 if table == "t" else None,
            table_options={"max_capacity": 128, "init_capacity": 128, "lr": 0.05},
        )
        evicted = np.array([90, 91 + later], dtype=np.int64) if table == "t" else None
        tables.append(
            DeltaTable(
                meta,
                keys,
                _values(rng, dtype, n, dim),
                rng.integers(0, 50, (n, len(scores)), dtype=np.int64),
                np.arange(n, dtype=np.int64) + 7,
                rng.standard_normal((n, dim)).astype(np.float32),
                np.array([3 if later else 2], dtype=np.int64),
                evicted,
            )
        )
    write_delta(path, tables)


def mutate_json(text: str, rnd: random.Random) -> bytes:
    """``text`` (a meta's JSON) with one field, of the top level or of one entry of its
    ``files``, deleted (30%) or set to one of :data:`JSON_VALUES`."""
    d = json.loads(text)
    target = d
    if rnd.random() < 0.3:
        target = d["files"][rnd.choice(sorted(d["files"]))]
    key = rnd.choice(sorted(target))
    if rnd.random() < 0.3:
        del target[key]
    else:
        target[key] = rnd.choice(JSON_VALUES)
    return json.dumps(d).encode()


def _nodes(node: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:  # noqa: ANN401
    """Every value under ``node`` (parsed JSON) with its path of keys and indices, ``node``
    itself first."""
    found = [(path, node)]
    if isinstance(node, dict | list):
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            found += _nodes(value, (*path, key))
    return found


_DELETE = object()


def _edit_json(text: str, rnd: random.Random, numbers: bool) -> tuple[bytes, str]:
    """:func:`mutate_json_tree` (``numbers``: :func:`mutate_numbers`) and what it did."""
    try:
        doc = json.loads(text)
    except ValueError:
        return mutate_bytes(text.encode(), rnd), "not JSON: bytes"
    nodes = [
        p
        for p, v in _nodes(doc)
        if p and (not numbers or (isinstance(v, int | float) and not isinstance(v, bool)))
    ]
    if numbers and not nodes:
        return _edit_json(text, rnd, False)
    path = rnd.choice(nodes or [()])
    value: object
    if numbers:
        value = rnd.choice(JSON_NUMBERS)
    else:
        value = _DELETE if path and rnd.random() < 0.3 else rnd.choice(JSON_VALUES)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    if not path:
        doc = value
    elif value is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    where = ".".join(str(k) for k in path)
    done = f"{where} deleted" if value is _DELETE else f"{where} = {json.dumps(value)}"
    return json.dumps(doc, indent=1, sort_keys=True).encode(), done


def mutate_json_tree(text: str, rnd: random.Random) -> bytes:
    """``text`` (any JSON document) with one value at any depth deleted (30%) or set to one of
    :data:`JSON_VALUES`; not JSON: :func:`mutate_bytes` of it."""
    return _edit_json(text, rnd, False)[0]


def mutate_numbers(text: str, rnd: random.Random) -> bytes:
    """``text`` (JSON) with one number at any depth (a size, CRC-32, count, hyper-parameter or
    table option) set to one of :data:`JSON_NUMBERS` (no number: :func:`mutate_json_tree`)."""
    return _edit_json(text, rnd, True)[0]


def mutate_bytes(blob: bytes, rnd: random.Random) -> bytes:
    """``blob`` truncated, extended by 1-8 random bytes, with one bit flipped, or with 2-5
    bytes changed (a quarter each); an empty ``blob`` becomes one zero byte."""
    kind = rnd.randrange(4)
    if kind == 0 or not blob:  # truncate
        return blob[: rnd.randrange(len(blob) + 1)] if blob else b"\x00"
    if kind == 1:  # append
        return blob + bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 9)))
    data = bytearray(blob)
    for _ in range(1 if kind == 2 else rnd.randrange(2, 6)):  # flip one or several bytes
        i = rnd.randrange(len(data))
        data[i] ^= 1 << rnd.randrange(8) if kind == 2 else rnd.randrange(1, 256)
    return bytes(data)


def mutate(victim: Path, blob: bytes, rnd: random.Random) -> bytes:
    """A mutation of ``blob``, the bytes of the file ``victim``: a meta (``*.meta.json``) is
    edited as JSON half the time (:func:`mutate_json`), any file otherwise damaged as bytes
    (:func:`mutate_bytes`)."""
    if victim.name.endswith(".meta.json") and rnd.random() < 0.5:
        return mutate_json(blob.decode(), rnd)
    return mutate_bytes(blob, rnd)


@dataclass(frozen=True)
class Mutation:
    """What :func:`mutate_tree` did: its ``kind`` (of :data:`TREE_KINDS`), the ``path`` it
    damaged (relative to the root), a ``detail`` (a new name, a link, a JSON edit), and whether
    the tree now ``leaves`` its root (a symlink out): a reader must refuse it."""

    kind: str
    path: str
    detail: str = ""
    leaves: bool = False


TREE_KINDS: dict[str, int] = {
    "bytes": 24, "json": 8, "json_number": 10, "delete_file": 6, "delete_folder": 3,
    "swap_files": 6, "rename_file": 6, "rename_folder": 3, "fifo": 3, "file_to_folder": 2,
    "dev_zero": 2, "symlink_outside": 4, "symlink_inside": 3, "extra_file": 4,
    "extra_folder": 3,
}  # fmt: skip
"""The mutations :func:`mutate_tree` picks from, with their weights."""

_PARTS: tuple[str, ...] = ("meta.json", "keys", "values", "state", "scores", "admit_keys")
_PARTS += ("admit_counts", "slots", "erased", "evicted")
_RANK = re.compile(r"\.rank(\d+)-of-(\d+)\.")


def _renamed(name: str, siblings: list[str], rnd: random.Random) -> str:
    """Another name for the file ``name``: a sibling's (replacing it), another table's, part's,
    rank's or world size's, or the name with a suffix."""
    stem, _, rest = name.partition(".")
    part = next((p for p in _PARTS if name.endswith("." + p)), "")
    tables = {s.partition(".")[0] for s in siblings} - {stem}
    groups = [
        [s for s in siblings if s != name],
        [f"{t}.{rest}" for t in sorted(tables)] or [f"{stem}x.{rest}"],
        [name.removesuffix(part) + p for p in _PARTS if part and p != part],
        [name + ".orig", name + "~", "." + name],
    ]
    if ranked := _RANK.search(name):
        r, w = int(ranked[1]), int(ranked[2])
        pairs = [(r + 1, w), (r, w + 1), (w, w), (0, 1), (r, 0)]
        groups.append([_RANK.sub(f".rank{a}-of-{b}.", name, count=1) for a, b in pairs])
    new = rnd.choice(rnd.choice([g for g in groups if g]))
    return new if new != name else name + ".orig"


def _tree(root: Path) -> tuple[list[Path], list[Path]]:
    """The files and the folders under ``root`` (not ``root``), sorted."""
    files: list[Path] = []
    folders: list[Path] = []
    for p in sorted(root.rglob("*")):
        (folders if p.is_dir() and not p.is_symlink() else files).append(p)
    return files, folders


def _related(victim: Path, files: list[Path], rnd: random.Random) -> Path:
    """A file to swap with ``victim``: the same part of another rank or table, another meta
    (half the time, where there is one), else any other file."""
    part = next((p for p in _PARTS if victim.name.endswith("." + p)), None)
    alike = [f for f in files if f != victim and part and f.name.endswith("." + part)]
    others = [f for f in files if f != victim]
    return rnd.choice(alike if alike and rnd.random() < 0.5 else others or [victim])


def mutate_tree(root: Path, rnd: random.Random, outside: Path) -> Mutation:
    """Damage the tree at ``root`` in one of the :data:`TREE_KINDS` ways (weighted) and say
    how; a symlink out of the tree points into ``outside`` (made when needed). Not undone."""
    kind = rnd.choices(list(TREE_KINDS), weights=list(TREE_KINDS.values()))[0]
    files, folders = _tree(root)
    jsons = [f for f in files if f.name.endswith(".json")]
    if kind.startswith("json") and not jsons:
        kind = "bytes"
    if kind.endswith("folder") and kind != "file_to_folder" and not folders:
        kind = "delete_file"
    victim = rnd.choice(jsons if kind.startswith("json") else files)
    rel = victim.relative_to(root).as_posix()
    detail = ""
    if kind in ("bytes", "json", "json_number"):
        blob = victim.read_bytes()
        if kind == "bytes":
            new = mutate_bytes(blob, rnd)
            detail = f"{len(blob)} -> {len(new)} bytes"
        else:
            new, detail = _edit_json(blob.decode(errors="replace"), rnd, kind == "json_number")
        victim.write_bytes(new)
    elif kind == "delete_file":
        victim.unlink()
    elif kind == "delete_folder":
        folder = rnd.choice(folders)
        rel = folder.relative_to(root).as_posix()
        shutil.rmtree(folder)
    elif kind == "swap_files":
        other = _related(victim, files, rnd)
        a, b = victim.read_bytes(), other.read_bytes()
        victim.write_bytes(b)
        other.write_bytes(a)
        detail = other.relative_to(root).as_posix()
    elif kind == "rename_file":
        siblings = sorted(p.name for p in victim.parent.iterdir() if not p.is_dir())
        new_name = _renamed(victim.name, siblings, rnd)
        os.replace(victim, victim.with_name(new_name))  # over a sibling of that name
        detail = new_name
    elif kind == "rename_folder":
        folder = rnd.choice(folders)
        rel = folder.relative_to(root).as_posix()
        others = [f for f in folders if f.parent == folder.parent and f != folder]
        if others and rnd.random() < 0.5:
            other, swap = rnd.choice(others), folder.with_name(folder.name + ".swap")
            os.rename(folder, swap)
            os.rename(other, folder)
            os.rename(swap, other)
            detail = f"swapped with {other.name}"
        else:
            new_name = rnd.choice([folder.name + "x", folder.name.upper(), "." + folder.name])
            os.rename(folder, folder.with_name(new_name))
            detail = new_name
    elif kind == "fifo":
        victim.unlink()
        os.mkfifo(victim)
    elif kind == "file_to_folder":
        victim.unlink()
        victim.mkdir()
    elif kind == "dev_zero":
        victim.unlink()
        victim.symlink_to("/dev/zero")
    elif kind == "symlink_outside":
        if folders and rnd.random() < 0.3:  # a whole folder
            victim = rnd.choice(folders)
            rel = victim.relative_to(root).as_posix()
        outside.mkdir(parents=True, exist_ok=True)
        copy = outside / f"{len(list(outside.iterdir()))}-{victim.name}"
        shutil.move(victim, copy)
        victim.symlink_to(copy.absolute(), target_is_directory=copy.is_dir())
        return Mutation(kind, rel, str(copy), leaves=True)
    elif kind == "symlink_inside":
        if rnd.random() < 0.5:  # to a copy of its bytes inside the tree
            other = victim.with_name(victim.name + ".copy")
            shutil.copyfile(victim, other)
        else:
            other = _related(victim, files, rnd)
        victim.unlink()
        victim.symlink_to(os.path.relpath(other, victim.parent))
        detail = other.relative_to(root).as_posix()
    elif kind == "extra_file":
        siblings = sorted(p.name for p in victim.parent.iterdir())
        extra = victim.with_name(_renamed(victim.name, siblings, rnd))
        if extra.exists() or rnd.random() < 0.3:
            extra = victim.with_name(rnd.choice(["README", "x.bin", ".hidden", "x.meta.json"]))
            extra.write_bytes(bytes(rnd.randrange(256) for _ in range(rnd.randrange(9))))
        else:
            shutil.copyfile(victim, extra)
        rel = extra.relative_to(root).as_posix()
    else:  # extra_folder: empty, a copy of a collection, or named like a file
        parent = rnd.choice([root, *folders])
        how = rnd.randrange(3)
        if how == 1 and folders:
            source = rnd.choice(folders)
            extra = source.with_name(source.name + "2")
            shutil.copytree(source, extra, symlinks=True)
        else:
            names = ["zz", "x.rank0-of-1.meta.json", "x.meta.json", "FORMAT.d"]
            extra = parent / (rnd.choice(names) if how == 2 else "new_folder")
            extra.mkdir(exist_ok=True)
        rel = extra.relative_to(root).as_posix()
    return Mutation(kind, rel, detail)
