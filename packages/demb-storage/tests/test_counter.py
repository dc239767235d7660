"""MultiTableKVCounter against the pure-Python table model (LFU), its files, export / import,
memory accounting and bad configurations."""

from __future__ import annotations

import io
from collections import defaultdict

import demb_planner
import pytest
import torch
from demb_kernels import table_reference as ref
from demb_storage import (
    AdmissionConfigError,
    CounterDataError,
    KVCounter,
    MemoryType,
    MultiTableKVCounter,
    StorageError,
    TableConfigError,
)
from hypothesis import given, settings
from hypothesis import strategies as st

WIDTH = 16


def tensor(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def colliding_keys(n: int, capacity: int, width: int, bucket: int = 0) -> list[int]:
    """``n`` keys whose home bucket is ``bucket`` in a table of ``capacity`` slots."""
    found: list[int] = []
    start = 0
    while len(found) < n:
        block = list(range(start, start + 4096))
        home = demb_planner.home_slots(block, capacity, width)
        found += [k for k, b in zip(block, home.bucket.tolist(), strict=True) if b == bucket]
        start += 4096
    return found[:n]


class CounterModel:
    """The counter's expected behaviour, over :class:`TableModel` with the LFU policy."""

    def __init__(self, capacities: list[int]) -> None:
        self.table = ref.TableModel(
            capacities, [WIDTH] * len(capacities), [ref.LFU] * len(capacities), 1
        )
        self.evicted = [0] * len(capacities)

    def add(self, keys: list[int], tables: list[int], freqs: list[int]) -> list[int]:
        slots, status, _, _ = self.table.find_or_insert(
            keys, tables, [0] * len(self.evicted), freqs
        )
        failed_sum: dict[tuple[int, int], int] = defaultdict(int)
        for k, t, f, s in zip(keys, tables, freqs, status, strict=True):
            if s == ref.FAILED:
                failed_sum[(t, k)] += f
            if s == ref.EVICTED:
                self.evicted[t] += 1
        snaps = [self.table.snapshot(t) for t in range(len(self.evicted))]
        out = []
        for k, t, slot in zip(keys, tables, slots, strict=True):
            out.append(snaps[t][k][1][0] if slot >= 0 else failed_sum[(t, k)])
        return out

    def contents(self, t: int) -> list[tuple[int, int]]:
        """``(key, count)`` in ascending slot order."""
        snap = self.table.snapshot(t)
        return [(k, sc[0]) for k, (_, sc) in sorted(snap.items(), key=lambda kv: kv[1][0])]


def contents(counter: MultiTableKVCounter, t: int) -> list[tuple[int, int]]:
    keys, counts = counter.export(t)
    return list(zip(keys.tolist(), counts.tolist(), strict=True))


batch_entry = st.tuples(st.integers(0, 120), st.integers(0, 1), st.integers(0, 3))
step = st.one_of(
    st.tuples(st.just("add"), st.lists(batch_entry, max_size=40)),
    st.tuples(st.just("erase"), st.lists(batch_entry, max_size=10)),
)


# --------------------------------------------------------------------------- against the model
@settings(max_examples=40, deadline=None)
@given(
    buckets=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    steps=st.lists(step, min_size=1, max_size=8),
)
def test_counter_matches_the_lfu_table_model(buckets, steps):
    capacities = [b * WIDTH for b in buckets]
    counter = MultiTableKVCounter([KVCounter(c, WIDTH) for c in capacities])
    model = CounterModel(capacities)
    for op, entries in steps:
        keys = [k for k, _, _ in entries]
        tables = [t for _, t, _ in entries]
        if op == "add":
            freqs = [f for _, _, f in entries]
            got = counter.add(tensor(keys), tensor(tables), tensor(freqs))
            assert got.dtype == torch.int64
            assert got.tolist() == model.add(keys, tables, freqs)
        else:
            counter.erase(tensor(keys), tensor(tables))
            model.table.erase(keys, tables)
        for t in range(2):
            assert contents(counter, t) == model.contents(t)
            assert counter.size(t) == len(model.contents(t))
    assert counter.evicted_since_last_read().tolist() == model.evicted
    assert counter.evicted_since_last_read().tolist() == [0, 0]


def test_counts_accumulate_across_and_within_batches():
    counter = MultiTableKVCounter([KVCounter(64, WIDTH), KVCounter(64, WIDTH)])
    assert counter.add(tensor([5, 5, 7]), tensor([0, 0, 1])).tolist() == [2, 2, 1]
    got = counter.add(tensor([5, 7, 7]), tensor([0, 1, 0]), tensor([3, 2, 4]))
    assert got.tolist() == [5, 3, 4]
    assert dict(contents(counter, 0)) == {5: 5, 7: 4}
    assert counter.add(tensor([]), tensor([])).numel() == 0


def test_a_full_bucket_evicts_its_smallest_count_and_a_crowded_batch_fails():
    keys = colliding_keys(WIDTH + 2, WIDTH, WIDTH)
    counter = MultiTableKVCounter([KVCounter(WIDTH, WIDTH)])
    zeros = torch.zeros(WIDTH, dtype=torch.int64)
    counter.add(tensor(keys[:WIDTH]), zeros, torch.arange(2, WIDTH + 2))
    got = counter.add(tensor([keys[WIDTH]]), tensor([0]))
    assert got.tolist() == [1]
    assert keys[0] not in dict(contents(counter, 0))  # count 2, the smallest
    assert counter.evicted_since_last_read().tolist() == [1]
    # A batch touching every slot of the bucket plus a new key: the new key cannot be placed.
    present = [k for k, _ in contents(counter, 0)]
    batch = [*present, keys[WIDTH + 1], keys[WIDTH + 1]]
    got = counter.add(
        tensor(batch), torch.zeros(len(batch), dtype=torch.int64), tensor([1] * WIDTH + [4, 5])
    )
    assert got[-2:].tolist() == [9, 9]  # its frequency in this call, not stored
    assert keys[WIDTH + 1] not in dict(contents(counter, 0))
    assert counter.evicted_since_last_read().tolist() == [0]


def test_erase_ignores_absent_keys_and_clear_empties():
    counter = MultiTableKVCounter([KVCounter(32, WIDTH), KVCounter(32, WIDTH)])
    counter.add(tensor([1, 2, 3]), tensor([0, 0, 1]))
    counter.erase(tensor([1, 99, 3]), tensor([0, 0, 0]))
    assert dict(contents(counter, 0)) == {2: 1}
    assert dict(contents(counter, 1)) == {3: 1}
    counter.clear(1)
    assert counter.size(1) == 0
    assert counter.size(0) == 1
    counter.clear()
    assert counter.size(0) == 0


def test_bad_batches_raise():
    counter = MultiTableKVCounter([KVCounter(32, WIDTH)])
    with pytest.raises(ValueError, match="frequencies"):
        counter.add(tensor([1, 2]), tensor([0, 0]), tensor([1]))
    with pytest.raises(TypeError, match="frequencies"):
        counter.add(tensor([1]), tensor([0]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="negative"):
        counter.add(tensor([1]), tensor([0]), tensor([-1]))
    with pytest.raises(ValueError, match="table_ids"):
        counter.add(tensor([1]), tensor([3]))
    with pytest.raises(ValueError, match="empty-key"):
        counter.add(tensor([-1]), tensor([0]))


# --------------------------------------------------------------------------- configuration
def test_kv_counter_rounds_capacity_up_and_compares_by_value():
    assert KVCounter(1).slots == 1024
    assert KVCounter(100, 16).slots == 112
    assert KVCounter(96, 32).slots == 96
    assert KVCounter(100, 16) == KVCounter(100, 16)
    assert hash(KVCounter(100, 16, torch.int32)) == hash(KVCounter(100, 16, torch.int32))
    assert KVCounter(100, 16) != KVCounter(100, 32)
    counter = MultiTableKVCounter([KVCounter(100, 16), KVCounter(3, 32)])
    assert counter.capacities == (112, 32)
    assert counter.num_tables == 2


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"capacity": 0}, "counter.capacity"),
        ({"capacity": -5}, "counter.capacity"),
        ({"capacity": 1.5}, "counter.capacity"),
        ({"capacity": True}, "counter.capacity"),
        ({"capacity": 8, "bucket_capacity": 10}, "counter.bucket_capacity"),
        ({"capacity": 8, "bucket_capacity": 0}, "counter.bucket_capacity"),
        ({"capacity": 8, "bucket_capacity": 2**31 + 16}, "counter.bucket_capacity"),
        ({"capacity": 8, "key_type": torch.float32}, "counter.key_type"),
    ],
)
def test_bad_kv_counter_raises_a_typed_error_naming_the_option(kwargs, option):
    with pytest.raises(AdmissionConfigError, match=option) as caught:
        KVCounter(**kwargs).check()  # kept by the constructor, checked where it is used
    with pytest.raises(AdmissionConfigError, match=rf"counters\[0\]\.{option}"):
        MultiTableKVCounter([KVCounter(**kwargs)])
    err = caught.value
    assert isinstance(err, TableConfigError)
    assert isinstance(err, ValueError)
    assert err.option == option
    bad = kwargs[option.removeprefix("counter.")]
    assert repr(bad) in str(err)
    named = err.for_table("users")
    assert named.option == f"users.{option}"
    assert named.reason == err.reason


