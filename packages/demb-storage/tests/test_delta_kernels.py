"""The CPU kernels of the online-delta paths (demb_kernels.delta_ops) against the tensor-op
paths CUDA runs, both on the CPU: an incremental export's scan, and a replay's checks and writes
of keys at given slots (random tables, keys already held at other slots, slots taken over)."""

from __future__ import annotations

import pytest
import torch
from demb_kernels import delta_ops
from demb_planner import home_slots
from demb_storage import ScoredHashTable, ScoreStrategy, TableConfig
from demb_storage._export import _scan_ops
from demb_storage.slot_writes import batch_checks, write_ops
from hypothesis import given, settings
from hypothesis import strategies as st

S = ScoreStrategy
# (capacity, bucket width) of the tables a case draws from
SHAPES = [(64, 16), (128, 32), (64, 16), (256, 128)]


class Clock:
    """A fake device clock: 100, 200, 300, ... one tick per batch (two tables filled alike
    hold the same scores)."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> torch.Tensor:
        self.now += 100
        return torch.tensor([self.now])


def _filled(strategies: list[S], keys: list[int], seed: int) -> ScoredHashTable:
    configs = [
        TableConfig(dim=2, score_strategy=s, max_capacity=c, bucket_capacity=w)
        for s, (c, w) in zip(strategies, SHAPES, strict=False)
    ]
    table = ScoredHashTable(configs, clock=Clock())
    g = torch.Generator().manual_seed(seed)
    for start in range(0, len(keys), 40):  # several batches: scores differ
        batch = torch.tensor(keys[start : start + 40], dtype=torch.int64)
        table.find_or_insert(batch, torch.randint(0, len(configs), batch.shape, generator=g))
    return table


@settings(max_examples=40, deadline=None)
@given(
    strategies=st.lists(
        st.sampled_from([S.TIMESTAMP, S.LFU, S.STEP, (S.TIMESTAMP, S.LFU)]), min_size=1, max_size=4
    ),
    keys=st.lists(st.integers(-(2**40), 2**40).filter(lambda k: k != -1), max_size=300),
    picks=st.lists(st.tuples(st.integers(0, 3), st.integers(-1, 8)), min_size=1, max_size=5),
    word=st.integers(0, 1),
)
def test_export_scan_is_the_tensor_op_scan(strategies, keys, picks, word):
    """Slots, keys, score words and per-table counts of tables scanned in any order (a table
    twice, thresholds or none) equal the tensor-op scan's, table by table."""
    table = _filled(strategies, keys, len(keys))
    index = table.index
    word = min(word, index.score_words - 1)
    words = tuple(range(index.score_words))
    ids = [t % len(strategies) for t, _ in picks]
    limits = [None if th < 0 else th for _, th in picks]
    slots, found_keys, found_words, counts = delta_ops.export_scan(index, ids, limits, word, words)
    assert sum(counts) == slots.numel() == found_keys.numel() == found_words.shape[0]
    start = 0
    for j, (t, limit) in enumerate(zip(ids, limits, strict=True)):
        keys_j, words_j, parts = _scan_ops(index, words, word, [t], [limit])
        ((a, b, local),) = parts
        end = start + counts[j]
        assert slots[start:end].tolist() == local.tolist()
        assert found_keys[start:end].tolist() == keys_j[a:b].tolist()
        assert found_words[start:end].tolist() == words_j[a:b].tolist()
        start = end


def _writes(table: ScoredHashTable, keys: list[int], gen: torch.Generator):
    """Per table, distinct keys each at a distinct slot of its home bucket (drawn at random:
    some where the key already is, some elsewhere, some over another key)."""
    ids, ks, ss = [], [], []
    for t in range(table.num_tables):
        capacity, width = table.capacity(t), table.index.bucket_width_list[t]
        used: set[int] = set()
        for k in dict.fromkeys(keys):
            if int(torch.randint(0, 3, (1,), generator=gen)) == 0:
                continue
            home = int(home_slots([k], capacity, width).bucket[0]) * width
            offset = int(torch.randint(0, width, (1,), generator=gen))
            for step in range(width):
                slot = home + (offset + step) % width
                if slot not in used:
                    used.add(slot)
                    ids.append(t)
                    ks.append(k)
                    ss.append(slot)
                    break
    as_tensor = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return as_tensor(ids), as_tensor(ks), as_tensor(ss)


