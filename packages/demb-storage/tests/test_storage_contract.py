"""The Storage contract, checked the same way on every implementation: ``PyDictStorage`` (the
tests' dict demo), ``DynamicEmbeddingTable`` (a ScoredHashTable on the CPU) and
``RocksDBStorage`` (in tmp directories), each against a plain Python dict model."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path

import pytest
import torch
from demb_storage import (
    DynamicEmbeddingTable,
    InsertedEntries,
    RocksDBStorage,
    RowLayout,
    ScoreStrategy,
    Storage,
    StorageBatchError,
    StorageClosedError,
    TableConfig,
    TableConfigError,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _load_dict_storage():
    path = Path(__file__).with_name("_dict_storage.py")
    spec = importlib.util.spec_from_file_location("_demb_storage_dict_storage", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PyDictStorage


PyDictStorage = _load_dict_storage()
HAS_ROCKSDICT = importlib.util.find_spec("rocksdict") is not None
NEEDS_ROCKSDICT = pytest.mark.skipif(not HAS_ROCKSDICT, reason="rocksdict (extra 'ssd') missing")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NAMES = ["user", "item", "ads"]
KEYS = [-(2**63), 2**63 - 1, -2, 0, 1, 2, 3, 5, 8, 13, 21, 34, 2**40 + 7]
"""Keys the random checks draw from: extremes, negatives, small ones (-1 is reserved: it is a
hash table's empty key)."""
_dirs = itertools.count()


def layouts(dtype=torch.float32):
    """Tables 0 and 1 share a row layout (6 x dtype); table 2's rows differ (3 x float32)."""
    return [RowLayout(4, 2, dtype), RowLayout(4, 2, dtype), RowLayout(3)]


def make_dict(lays, score_words, tmp, **kw):
    return PyDictStorage(lays, score_words=score_words, names=NAMES[: len(lays)], **kw)


def make_device(lays, score_words, tmp, *, capacity=None):
    strategy = ScoreStrategy.TIMESTAMP if score_words == 1 else (S_TS, S_LFU)
    caps = (
        {"max_capacity": 1024, "init_capacity": 128, "bucket_capacity": 128}
        if capacity is None
        else {"max_capacity": capacity, "bucket_capacity": 16}
    )
    configs = [
        TableConfig(
            dim=lay.dim, state_dim=lay.state_dim, dtype=lay.dtype, score_strategy=strategy, **caps
        )
        for lay in lays
    ]
    return DynamicEmbeddingTable.create(configs, names=NAMES[: len(lays)])


def make_rocksdb(lays, score_words, tmp):
    path = tmp / f"db{next(_dirs)}"
    return RocksDBStorage(path, lays, score_words=score_words, names=NAMES[: len(lays)])


S_TS, S_LFU = ScoreStrategy.TIMESTAMP, ScoreStrategy.LFU
IMPLS = [
    pytest.param(make_dict, id="dict"),
    pytest.param(make_device, id="device"),
    pytest.param(make_rocksdb, id="rocksdb", marks=NEEDS_ROCKSDICT),
]


# --------------------------------------------------------------------------------- the model
class Model:
    """The reference: ``(table, key) -> (row, scores)`` in a dict."""

    def __init__(self, storage: Storage) -> None:
        self.storage = storage
        self.entries: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def insert(self, keys, table_ids, values, scores) -> InsertedEntries:
        before = set(self.entries)
        res = self.storage.insert(keys, table_ids, values, scores)
        ev = res.evicted
        tables = set(table_ids.tolist())
        for i, (t, k) in enumerate(zip(ev.table_ids.tolist(), ev.keys.tolist(), strict=True)):
            assert t in tables, "evicted an entry of a table not in the call"
            assert (t, k) not in set(zip(table_ids.tolist(), keys.tolist(), strict=True)), (
                "evicted a key of the call"
            )
            row, sc = self.entries.pop((t, k))
            assert torch.equal(ev.values[i], row)
            assert torch.equal(ev.scores[:, i], sc)
        dtype = res.evicted.values.dtype
        for i, (t, k) in enumerate(zip(table_ids.tolist(), keys.tolist(), strict=True)):
            assert bool(res.inserted[i]) == (bool(res.stored[i]) and (t, k) not in before)
            if res.stored[i]:
                self.entries[(t, k)] = (values[i].to(dtype), scores[:, i].clone())
        return res

    def erase(self, keys, table_ids) -> None:
        pairs = set(zip(table_ids.tolist(), keys.tolist(), strict=True))
        expected = len(pairs & set(self.entries))
        assert self.storage.erase(keys, table_ids) == expected
        for pair in pairs:
            self.entries.pop(pair, None)

    def check(self, tables=(0, 1), probe=KEYS) -> None:
        s = self.storage
        for t in tables:
            mine = {k: v for (tt, k), v in self.entries.items() if tt == t}
            assert s.size(t) == len(mine)
            ex = s.export(t)
            assert sorted(ex.keys.tolist()) == sorted(mine)
            for i, k in enumerate(ex.keys.tolist()):
                assert torch.equal(ex.values[i], mine[k][0])
                assert torch.equal(ex.scores[:, i], mine[k][1])
            keys = torch.tensor(probe, dtype=torch.int64)
            found = s.find(keys, t)
            for i, k in enumerate(probe):
                assert bool(found.found[i]) == (k in mine)
                if k in mine:
                    assert torch.equal(found.values[i], mine[k][0])
                    assert torch.equal(found.scores[:, i], mine[k][1])
                else:
                    assert not found.values[i].any()
                    assert not found.scores[:, i].any()


def batch(pairs, lay, score_words, seed):
    """Keys, table ids, random rows and scores of ``[(table, key), ...]``."""
    gen = torch.Generator().manual_seed(seed)
    n = len(pairs)
    ids = torch.tensor([t for t, _ in pairs], dtype=torch.int64)
    keys = torch.tensor([k for _, k in pairs], dtype=torch.int64)
    values = torch.randn((n, lay.width), generator=gen).to(lay.dtype)
    scores = torch.randint(0, 2**62, (score_words, n), generator=gen)
    return keys, ids, values, scores


# --------------------------------------------------------------------------------- random ops
PAIRS = st.lists(st.tuples(st.integers(0, 1), st.sampled_from(KEYS)), max_size=10)
OPS = st.lists(
    st.tuples(st.sampled_from(["insert", "erase"]), PAIRS, st.integers(0, 2**31)),
    min_size=1,
    max_size=6,
)


@pytest.mark.parametrize("make", IMPLS)
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=OPS, score_words=st.sampled_from([1, 2]), dtype=st.sampled_from(DTYPES))
def test_random_ops_match_a_dict(make, tmp_path, ops, score_words, dtype):
    lays = layouts(dtype)
    with make(lays, score_words, tmp_path) as storage:
        model = Model(storage)
        for op, drawn, seed in ops:
            pairs = list(dict.fromkeys(drawn))  # an insert's keys: unique per table
            if op == "insert":
                res = model.insert(*batch(pairs, lays[0], score_words, seed))
                assert res.stored.all()
                assert len(res.evicted) == 0
            else:
                keys, ids, _, _ = batch(pairs, lays[0], score_words, seed)
                model.erase(keys, ids)
        model.check()