def test_multi_table_counter_needs_kv_counters():
    with pytest.raises(AdmissionConfigError, match="counters"):
        MultiTableKVCounter([])
    with pytest.raises(AdmissionConfigError, match=r"counters\[1\]"):
        MultiTableKVCounter([KVCounter(16, 16), 16])  # type: ignore[list-item]


# --------------------------------------------------------------------------- memory
def test_memory_usage_reports_host_bytes_on_the_cpu():
    counter = MultiTableKVCounter([KVCounter(100, 16), KVCounter(32, 32)])
    slots, tables = 112 + 32, 2
    expected = 17 * slots + 8 * (tables + 1) + 5 * 8 * tables
    assert counter.memory_usage(MemoryType.HOST) == expected
    assert counter.memory_usage(MemoryType.DEVICE) == 0
    assert counter.memory_usage() == 0


@pytest.mark.cuda
def test_memory_usage_reports_device_bytes_on_cuda():
    counter = MultiTableKVCounter([KVCounter(100, 16)], "cuda")
    assert counter.memory_usage(MemoryType.DEVICE) == 17 * 112 + 8 * 2 + 5 * 8
    assert counter.memory_usage(MemoryType.HOST) == 0


@pytest.mark.cuda
def test_cuda_counter_equals_the_cpu_counter():
    gen = torch.Generator().manual_seed(0)
    configs = [KVCounter(64, 16), KVCounter(32, 16)]
    cpu, cuda = MultiTableKVCounter(configs), MultiTableKVCounter(configs, "cuda")
    for _ in range(10):
        keys = torch.randint(0, 300, (80,), generator=gen)
        tables = torch.randint(0, 2, (80,), generator=gen)
        freqs = torch.randint(0, 4, (80,), generator=gen)
        a = cpu.add(keys, tables, freqs)
        b = cuda.add(keys.cuda(), tables.cuda(), freqs.cuda())
        assert torch.equal(a, b.cpu())
        cpu.erase(keys[:5], tables[:5])
        cuda.erase(keys[:5].cuda(), tables[:5].cuda())
    for t in range(2):
        assert contents(cpu, t) == contents(cuda, t)
    assert torch.equal(cpu.evicted_since_last_read(), cuda.evicted_since_last_read().cpu())


