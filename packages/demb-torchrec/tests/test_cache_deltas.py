"""Incremental deltas of caching tables: a delta holds the rows of both tiers touched since the
threshold (cache rows with their cache slot, storage rows with slot -1); a replay into a
caching replica writes them by key into its storage, so the union of the replica's tiers
converges to the source's; on disk they merge and apply like any delta."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _online_common import checkpoint_content
from demb_io.cli import main as demb_io
from demb_torchrec import (
    DynamicEmbDump,
    DynamicEmbeddingTables,
    DynamicEmbLoad,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EvictedItemMode,
    ReplayContent,
    erase_keys,
    get_score,
    incremental_dump,
    replay_increment,
)
from demb_torchrec.delta_files import write_delta_dump

S = DynamicEmbScoreStrategy
DIM = 4
CAPACITY = 4096
KEYS = 1500
NAMES = ["user", "item"]
ROW = (DIM + 2 * DIM) * 4  # Adam's rows, float32


def _module(
    caching: bool = True, strategy: Any = S.STEP, retain: bool = False
) -> DynamicEmbeddingTables:
    options = [
        DynamicEmbTableOptions(
            dim=DIM,
            max_capacity=CAPACITY,
            init_capacity=CAPACITY,
            score_strategy=strategy,
            caching=caching,
            local_hbm_for_values=(256 if caching else CAPACITY) * ROW,
            evicted_item_mode=EvictedItemMode.RETAIN_KEY if retain else EvictedItemMode.DISCARD,
        )
        for _ in NAMES
    ]
    return DynamicEmbeddingTables(
        options, table_names=NAMES, pooling_mode=DynamicEmbPoolingMode.NONE, device="cpu",
        optimizer="adam", learning_rate=0.05,
    )  # fmt: skip


def _window(m: DynamicEmbeddingTables, gen: torch.Generator, steps: int = 2) -> list[set[int]]:
    """Train ``steps`` batches (more keys than the 256-row caches hold); the keys of each
    table trained."""
    touched: list[set[int]] = [set() for _ in NAMES]
    for _ in range(steps):
        indices = torch.randint(0, KEYS, (2 * 300,), generator=gen)
        out = m(indices, torch.arange(indices.numel() + 1))
        out.backward(torch.randn(out.shape, generator=gen))
        for t in range(len(NAMES)):
            touched[t] |= set(indices[t * 300 : (t + 1) * 300].tolist())
    return touched


def _union(m: DynamicEmbeddingTables, t: int) -> tuple[torch.Tensor, ...]:
    """Table ``t``'s keys, rows and score columns over both tiers, by key."""
    assert m.cache is not None
    ex = m.cache.export(t)
    order = torch.argsort(ex.keys)
    return ex.keys[order], ex.values[order], ex.scores[order]


def _assert_same_union(a: DynamicEmbeddingTables, b: DynamicEmbeddingTables, scores: bool) -> None:
    for t in range(len(NAMES)):
        x, y = _union(a, t), _union(b, t)
        assert torch.equal(x[0], y[0]), f"table {t}: key sets differ"
        assert torch.equal(x[1], y[1]), f"table {t}: rows differ"
        if scores:
            assert torch.equal(x[2], y[2]), f"table {t}: scores differ"


@pytest.mark.parametrize("strategy", [S.STEP, S.TIMESTAMP, (S.TIMESTAMP, S.LFU)])
def test_a_caching_replica_replaying_each_window_holds_the_source_rows(strategy: Any):
    a, b = _module(strategy=strategy), _module(strategy=strategy)
    gen = torch.Generator().manual_seed(3)
    for w in range(4):
        threshold = get_score(a)
        touched = _window(a, gen)
        if w == 2:  # an erase in both tiers travels as erased keys
            gone = _union(a, 0)[0][::7][:40]
            assert int(erase_keys(a, {"model": {"user": gone}})["model"]["user"]) == 40
            touched[0] -= set(gone.tolist())
        deltas = incremental_dump(a, threshold)
        d = deltas["model"]
        for t in range(len(NAMES)):
            assert set(d.keys[t].tolist()) == touched[t], f"window {w} table {t}"
            slots = d.meta[t]["slot_index"]
            assert bool((slots == -1).any())  # rows of both tiers
            assert bool((slots >= 0).any())
            assert d.meta[t]["row_capacity"] == (256, CAPACITY)
        stats = replay_increment(b, deltas)
        assert stats["model"]["user"].upserted == len(touched[0])
        assert b.tables.size(0) == 0  # the replica's cache fills from its own lookups
        _assert_same_union(a, b, scores=True)
    ids = torch.arange(KEYS)  # and it serves the same rows
    a.eval()
    b.eval()
    offsets = torch.arange(2 * KEYS + 1)
    assert torch.equal(a(ids.repeat(2), offsets), b(ids.repeat(2), offsets))