BOUNDED = [
    pytest.param(lambda lays, w, tmp: make_dict(lays, w, tmp, capacity=4), id="dict"),
    pytest.param(lambda lays, w, tmp: make_device(lays, w, tmp, capacity=16), id="device"),
]


@pytest.mark.parametrize("make", BOUNDED)
@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    ops=st.lists(
        st.tuples(st.lists(st.integers(0, 40), unique=True, max_size=24), st.integers(0, 2**31)),
        min_size=1,
        max_size=5,
    )
)
def test_a_bounded_storage_reports_what_it_evicts(make, tmp_path, ops):
    lays = layouts()
    storage = make(lays, 1, tmp_path)
    model = Model(storage)
    for keys, seed in ops:
        model.insert(*batch([(0, k) for k in keys], lays[0], 1, seed))
    model.check(tables=(0,), probe=list(range(41)))


@settings(max_examples=20, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["insert", "erase", "find"]),
            st.lists(st.tuples(st.integers(0, 1), st.integers(0, 60)), unique=True, max_size=30),
            st.integers(0, 2**31),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_a_device_storage_told_its_batch_tables_does_what_it_does_untold(ops):
    """``tables=`` (a caller that checked its batch: no checks, no sync) changes nothing a
    call returns or leaves behind, evictions included (16-slot tables); ``locate`` and
    ``read_located`` return what ``find`` does."""
    lays = layouts()
    told, unt = (make_device(lays, 1, None, capacity=16) for _ in range(2))
    for op, pairs, seed in ops:
        keys, ids, values, scores = batch(pairs, lays[0], 1, seed)
        tables = sorted({t for t, _ in pairs})
        if op == "insert":
            a = told.insert(keys, ids, values, scores, tables=tables)
            b = unt.insert(keys, ids, values, scores)
            assert torch.equal(a.inserted, b.inserted)
            assert torch.equal(a.stored, b.stored)
            assert torch.equal(a.evicted.keys, b.evicted.keys)
            assert torch.equal(a.evicted.values, b.evicted.values)
        elif op == "erase":
            assert told.erase(keys, ids, tables=tables) == unt.erase(keys, ids)
        else:
            a, b = told.find(keys, ids, tables=tables), unt.find(keys, ids)
            assert torch.equal(a.found, b.found)
            assert torch.equal(a.values, b.values)
            assert torch.equal(a.scores, b.scores)
            located = told.locate(keys, ids, tables=tables)  # find in two parts
            assert torch.equal(located.found, b.found)
            assert torch.equal(located.scores, b.scores)
            assert torch.equal(located.slots >= 0, b.found)
            assert torch.equal(told.read_located(located), b.values)
    held = {id(t) for t in told.buffers()}  # what a reader on another stream holds
    assert all(id(v) in held for v in told.table.values)
    assert id(told.table.index.keys) in held
    for t in (0, 1):
        a, b = told.table.export(t), unt.table.export(t)
        assert torch.equal(a.keys, b.keys)
        assert torch.equal(a.slots, b.slots)
        assert torch.equal(told.table.read(t, a.slots), unt.table.read(t, b.slots))