# --------------------------------------------------------------------------- export / files
def filled() -> MultiTableKVCounter:
    counter = MultiTableKVCounter([KVCounter(64, WIDTH), KVCounter(64, WIDTH)])
    counter.add(tensor([1, 2, 3, 4, 2]), tensor([0, 0, 0, 1, 0]), tensor([1, 2, 3, 4, 5]))
    return counter


def test_export_import_round_trip_replaces_present_counts_and_adds_keys():
    src = filled()
    keys, counts = src.export(0)
    assert keys.device.type == "cpu"
    assert keys.dtype == counts.dtype == torch.int64
    dst = MultiTableKVCounter([KVCounter(64, WIDTH)])
    dst.add(tensor([2, 50]), tensor([0, 0]), tensor([100, 6]))
    assert dst.import_(0, keys, counts) == 0
    assert dict(contents(dst, 0)) == {1: 1, 2: 7, 3: 3, 50: 6}
    assert dst.import_(0, tensor([]), tensor([])) == 0


def test_import_into_a_smaller_counter_keeps_the_largest_counts():
    keys = colliding_keys(WIDTH + 3, 4 * WIDTH, WIDTH)
    counts = list(range(1, WIDTH + 4))
    dst = MultiTableKVCounter([KVCounter(4 * WIDTH, WIDTH)])
    assert dst.import_(0, tensor(keys), tensor(counts)) == 3
    assert set(dict(contents(dst, 0)).values()) == set(counts[3:])