def test_embeddings_only_keep_the_replica_state_or_start_it_fresh():
    a, b = _module(), _module()
    gen = torch.Generator().manual_seed(4)
    _window(a, gen)
    replay_increment(b, incremental_dump(a, 0))  # b holds a's rows, state included
    threshold = get_score(a)
    touched = _window(a, gen)
    replay_increment(b, incremental_dump(a, threshold), ReplayContent.EMBEDDING_ONLY)
    for t in range(len(NAMES)):
        keys, rows_a, _ = _union(a, t)
        _, rows_b, _ = _union(b, t)
        assert torch.equal(rows_a[:, :DIM], rows_b[:, :DIM])  # every embedding
        old = torch.tensor([k not in touched[t] for k in keys.tolist()])
        assert torch.equal(rows_a[old], rows_b[old])  # untouched rows keep their state


def test_a_caching_delta_into_an_all_device_table_is_refused_untouched():
    a, device_only = _module(), _module(caching=False)
    gen = torch.Generator().manual_seed(5)
    _window(a, gen)
    _window(device_only, gen)
    before = device_only.tables.export(0)
    with pytest.raises(ValueError, match=r"model/user: current_capacity: the delta has 256, "):
        replay_increment(device_only, incremental_dump(a, 0))
    after = device_only.tables.export(0)
    assert torch.equal(before.keys, after.keys)
    assert torch.equal(before.values, after.values)


def test_a_bad_caching_delta_is_refused_before_any_table_is_written():
    a, b = _module(), _module()
    gen = torch.Generator().manual_seed(7)
    _window(a, gen)
    replay_increment(b, incremental_dump(a, 0))
    threshold = get_score(a)
    _window(a, gen)
    deltas = incremental_dump(a, threshold)
    d = deltas["model"]
    d.keys[1] = d.keys[1].clone()
    d.keys[1][1] = d.keys[1][0]  # the second table's delta repeats a key
    before = [_union(b, t) for t in range(len(NAMES))]
    with pytest.raises(ValueError, match=r"model/item: keys: a key is repeated"):
        replay_increment(b, deltas)
    for t in range(len(NAMES)):  # the first table was not written either
        for x, y in zip(before[t], _union(b, t), strict=True):
            assert torch.equal(x, y)


def test_delta_files_of_a_caching_table_merge_and_apply_to_a_full_dump(tmp_path: Path):
    a = _module(strategy=S.TIMESTAMP, retain=True)
    gen = torch.Generator().manual_seed(6)
    _window(a, gen)
    DynamicEmbDump(str(tmp_path / "full0"), a, optim=True)
    paths = []
    for w in range(3):
        threshold = get_score(a)
        _window(a, gen)
        path = tmp_path / f"delta{w}"
        write_delta_dump(path, incremental_dump(a, threshold))
        paths.append(str(path))
    DynamicEmbDump(str(tmp_path / "full1"), a, optim=True)
    assert demb_io(["merge", str(tmp_path / "merged"), *paths]) == 0
    assert demb_io(["verify", str(tmp_path / "merged")]) == 0
    applied = tmp_path / "applied"
    assert demb_io(["apply", str(tmp_path / "full0"), str(tmp_path / "merged"), str(applied)]) == 0
    want = checkpoint_content(tmp_path / "full1", "model")
    assert all(len(want[n]) > 500 for n in NAMES)
    assert checkpoint_content(applied, "model") == want
    loaded = _module(strategy=S.TIMESTAMP, retain=True)
    DynamicEmbLoad(str(applied), loaded, optim=True)
    _assert_same_union(a, loaded, scores=True)
