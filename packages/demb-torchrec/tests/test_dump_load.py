"""DynamicEmbDump / DynamicEmbLoad in one process (no torch.distributed): a model's
DynamicEmbeddingTables, trained, dumped and loaded into a fresh model of other capacities hold
the same keys, rows, scores and (with ``optim=True``) optimizer state; the checkpoint is demb-io's
format; every bad case raises naming what is wrong and leaves the target untouched."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from demb_io import Checkpoint, FormatError
from demb_torchrec import (
    DynamicEmbDump,
    DynamicEmbeddingTables,
    DynamicEmbLoad,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)
from torch import nn


def _module(
    capacity: int = 1024,
    dtype: torch.dtype = torch.float32,
    score: object = DynamicEmbScoreStrategy.LFU,
    optimizer: str = "adam",
    dims: tuple[int, int] = (8, 4),
    device: str = "cpu",
) -> DynamicEmbeddingTables:
    opts = [
        DynamicEmbTableOptions(
            dim=d, max_capacity=capacity, embedding_dtype=dtype, score_strategy=score
        )
        for d in dims
    ]
    return DynamicEmbeddingTables(
        opts,
        table_names=["user", "item"],
        pooling_mode=DynamicEmbPoolingMode.SUM,
        device=device,
        optimizer=optimizer,
        learning_rate=0.05,
    )


class Model(nn.Module):
    def __init__(self, **kwargs: object) -> None:
        super().__init__()
        self.sparse = nn.ModuleDict({"tables": _module(**kwargs)})  # type: ignore[arg-type]


def _train(model: Model, steps: int = 4) -> None:
    gen = torch.Generator().manual_seed(3)
    tables = model.sparse["tables"]
    for _ in range(steps):
        lengths = torch.randint(0, 4, (2 * 5,), generator=gen)
        keys = torch.randint(0, 300, (int(lengths.sum()),), generator=gen) * 7919
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        tables(keys.to(tables.device), offsets.to(tables.device)).square().sum().backward()


def _content(model: Model) -> dict[str, dict[int, tuple[list[float], list[int]]]]:
    """Per table, key -> (row incl. optimizer state, scores)."""
    tables = model.sparse["tables"]
    out = {}
    for t, name in enumerate(tables.table_names):
        ex = tables.tables.export(t)
        out[name] = {
            k: (v, s)
            for k, v, s in zip(
                ex.keys.tolist(),
                ex.values.float().tolist(),
                ex.scores.tolist(),
                strict=True,
            )
        }
    return out


def _rows_only(content, dims=(8, 4)):
    return {
        n: {k: (v[:d], s) for k, (v, s) in c.items()}
        for (n, c), d in zip(content.items(), dims, strict=True)
    }


def test_dump_then_load_restores_every_key(tmp_path: Path) -> None:
    src = Model()
    _train(src)
    path = tmp_path / "ckpt"
    DynamicEmbDump(path, src, optim=True)
    ckpt = Checkpoint(path)
    assert ckpt.collections() == ["sparse.tables"]
    assert ckpt.tables("sparse.tables") == ["item", "user"]
    meta = ckpt.shards("sparse.tables", "user")[0]
    assert (meta.world_size, meta.rank, meta.embedding_dim, meta.state_width) == (1, 0, 8, 16)
    assert meta.score_strategy == ("LFU",)
    assert meta.optimizer == "adam"

    dst = Model(capacity=4096)  # another capacity: other slots, same content
    DynamicEmbLoad(path, dst, optim=True)
    want = _content(src)
    assert want["user"]  # trained
    assert _content(dst) == want


def test_load_without_optim_gives_new_keys_the_initial_state(tmp_path: Path) -> None:
    src = Model()
    _train(src)
    DynamicEmbDump(tmp_path / "c", src)  # no state written
    meta = Checkpoint(tmp_path / "c").shards("sparse.tables", "user")[0]
    assert meta.state_width == 0
    dst = Model()
    DynamicEmbLoad(tmp_path / "c", dst)
    assert _rows_only(_content(dst)) == _rows_only(_content(src))
    for _, (row, _) in _content(dst)["user"].items():
        assert row[8:] == [0.0] * 16  # Adam's initial moments
    with pytest.raises(ValueError, match="no optimizer state"):
        DynamicEmbLoad(tmp_path / "c", Model(), optim=True)


def test_table_names_select_and_unknown_names_raise(tmp_path: Path) -> None:
    src = Model()
    _train(src)
    DynamicEmbDump(tmp_path / "c", src, table_names={"sparse.tables": ["item"]})
    assert Checkpoint(tmp_path / "c").tables("sparse.tables") == ["item"]
    dst = Model()
    DynamicEmbLoad(tmp_path / "c", dst, table_names=["item"])
    assert _rows_only(_content(dst))["item"] == _rows_only(_content(src))["item"]
    assert _content(dst)["user"] == {}
    with pytest.raises(ValueError, match=r"table_names.*nope"):
        DynamicEmbDump(tmp_path / "d", src, table_names={"sparse.tables": ["nope"]})
    assert not (tmp_path / "d").exists()
    with pytest.raises(FormatError, match="no table 'user'"):
        DynamicEmbLoad(tmp_path / "c", Model())  # the checkpoint lacks 'user'


def test_precision_converted_with_a_warning_and_dim_mismatch_raises(tmp_path: Path) -> None:
    src = Model()
    _train(src)
    DynamicEmbDump(tmp_path / "c", src)
    meta = json.loads(next((tmp_path / "c" / "sparse.tables").glob("user.*.meta.json")).read_text())
    assert meta["embedding_dtype"] == "float32"
    half = Model(dtype=torch.float16)
    with pytest.warns(UserWarning, match="float32"):
        DynamicEmbLoad(tmp_path / "c", half)
    want = _rows_only(_content(src))["user"]
    got = _rows_only(_content(half))["user"]
    assert got.keys() == want.keys()
    for k, (row, score) in want.items():
        assert got[k][1] == score
        torch.testing.assert_close(
            torch.tensor(got[k][0]), torch.tensor(row).half().float(), rtol=0, atol=0
        )
    with pytest.raises(FormatError, match="embedding_dim"):
        DynamicEmbLoad(tmp_path / "c", Model(dims=(16, 4)))


def test_other_score_order_or_optimizer_raises_before_writing(tmp_path: Path) -> None:
    src = Model()
    _train(src)
    DynamicEmbDump(tmp_path / "c", src, optim=True)
    timed = Model(score=DynamicEmbScoreStrategy.TIMESTAMP)
    with pytest.raises(ValueError, match="score_strategy"):
        DynamicEmbLoad(tmp_path / "c", timed)
    sgd = Model(optimizer="adagrad")
    with pytest.raises(ValueError, match=r"'adam'.*'adagrad'"):
        DynamicEmbLoad(tmp_path / "c", sgd, optim=True)
    assert _content(timed)["user"] == {}
    assert _content(sgd)["user"] == {}


def test_compound_score_columns_round_trip(tmp_path: Path) -> None:
    order = (DynamicEmbScoreStrategy.LFU, DynamicEmbScoreStrategy.TIMESTAMP)
    src = Model(score=order)
    _train(src)
    DynamicEmbDump(tmp_path / "c", src)
    assert Checkpoint(tmp_path / "c").shards("sparse.tables", "user")[0].score_strategy == (
        "LFU",
        "TIMESTAMP",
    )
    dst = Model(score=order)
    DynamicEmbLoad(tmp_path / "c", dst)
    assert _rows_only(_content(dst)) == _rows_only(_content(src))
    frequencies = [s[0] for _, s in _content(src)["user"].values()]
    assert max(frequencies) > 1  # the LFU column is first, as configured


def test_tables_of_different_score_columns_round_trip(tmp_path: Path) -> None:
    """A module whose tables score one and two columns (its index keeps two words for all):
    each table loads back its own columns (the load used to size the score words by the
    loading table, and the index refused them)."""

    def model() -> Model:
        m = Model()
        scores = [
            (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU),
            DynamicEmbScoreStrategy.LFU,
        ]
        opts = [
            DynamicEmbTableOptions(dim=d, max_capacity=1024, score_strategy=score)
            for d, score in zip((8, 4), scores, strict=True)
        ]
        m.sparse["tables"] = DynamicEmbeddingTables(
            opts, table_names=["user", "item"], device="cpu", optimizer="adam"
        )
        return m

    src = model()
    _train(src)
    DynamicEmbDump(tmp_path / "c", src, optim=True)
    dst = model()
    DynamicEmbLoad(tmp_path / "c", dst, optim=True)
    assert _content(dst) == _content(src)
    assert {len(s) for _, s in _content(src)["user"].values()} == {2}
    assert {len(s) for _, s in _content(src)["item"].values()} == {1}


def test_truncated_file_raises_and_a_failed_dump_keeps_the_old_checkpoint(
    tmp_path: Path,
) -> None:
    src = Model()
    _train(src)
    path = tmp_path / "c"
    DynamicEmbDump(path, src)
    values = next((path / "sparse.tables").glob("user.*.values"))
    data = values.read_bytes()
    values.write_bytes(data[:-4])
    with pytest.raises(FormatError, match="values"):
        DynamicEmbLoad(path, Model())
    values.write_bytes(data)
    DynamicEmbLoad(path, Model())  # whole again

    class Broken(Model):
        pass

    broken = Broken()
    _train(broken)
    broken.sparse["tables"].tables.export = None  # type: ignore[assignment]
    with pytest.raises(RuntimeError, match="DynamicEmbDump"):
        DynamicEmbDump(path, broken)
    DynamicEmbLoad(path, Model())  # the previous checkpoint, intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]  # no staging left behind


def test_warnings_free_round_trip_at_the_same_precision(tmp_path: Path) -> None:
    src = Model(dtype=torch.bfloat16)
    _train(src)
    DynamicEmbDump(tmp_path / "c", src, optim=True)
    dst = Model(dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DynamicEmbLoad(tmp_path / "c", dst, optim=True)
    assert _content(dst) == _content(src)


@pytest.mark.cuda
def test_gpu_tables_round_trip_through_the_cpu_and_back(tmp_path: Path) -> None:
    src = Model(device="cuda")
    _train(src)
    DynamicEmbDump(tmp_path / "gpu", src, optim=True)
    on_cpu = Model()
    DynamicEmbLoad(tmp_path / "gpu", on_cpu, optim=True)
    want = _content(src)
    assert want["user"]
    assert _content(on_cpu) == want
    DynamicEmbDump(tmp_path / "cpu", on_cpu, optim=True)
    back = Model(device="cuda", capacity=2048)
    DynamicEmbLoad(tmp_path / "cpu", back, optim=True)
    assert _content(back) == want


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_corrupt_last_shard_leaves_the_model_unchanged(tmp_path: Path, damage: str) -> None:
    """The first table loads whole, then the last one's values file fails its CRC (or size):
    DynamicEmbLoad raises and every table holds the keys, rows and scores it held before
    (the first table's inserted and overwritten rows are undone)."""
    src = Model()
    _train(src, steps=6)
    path = tmp_path / "c"
    DynamicEmbDump(path, src, optim=True)
    values = next((path / "sparse.tables").glob("item.*.values"))  # item loads after user
    data = bytearray(values.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
    else:
        data = data[: len(data) - 8]
    values.write_bytes(bytes(data))

    dst = Model()
    _train(dst, steps=2)  # some of src's keys, other rows and scores
    before = _content(dst)
    assert before["user"]
    assert before["item"]
    with pytest.raises(FormatError, match="item"):
        DynamicEmbLoad(path, dst, optim=True)
    assert _content(dst) == before
    empty = Model()
    with pytest.raises(FormatError):
        DynamicEmbLoad(path, empty, optim=True)
    assert _content(empty) == {"user": {}, "item": {}}