def test_bad_imports_raise():
    counter = filled()
    with pytest.raises(CounterDataError, match="counts"):
        counter.import_(0, tensor([1, 2]), tensor([1]))
    with pytest.raises(CounterDataError, match="negative"):
        counter.import_(0, tensor([1]), tensor([-1]))
    with pytest.raises(TypeError, match="counts"):
        counter.import_(0, tensor([1]), torch.tensor([1.0]))
    with pytest.raises(ValueError, match="table_id"):
        counter.import_(5, tensor([1]), tensor([1]))


def test_dump_load_round_trip_through_files(tmp_path):
    src = filled()
    key_file, count_file = tmp_path / "keys.bin", tmp_path / "counts.bin"
    src.dump(key_file, count_file, 0)
    keys, counts = src.export(0)
    assert key_file.read_bytes() == b"".join(
        k.to_bytes(8, "little", signed=True) for k in keys.tolist()
    )
    assert count_file.stat().st_size == 8 * counts.numel()
    dst = MultiTableKVCounter([KVCounter(64, WIDTH), KVCounter(16, WIDTH)])
    dst.load(str(key_file), str(count_file), 1)
    assert dict(contents(dst, 1)) == dict(contents(src, 0))
    assert dst.size(0) == 0


def test_dump_load_round_trip_through_file_objects():
    src = filled()
    key_io, count_io = io.BytesIO(), io.BytesIO()
    src.dump(key_io, count_io, 1)
    key_io.seek(0)
    count_io.seek(0)
    dst = MultiTableKVCounter([KVCounter(64, WIDTH)])
    dst.load(key_io, count_io, 0)
    assert contents(dst, 0) == [(4, 4)]


def test_an_empty_table_dumps_empty_files(tmp_path):
    counter = MultiTableKVCounter([KVCounter(16, WIDTH)])
    counter.dump(tmp_path / "k", tmp_path / "c", 0)
    assert (tmp_path / "k").read_bytes() == b""
    counter.load(tmp_path / "k", tmp_path / "c", 0)
    assert counter.size(0) == 0


def test_truncated_or_mismatched_files_raise_naming_the_file(tmp_path):
    src = filled()
    key_file, count_file = tmp_path / "keys.bin", tmp_path / "counts.bin"
    src.dump(key_file, count_file, 0)
    data = key_file.read_bytes()
    key_file.write_bytes(data[:-3])
    dst = MultiTableKVCounter([KVCounter(64, WIDTH)])
    with pytest.raises(CounterDataError, match=r"keys\.bin") as caught:
        dst.load(key_file, count_file, 0)
    assert isinstance(caught.value, StorageError)
    assert isinstance(caught.value, ValueError)
    key_file.write_bytes(data[:-8])
    with pytest.raises(CounterDataError, match=r"keys\.bin.*counts\.bin.*disagree"):
        dst.load(key_file, count_file, 0)
    assert dst.size(0) == 0


def test_loading_into_a_smaller_counter_warns():
    keys = colliding_keys(WIDTH + 2, 4 * WIDTH, WIDTH)
    key_io = io.BytesIO(b"".join(k.to_bytes(8, "little") for k in keys))
    count_io = io.BytesIO(b"".join(c.to_bytes(8, "little") for c in range(1, WIDTH + 3)))
    dst = MultiTableKVCounter([KVCounter(4 * WIDTH, WIDTH)])
    with pytest.warns(RuntimeWarning, match="2 of 18 keys did not fit"):
        dst.load(key_io, count_io, 0)
    assert dst.size(0) == WIDTH