def test_tables_told_to_a_device_storage_are_checked():
    storage = make_device(layouts(), 1, None)
    keys = torch.tensor([1, 2])
    with pytest.raises(StorageBatchError, match="out of range"):
        storage.find(keys, torch.tensor([0, 3]), tables=[0, 3])
    with pytest.raises(StorageBatchError, match="rows differ"):
        storage.find(keys, torch.tensor([0, 2]), tables=[0, 2])


# --------------------------------------------------------------------------------- behaviour
@pytest.mark.parametrize("make", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_round_trip_through_export_and_import(make, tmp_path, dtype):
    lays = layouts(dtype)
    with make(lays, 2, tmp_path) as a, make(lays, 2, tmp_path) as b:
        keys, _, values, scores = batch([(0, k) for k in range(20)], lays[0], 2, 0)
        res = a.insert(keys, 0, values, scores)
        assert res.inserted.all()
        assert res.stored.all()
        assert not res.overwritten.any()
        found = a.find(keys, 0)
        assert found.found.all()
        assert found.values.dtype == dtype
        assert torch.equal(found.values, values)
        assert torch.equal(found.scores, scores)
        chunks = list(a.export_chunks(0, chunk_rows=3))
        assert all(0 < len(c) <= 3 for c in chunks)
        assert sum(len(c) for c in chunks) == 20
        ex = a.export(0)
        b.import_(0, ex.keys, ex.values.float(), ex.scores)
        assert torch.equal(b.find(keys, 0).values, values)
        assert b.size(0) == 20
        assert b.size(1) == 0
        assert b.export(1).values.shape == (0, 6)


@pytest.mark.parametrize("make", IMPLS)
def test_tables_of_one_layout_share_a_call_and_keep_their_keys_apart(make, tmp_path):
    lays = layouts()
    with make(lays, 1, tmp_path) as s:
        keys = torch.tensor([7, 7, 9], dtype=torch.int64)
        ids = torch.tensor([0, 1, 1])
        values = torch.arange(18, dtype=torch.float32).reshape(3, 6)
        s.insert(keys, ids, values, torch.tensor([[1, 2, 3]]))
        found = s.find(torch.tensor([7, 7, 9, 9]), torch.tensor([1, 0, 0, 1]))
        assert found.found.tolist() == [True, True, False, True]
        assert torch.equal(found.values[[0, 1, 3]], values[[1, 0, 2]])
        assert found.scores.tolist() == [[2, 1, 0, 3]]
        again = s.insert(keys[:1], ids[:1], values[:1] + 1, torch.tensor([[5]]))
        assert again.overwritten.tolist() == [True]
        assert again.inserted.tolist() == [False]
        assert s.erase(torch.tensor([7, 7, 8]), 0) == 1
        assert s.size(0) == 0
        assert s.size(1) == 2
        lay2 = s.layout(2)
        s.insert(torch.tensor([7]), 2, torch.ones(1, lay2.width), torch.tensor([[4]]))
        assert s.find(torch.tensor([7]), 2).values.shape == (1, 3)
        empty = s.find(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
        assert empty.values.shape == (0, 0)
        assert empty.scores.shape == (1, 0)


@pytest.mark.parametrize("make", IMPLS)
def test_bad_batches_raise_typed_errors_naming_the_tables(make, tmp_path):
    with make(layouts(), 1, tmp_path) as s:
        k = torch.tensor([1, 2])
        row = torch.zeros(2, 6)
        sc = torch.zeros(1, 2, dtype=torch.int64)
        with pytest.raises(StorageBatchError, match="keys"):
            s.find(k.int(), 0)
        with pytest.raises(StorageBatchError, match="out of range"):
            s.find(k, torch.tensor([0, 3]))
        with pytest.raises(StorageBatchError, match="out of range"):
            s.find(k, 5)
        with pytest.raises(StorageBatchError, match=r"'?user.*ads|call once per table"):
            s.find(k, torch.tensor([0, 2]))
        with pytest.raises(StorageBatchError, match=r"values.*\(2, 6\).*user"):
            s.insert(k, 0, torch.zeros(2, 5), sc)
        with pytest.raises(StorageBatchError, match="scores"):
            s.insert(k, 0, row, torch.zeros(2, 2, dtype=torch.int64))
        with pytest.raises(StorageBatchError, match="scores"):
            s.insert(k, 0, row, sc.float())
        with pytest.raises(StorageBatchError, match="twice"):
            s.insert(torch.tensor([1, 1]), 0, row, sc)
        with pytest.raises(StorageBatchError, match="chunk_rows"):
            list(s.export_chunks(0, 0))
        with pytest.raises(StorageBatchError, match="out of range"):
            s.export(3)
        assert s.size(0) == 0
        s.insert(torch.tensor([1, 1]), torch.tensor([0, 1]), row, sc)  # two tables: fine
        assert s.size(0) == s.size(1) == 1


@pytest.mark.parametrize("make", IMPLS)
def test_construction_and_layout_checks_name_the_table(make, tmp_path):
    # DynamicEmbeddingTable's layouts come from its tables' TableConfigs, checked there
    named = r"item\.dim" if make is not make_device else "dim"
    with pytest.raises(TableConfigError, match=named):
        make([RowLayout(4), RowLayout(0)], 1, tmp_path)
    with make(layouts(), 1, tmp_path) as s:
        assert s.num_tables == 3
        assert s.width(0) == 6
        assert s.embedding_dim(2) == 3
        s.check_layouts(layouts())
        with pytest.raises(TableConfigError, match=r"ads\.external_storage.*3 x float32"):
            s.check_layouts([*layouts()[:2], RowLayout(8)])
        with pytest.raises(TableConfigError, match=r"clicks\.external_storage.*float16"):
            s.check_layouts(layouts(torch.float16), names=["clicks", "b", "c"])
        with pytest.raises(TableConfigError, match="holds 3 tables"):
            s.check_layouts(layouts()[:2])
        with pytest.raises(TableConfigError, match="score words"):
            s.check_layouts(layouts(), score_words=2)
        usage = s.memory_usage()
        assert usage.total >= 0
        assert usage.device == 0


def test_storage_checks_its_own_arguments():
    with pytest.raises(TableConfigError, match="at least one table"):
        PyDictStorage([])
    with pytest.raises(TableConfigError, match="names"):
        PyDictStorage(layouts(), names=["a"])
    with pytest.raises(TableConfigError, match="score_words"):
        PyDictStorage(layouts(), score_words=3)
    with pytest.raises(TableConfigError, match=r"tables\[1\]\.dtype"):
        PyDictStorage([RowLayout(2), RowLayout(2, dtype=torch.float64)])
    with pytest.raises(TableConfigError, match=r"tables\[0\]\.state_dim"):
        PyDictStorage([RowLayout(2, -1)])
    with pytest.raises(TableConfigError, match="ScoredHashTable"):
        DynamicEmbeddingTable(object())  # type: ignore[arg-type]


def test_memory_usage_counts_rows():
    s = PyDictStorage(layouts())
    s.insert(torch.tensor([1, 2]), 0, torch.zeros(2, 6), torch.zeros(1, 2, dtype=torch.int64))
    assert s.memory_usage().host == 2 * (6 * 4 + 8)
    d = make_device(layouts(), 1, None)
    assert d.memory_usage().host >= 3 * 128 * 6 * 4


# --------------------------------------------------------------------------------- RocksDB
@NEEDS_ROCKSDICT
def test_rocksdb_refuses_a_path_it_cannot_write(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(TableConfigError, match=r"not a writable directory.*'user', 'item'"):
        RocksDBStorage(blocker / "db", layouts()[:2], names=NAMES[:2])


@NEEDS_ROCKSDICT
def test_rocksdb_starts_empty_closes_and_reports_disk_bytes(tmp_path):
    path = tmp_path / "db"
    with RocksDBStorage(path, layouts()) as s:
        keys, _, values, scores = batch([(0, k) for k in range(50)], layouts()[0], 1, 1)
        s.insert(keys, 0, values, scores)
        assert s.memory_usage().external > 0
    with pytest.raises(StorageClosedError, match="closed"):
        s.find(keys, 0)
    s.close()  # twice is fine
    with pytest.raises(TableConfigError, match="already holds a RocksDB"):
        RocksDBStorage(path, layouts())
    with RocksDBStorage(path, layouts(), overwrite=True) as fresh:
        assert fresh.size(0) == 0
        assert not fresh.find(keys, 0).found.any()


def test_rocksdb_without_rocksdict_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "rocksdict", None)
    with pytest.raises(ImportError, match=r"demb-storage\[ssd\]"):
        RocksDBStorage(tmp_path / "db", layouts())