@settings(max_examples=40, deadline=None)
@given(
    strategies=st.lists(
        st.sampled_from([S.TIMESTAMP, (S.TIMESTAMP, S.LFU)]), min_size=1, max_size=4
    ),
    held=st.lists(st.integers(0, 400), max_size=200),
    written=st.lists(st.integers(0, 400), max_size=120),
    seed=st.integers(0, 2**16),
)
def test_slot_writes_kernel_is_the_tensor_op_writes(strategies, held, written, seed):
    """Checks pass alike, and the kernel's writes leave the index (keys, digests, score words,
    sizes) and report the taken-over slots exactly as the tensor-op writes do."""
    kernel, reference = _filled(strategies, held, seed), _filled(strategies, held, seed)
    gen = torch.Generator().manual_seed(seed)
    ids, keys, slots = _writes(kernel, written, gen)
    words = torch.randint(0, 2**40, (kernel.index.score_words, keys.numel()), generator=gen)
    digests, flags = delta_ops.slot_writes_check(kernel.index, keys, ids, slots)
    want_digests, want_flags = batch_checks(reference.index, keys, ids, slots)
    assert flags == want_flags == [False] * 5
    assert torch.equal(digests, want_digests)
    taken = delta_ops.slot_writes_apply(kernel.index, keys, ids, slots, digests, words)
    lo = reference.index.slot_offsets[ids]
    want = write_ops(reference.index, ids, keys, slots, lo, want_digests, words)
    assert torch.equal(taken, want)
    for name in ("keys", "digests", "scores", "sizes"):
        assert torch.equal(getattr(kernel.index, name), getattr(reference.index, name)), name


@pytest.mark.parametrize(
    "fault", ["empty key", "repeated key", "outside", "repeated slot", "other bucket"]
)
def test_slot_writes_check_flags_what_the_tensor_op_check_flags(fault):
    """Each fault raises its own flag in both checks (keys small enough that no two (key,
    table) pairs mix alike in the tensor-op check), and nothing is written."""
    table = _filled([S.TIMESTAMP, S.TIMESTAMP], list(range(30)), 0)
    before = table.index.keys.clone()
    ids, keys, slots = _writes(table, list(range(100, 140)), torch.Generator().manual_seed(1))
    width = table.index.bucket_width_list[int(ids[0])]
    capacity = table.capacity(int(ids[0]))
    if fault == "empty key":
        keys[0] = -1
    elif fault == "repeated key":  # the same key at another slot of its table
        keys[1], ids[1] = keys[0], ids[0]
        slots[1] = slots[0] - slots[0] % width + (slots[0] + 1) % width
    elif fault == "outside":
        slots[0] = capacity
    elif fault == "repeated slot":
        ids[1], slots[1] = ids[0], slots[0]
    else:
        slots[0] = (slots[0] + width) % capacity
    _, flags = delta_ops.slot_writes_check(table.index, keys, ids, slots)
    _, want = batch_checks(table.index, keys, ids, slots)
    position = ["empty key", "repeated key", "outside", "repeated slot", "other bucket"]
    assert flags[position.index(fault)]
    assert flags == want
    assert torch.equal(table.index.keys, before)


def test_slot_writes_apply_rejects_slots_outside_their_table():
    table = _filled([S.TIMESTAMP], [1, 2, 3], 0)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="outside its table's 64 slots"):
        delta_ops.slot_writes_apply(
            table.index, one, one * 0, one * 64, torch.ones(1, dtype=torch.uint8), one[None]
        )
