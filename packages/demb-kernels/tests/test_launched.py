"""dedup_launch and find_or_insert_gated (CUDA only, marker ``cuda``) against the two-sync ops
they replace in a training forward: dedup_batch, and find_or_insert_rows on a twin index (same
slots, statuses, victims, index state and gathered rows); the gate (a failed check or a sort on
too few key bits changes nothing); launch_info read from words made by hand (CPU); fakes."""

from __future__ import annotations

import pytest
import torch
from demb_kernels import table as ops
from demb_kernels.launched import (
    dedup_launch,
    find_or_insert_gated,
    gate_words,
    launch_info,
    packed_radix,
)
from demb_kernels.lookup import dedup_batch, gather_table_rows
from demb_kernels.table import ScorePolicy, TableIndex
from hypothesis import given, settings
from hypothesis import strategies as st

T, F = 3, 4  # tables, features


def batch_case(gen, batch, max_bag, key_range):
    lengths = torch.randint(0, max_bag + 1, (F * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(offsets[-1])
    indices = torch.randint(0, key_range, (n,), generator=gen)
    feature_tables = torch.tensor([0, 1, 2, 1])
    return indices.cuda(), offsets.cuda(), feature_tables.cuda()


def make_index(policy) -> TableIndex:
    return TableIndex.create([64, 128, 64], [16, 32, 16], [policy] * T, device="cuda")


def snapshot(index):
    return [t.clone() for t in (index.keys, index.digests, index.scores, index.sizes)]


@pytest.mark.cuda
@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 8),
    max_bag=st.integers(0, 6),
    key_range=st.sampled_from([5, 300, 2**40]),
    counters=st.booleans(),
    key_bits=st.sampled_from([8, 16, 64]),
    radix=st.sampled_from([0, 0, 5, 85, 300, 2**16]),
    seed=st.integers(0, 2**31),
)
def test_dedup_launch_matches_dedup_batch(
    batch, max_bag, key_range, counters, key_bits, radix, seed
):
    """Sorted on the low key_bits bits, with or without a radix: dedup_batch's outputs when
    the gate opens, which it does when the keys differ in no higher bit and, with a radix
    (key_bits < 64), their low bits are all below it."""
    gen = torch.Generator().manual_seed(seed)
    indices, offsets, ftab = batch_case(gen, batch, max_bag, key_range)
    weights = torch.randint(0, 4, indices.shape, generator=gen).cuda() if counters else None
    want = dedup_batch(indices, offsets, ftab, T, batch, weights)
    got = dedup_launch(indices, offsets, ftab, T, batch, weights, key_bits, radix)
    host = got.info.cpu()
    info = launch_info(host, indices.numel(), T, F)
    assert info.key_bits == want.key_bits
    lows = indices.cpu() if key_bits == 64 else indices.cpu() & (2**key_bits - 1)
    if key_bits == 64:
        lows = lows ^ -(2**63)  # the sign bit flipped
    low_max = int(lows.max()) & (2**64 - 1) if indices.numel() else 0
    assert info.low_max == low_max
    fits = radix == 0 or key_bits == 64 or low_max < radix
    assert info.ready == (want.key_bits <= key_bits and fits)
    f = want.bounds.numel() - (F + 1)
    assert info.bounds[f:] == want.bounds.tolist()[f:]  # offsets[::B]: right either way
    assert not info.missed
    unique, go, _ = gate_words(host)
    assert go == info.ready
    if not info.ready:  # the sort looked at too few bits: the unique keys are not known
        return
    assert info.bounds == want.bounds.tolist()
    assert unique == info.unique == want.keys.numel()
    u = unique
    for a, b in (
        (got.keys[:u], want.keys),
        (got.tables[:u], want.tables),
        (got.inverse, want.inverse),
        (got.counts[:u], want.counts),
        (got.order, want.order),
        (got.starts[:u], want.starts),
    ):
        assert torch.equal(a, b)
    # Without counts: a (0,) tensor in their place, every other output the same.
    lean = dedup_launch(indices, offsets, ftab, T, batch, weights, key_bits, radix, counts=False)
    assert lean.counts.shape == (0,)
    assert torch.equal(lean.info.cpu(), host)
    for name in ("keys", "tables", "inverse", "order", "starts"):
        assert torch.equal(getattr(lean, name)[:u], getattr(got, name)[:u]), name


@pytest.mark.cuda
@pytest.mark.parametrize("n", [0, 5, 3000])
def test_the_clock_words_hold_one_reading_of_the_gpu_timer(n):
    """dedup_launch's clock words: C copies of one GPU timer reading, taken by its first kernel
    (between two readings by ops.timestamp queued before and after it), even with no index;
    none by default, and the info words stay the same."""
    gen = torch.Generator().manual_seed(n)
    indices = torch.randint(0, 50, (n,), generator=gen).cuda()
    offsets = torch.tensor([0, n // 2, n], device="cuda")
    ftab = torch.tensor([0, 1], device="cuda")
    before = ops.timestamp("cuda")
    got = dedup_launch(indices, offsets, ftab, 2, 1, clock_words=5)
    after = ops.timestamp("cuda")
    plain = dedup_launch(indices, offsets, ftab, 2, 1)
    clock = got.clock.tolist()
    assert len(clock) == 5
    assert len(set(clock)) == 1
    assert int(before) <= clock[0] <= int(after)
    assert plain.clock.shape == (0,)
    for launched in (got, plain):  # a zeroed byte beside the info words, for a backward's flag
        assert launched.nonfinite.shape == ()
        assert launched.nonfinite.dtype == torch.bool
        assert not bool(launched.nonfinite)
        storage = launched.info.untyped_storage().data_ptr()
        assert launched.nonfinite.untyped_storage().data_ptr() == storage
    assert got.info.shape == plain.info.shape
    host, plain_host = got.info.cpu(), plain.info.cpu()
    assert torch.equal(host[:-4], plain_host[:-4])  # up to the scatter's count of blocks
    assert gate_words(host) == gate_words(plain_host)  # U, go, missed
    for bad in (-1, 1025):
        with pytest.raises(ValueError, match="clock_words"):
            dedup_launch(indices, offsets, ftab, 2, 1, clock_words=bad)


@pytest.mark.cuda
def test_a_bad_batch_closes_the_gate_and_launch_info_raises():
    indices = torch.tensor([1, 2, -1, 4], device="cuda")
    offsets = torch.tensor([0, 2, 4], device="cuda")
    ftab = torch.tensor([0, 1], device="cuda")
    got = dedup_launch(indices, offsets, ftab, 2, 1)
    host = got.info.cpu()
    assert gate_words(host)[1] is False
    with pytest.raises(ValueError, match="-1, the empty-key sentinel"):
        launch_info(host, 4, 2, 2)
    bad_offsets = torch.tensor([0, 3, 2], device="cuda")
    host = dedup_launch(indices.abs(), bad_offsets, ftab, 2, 1).info.cpu()
    with pytest.raises(ValueError, match="offsets: must start at 0"):
        launch_info(host, 4, 2, 2)
    empty = torch.zeros(0, dtype=torch.int64, device="cuda")  # no index: offsets still checked
    host = dedup_launch(empty, torch.tensor([0, 1], device="cuda"), ftab[:1], 1, 1).info.cpu()
    with pytest.raises(ValueError, match="offsets"):
        launch_info(host, 0, 1, 1)


def gated_step_matches_twin(index, twin, values, batch, batch_size, score):
    """One training step's dedup_launch + find_or_insert_gated on ``index`` against
    dedup_batch + find_or_insert_rows on ``twin``: the gate open, the same unique count,
    slots, statuses, victims (when a key missed: the insert pass writes them) and index state;
    rows only when every key was found, then the
    same as the twin's and the gather of the slots. Returns the unique keys and whether every
    key was found."""
    indices, offsets, ftab = batch
    launched = dedup_launch(indices, offsets, ftab, T, batch_size, None, 64)
    want = dedup_batch(indices, offsets, ftab, T, batch_size)
    args = torch.full((T,), score, dtype=torch.int64, device="cuda")
    result, host, rows = find_or_insert_gated(
        index, launched.keys, launched.tables, args, launched.counts, launched.info,
        gather=ops.RowGather(values, launched.inverse, 4),
    )  # fmt: skip
    expected, hit, expected_rows = ops.find_or_insert_rows(
        twin, want.keys, want.tables, args, want.counts,
        gather=ops.RowGather(values, want.inverse, 4),
    )  # fmt: skip
    unique, go, missed = gate_words(host)
    assert go
    assert unique == want.keys.numel()
    assert missed == (not hit)
    fields = 4 if missed else 2  # the victims are written only when a key missed
    for a, b in zip(result[:fields], expected[:fields], strict=True):
        assert torch.equal(a[..., :unique], b)
    if not missed:  # the twin's victims then say "none" too
        assert torch.all(expected.victim_keys == -1)
        assert torch.all(expected.victim_scores == 0)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(index), snapshot(twin), strict=True))
    if hit:
        assert rows is not None
        assert torch.equal(rows, expected_rows)
        assert torch.equal(rows, gather_table_rows(values, expected.slots, want.tables,
                                                   want.inverse, 4))  # fmt: skip
    else:
        assert rows is None
    return unique, hit


@pytest.mark.cuda
@pytest.mark.parametrize("policy", [ScorePolicy.STEP, ScorePolicy.LFU, ScorePolicy.NO_EVICTION])
def test_gated_find_or_insert_equals_find_or_insert_rows_on_a_twin(policy):
    """Over batches with new keys, full buckets (evictions or, NO_EVICTION, failures) and then
    all hits: the same slots, statuses, victims, index and (all hit) rows as the two-sync op."""
    gen = torch.Generator().manual_seed(7)
    index, twin = make_index(policy), make_index(policy)
    values = [torch.randn(c, 5, device="cuda") for c in (64, 128, 64)]
    batches = []
    for step in range(6):
        key_range = 400 if step < 4 else 40  # the last steps reuse keys: all hits
        batches.append(batch_case(gen, 16, 4, key_range))
    batches.append(batches[-1])
    for step, batch in enumerate(batches):
        gated_step_matches_twin(index, twin, values, batch, 16, step + 1)


@pytest.mark.cuda
def test_a_gated_lookup_of_more_keys_than_its_grid_has_tiles():
    """About 160,000 unique keys: the gated lookup's grid of resident blocks (at most 132 SMs x
    8 blocks x 32 tiles) takes several keys per tile. A first step inserts them, a second finds
    them all: both equal the two-sync op on a twin."""
    gen = torch.Generator().manual_seed(8)
    capacities, widths = [2**16, 2**17, 2**16], [128, 128, 128]
    policies = [ScorePolicy.STEP] * T
    index = TableIndex.create(capacities, widths, policies, device="cuda")
    twin = TableIndex.create(capacities, widths, policies, device="cuda")
    values = [torch.randn(c, 5, device="cuda") for c in capacities]
    batch = batch_case(gen, 20_000, 4, 2**40)
    for step in (1, 2):
        unique, hit = gated_step_matches_twin(index, twin, values, batch, 20_000, step)
        assert unique > 33_792 * 4
        assert hit == (step == 2)


@pytest.mark.cuda
def test_a_closed_gate_changes_nothing():
    """Keys differing above key_bits (the sort was short) or a bad batch: no key inserted, no
    score touched, no rows."""
    index = make_index(ScorePolicy.LFU)
    ops.find_or_insert(index, torch.arange(6, device="cuda"),
                       torch.tensor([0, 1, 2] * 2, device="cuda"),
                       torch.ones(T, dtype=torch.int64, device="cuda"))  # fmt: skip
    before = snapshot(index)
    wide = torch.tensor([1, 2**20, 3, 4], device="cuda")  # differ above 8 bits
    offsets = torch.tensor([0, 1, 2, 3, 4], device="cuda")
    ftab = torch.tensor([0, 1, 2, 1], device="cuda")
    bad = torch.tensor([1, -1, 3, 4], device="cuda")
    for indices, key_bits in ((wide, 8), (bad, 64)):
        launched = dedup_launch(indices, offsets, ftab, T, 1, None, key_bits)
        values = [torch.randn(c, 5, device="cuda") for c in (64, 128, 64)]
        _, host, rows = find_or_insert_gated(
            index, launched.keys, launched.tables, torch.full((T,), 9, device="cuda"),
            launched.counts, launched.info, gather=ops.RowGather(values, launched.inverse, 4),
        )  # fmt: skip
        assert gate_words(host)[1] is False
        assert rows is None
        assert all(torch.equal(a, b) for a, b in zip(snapshot(index), before, strict=True))


# Info words made by hand: T = 2 tables' ends, 6 batch checks, F = 1 feature's starts; then
# varying bits, the largest low bits, the scatter's finished blocks, U, go, missed.
HAND_WORDS = [3, 5] + [0] * 6 + [0, 9] + [0x1FF, 300, 4, 5, 1, 1]


def test_launch_info_reads_the_words():
    """HAND_WORDS as a tensor, and changed: the info, gate words and errors they give."""
    host = torch.tensor(HAND_WORDS)
    info = launch_info(host, 9, 2, 1)
    assert info.bounds == [0, 3, 5, 0, 9]
    assert (info.unique, info.ready, info.missed, info.key_bits) == (5, True, True, 9)
    assert info.low_max == 300
    assert gate_words(host) == (5, True, True)
    top = host.clone()
    top[-6] = -(2**63)  # keys differing in the top bit
    top[-5] = -1  # the largest low bits, unsigned
    assert launch_info(top, 9, 2, 1).key_bits == 64
    assert launch_info(top, 9, 2, 1).low_max == 2**64 - 1
    bad = host.clone()
    bad[2 + 3] = 1  # one -1 key
    with pytest.raises(ValueError, match="empty-key sentinel"):
        launch_info(bad, 9, 2, 1)
    with pytest.raises(ValueError, match="host: expected"):  # words of another batch shape
        launch_info(host, 9, 2, 2)


def test_launch_info_and_gate_words_read_a_list_of_the_words_alike():
    """The words read back once as a list (as find_or_insert_launched hands them on): the same
    info, gate words and errors as from the tensor."""
    words = HAND_WORDS
    assert launch_info(words, 9, 2, 1) == launch_info(torch.tensor(words), 9, 2, 1)
    assert gate_words(words) == gate_words(torch.tensor(words)) == (5, True, True)
    closed = [*words[:-2], 0, 0]  # the go flag clear: a failed check is raised from the list
    closed[2 + 3] = 1
    with pytest.raises(ValueError, match="empty-key sentinel"):
        launch_info(closed, 9, 2, 1)
    with pytest.raises(ValueError, match="host: expected"):
        launch_info(words, 9, 2, 2)


def test_fake_kernels_give_shapes_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        indices = torch.empty(40, dtype=torch.int64)
        offsets = torch.empty(9, dtype=torch.int64)
        ftab = torch.empty(F, dtype=torch.int64)
        out = dedup_launch(indices, offsets, ftab, T, 2)
        assert all(t.shape == (40,) for t in out[:6])
        assert out.info.shape == (T + 6 + F + 1 + 6,)
        assert out.clock.shape == (0,)
        assert out.nonfinite.shape == ()
        assert out.nonfinite.dtype == torch.bool
        assert dedup_launch(indices, offsets, ftab, T, 2, clock_words=T).clock.shape == (T,)


def test_packed_radix_saves_a_pass_when_the_last_keys_fit():
    """T * R one byte below (table << key_bits) | low: 10 tables of ids < 1,677,721 sort on
    24 bits, not 28; none when the last batch's low bits reached R, or for full 64-bit keys."""
    assert packed_radix(24, 1_677_720, 10) == 2**24 // 10
    assert packed_radix(24, 1_677_721, 10) == 0
    assert packed_radix(64, 0, 10) == 0
    assert packed_radix(16, 100, 1) == 2**16  # one table: 16 bits, not 17
    assert packed_radix(8, 3, 3) == 256 // 3
    assert packed_radix(8, 200, 3) == 0
    assert packed_radix(56, 5, 2**20) == 0  # the table would not fit above the key bits
    assert packed_radix(40, 5, 4) == 2**40 // 4
    with pytest.raises(ValueError, match="num_tables=0"):
        packed_radix(24, 5, 0)
    with pytest.raises(ValueError, match="key_bits=0"):
        packed_radix(0, 5, 3)


@pytest.mark.cuda
@pytest.mark.parametrize("base", [0, -5000, -(2**40), 2**40 + 12_345, -(2**63) + 7])
def test_keys_that_agree_above_their_low_bits_come_back_whole(base):
    """Keys that differ only in their low 13 bits, all-negative ones among them and ones with a
    common high part: the one-sort paths of combined sort keys (dedup_batch with a key_bits
    guess; dedup_launch with the table above the low bits or by a radix, in 32- and 64-bit
    sort keys) rebuild each unique key from its sort key, and every output equals the CPU's
    dedup_batch."""
    gen = torch.Generator().manual_seed(17)
    batch = 2_000
    lengths = torch.randint(0, 4, (F * batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(offsets[-1])
    indices = base + torch.randint(0, 4_000, (n,), generator=gen)
    indices[indices == -1] = base  # -1 is the empty-key sentinel
    ftab = torch.tensor([0, 1, 2, 1])
    want = dedup_batch(indices, offsets, ftab, T, batch)
    assert want.key_bits <= 13
    args = (indices.cuda(), offsets.cuda(), ftab.cuda(), T, batch, None)
    u = want.keys.numel()
    for key_bits in (13, 40):  # combined sort keys of 15 and 42 bits
        got = dedup_batch(*args, key_bits)
        for name, a, b in zip(want._fields[:-1], want[:-1], got[:-1], strict=True):
            assert torch.equal(a, b.cpu()), (key_bits, name)
        for radix in (0, 2**key_bits + 3):  # the table above the low bits, or by a radix
            launched = dedup_launch(*args, key_bits, radix)
            info = launch_info(launched.info.cpu(), n, T, F)
            assert info.ready, (key_bits, radix)
            assert info.unique == u
            for a, b in (
                (launched.keys[:u], want.keys),
                (launched.tables[:u], want.tables),
                (launched.inverse, want.inverse),
                (launched.starts[:u], want.starts),
            ):
                assert torch.equal(a.cpu(), b), (key_bits, radix)


@pytest.mark.cuda
def test_a_key_radix_out_of_range_is_refused():
    indices = torch.tensor([1, 2], device="cuda")
    offsets = torch.tensor([0, 1, 2], device="cuda")
    ftab = torch.tensor([0, 1], device="cuda")
    with pytest.raises(ValueError, match="key_radix=-1"):
        dedup_launch(indices, offsets, ftab, 2, 1, None, 16, -1)
    with pytest.raises(ValueError, match="key_radix="):
        dedup_launch(indices, offsets, ftab, 2, 1, None, 16, 2**62)


@pytest.mark.cuda
def test_keys_a_radix_does_not_fit_shut_the_gate_and_nothing_else():
    """Low bits at or above the radix pack into quotients past the tables: the gate stays
    shut, the batch's checks stay clean (launch_info does not raise), the words say why."""
    gen = torch.Generator().manual_seed(3)
    indices, offsets, ftab = batch_case(gen, 8, 6, 300)
    indices[0] = 299
    for radix in (5, 299):
        got = dedup_launch(indices, offsets, ftab, T, 8, None, 16, radix)
        info = launch_info(got.info.cpu(), indices.numel(), T, F)
        assert not info.ready
        assert info.low_max == int(indices.max())
    fits = dedup_launch(indices, offsets, ftab, T, 8, None, 16, 300)
    assert launch_info(fits.info.cpu(), indices.numel(), T, F).ready


@pytest.mark.cuda
def test_repeated_dedups_of_one_size_replay_the_sort_and_match_dedup_batch():
    """The sort and scan of a batch size seen before replay from a graph over scratch kept per
    stream and size: batches of one size, of two sizes alternating, and on a second stream,
    each equal to dedup_batch; earlier outputs stay as they were (they are not the scratch)."""
    gen = torch.Generator().manual_seed(11)
    side = torch.cuda.Stream()
    kept = []
    for step in range(8):
        batch = 6 if step % 3 else 9  # two sizes of n (with the same bag lengths per size)
        lengths = torch.full((F * batch,), 3)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
        indices = torch.randint(0, 2**40 if step % 2 else 300, (int(offsets[-1]),), generator=gen)
        indices, ftab = indices.cuda(), torch.tensor([0, 1, 2, 1]).cuda()
        # Two sorts (64 bits), one sort of 64-bit keys (40), of 32-bit keys (16, with a radix).
        for bits, radix in ((64, 0), (40, 0), (16, 0), (16, packed_radix(16, 0, T))):
            want = dedup_batch(indices.cpu(), offsets.cpu(), ftab.cpu(), T, batch)
            stream = side if step % 4 == 3 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                got = dedup_launch(indices, offsets, ftab, T, batch, None, bits, radix)
                host = got.info.cpu()
            torch.cuda.current_stream().wait_stream(stream)
            info = launch_info(host, indices.numel(), T, F)
            if not info.ready:  # the keys do not fit the low bits: nothing to compare
                continue
            u = info.unique
            outs = [got.keys[:u], got.tables[:u], got.inverse, got.counts[:u], got.order]
            wanted = [want.keys, want.tables, want.inverse, want.counts, want.order]
            assert all(torch.equal(a.cpu(), b) for a, b in zip(outs, wanted, strict=True))
            kept.append((outs, [t.clone() for t in outs]))
    assert len(kept) >= 20
    for outs, copies in kept:
        assert all(torch.equal(a, b) for a, b in zip(outs, copies, strict=True))


@pytest.mark.cuda
def test_replayed_dedups_take_each_call_s_batch_counters_and_words():
    """Batches of one size n replay the sort and scan from a graph between launches of their
    own: with another bag count, with counters and without, with clock words and without
    (another info size), each call gives dedup_batch's outputs, its own batch checks (a bad one
    shuts only its own gate) and a zeroed NaN/inf byte, and the outputs of earlier calls stay as
    they were."""
    gen = torch.Generator().manual_seed(23)
    n = 96
    ftab = torch.tensor([0, 1, 2, 1]).cuda()
    kept = []
    for step in range(18):
        batch = (2, 6, 24)[step % 3]  # F * batch bags of n indices in all
        cuts = torch.sort(torch.randint(0, n + 1, (F * batch - 1,), generator=gen)).values
        offsets = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]).cuda()
        indices = torch.randint(0, 300, (n,), generator=gen).cuda()
        weights = torch.randint(0, 4, (n,), generator=gen).cuda() if step % 2 else None
        clock = T if step % 4 < 2 else 0
        bad = step % 5 == 4  # a negative index: this batch's check fails, no other's
        if bad:
            indices[7] = -1
        got = dedup_launch(indices, offsets, ftab, T, batch, weights, 16, 0, clock_words=clock)
        assert got.clock.shape == (clock,)
        host = got.info.cpu()
        assert not bool(got.nonfinite)
        if bad:
            assert not gate_words(host.tolist())[1]
            with pytest.raises(ValueError, match="indices"):
                launch_info(host, n, T, F)
            continue
        want = dedup_batch(indices, offsets, ftab, T, batch, weights)
        info = launch_info(host, n, T, F)
        assert info.ready
        assert info.bounds == want.bounds.tolist()
        u = info.unique
        outs = [got.keys[:u], got.tables[:u], got.inverse, got.counts[:u], got.order]
        wanted = [want.keys, want.tables, want.inverse, want.counts, want.order]
        assert all(torch.equal(a, b) for a, b in zip(outs, wanted, strict=True))
        assert torch.equal(got.starts[:u], want.starts)
        kept.append((outs, [t.clone() for t in outs]))
    for outs, copies in kept:
        assert all(torch.equal(a, b) for a, b in zip(outs, copies, strict=True))


@pytest.mark.cuda
def test_replayed_large_dedups_clear_their_sort_graph_s_counters():
    """Batches large enough for cub's onesweep sort (a histogram, counters and a lookback
    buffer per pass, zeroed inside its graph) replay it: three sorts of one size (32-bit keys,
    64-bit keys, packed with a radix) in turn, and a batch of another size between them, each
    equal to dedup_batch. A histogram or counter left from an earlier call would misplace the
    keys."""
    gen = torch.Generator().manual_seed(29)
    ftab = torch.tensor([0, 1, 2, 1]).cuda()
    radix = packed_radix(16, 19_999, T)
    assert radix > 0
    sorts = ((24, 0, 2**20), (40, 0, 2**20), (16, radix, 20_000))  # key bits, radix, key range
    for step in range(14):
        batch = 5_000 if step % 5 == 4 else 10_000
        lengths = torch.randint(0, 3, (F * batch,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
        bits, radix, key_range = sorts[step % 3]
        high = key_range if step % 2 else 1_000  # few or many repeated keys
        indices = torch.randint(0, high, (int(offsets[-1]),), generator=gen).cuda()
        got = dedup_launch(indices, offsets, ftab, T, batch, None, bits, radix)
        info = launch_info(got.info.cpu(), indices.numel(), T, F)
        assert info.ready
        want = dedup_batch(indices, offsets, ftab, T, batch)
        u = info.unique
        outs = [got.keys[:u], got.tables[:u], got.inverse, got.counts[:u], got.order]
        wanted = [want.keys, want.tables, want.inverse, want.counts, want.order]
        assert all(torch.equal(a, b) for a, b in zip(outs, wanted, strict=True))
        assert torch.equal(got.starts[:u], want.starts)


@pytest.mark.cuda
def test_a_dedup_captured_in_a_caller_graph_replays_new_batches():
    """dedup_launch captured in a caller's torch.cuda.graph (its sort then uses scratch of its
    own, not the kept scratch later calls reuse) gives each new batch copied into its input
    dedup_batch's outputs when replayed, with eager calls of the same size in between."""
    gen = torch.Generator().manual_seed(5)
    batch = 8
    lengths = torch.full((F * batch,), 3)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]).cuda()
    n = int(offsets[-1])
    ftab = torch.tensor([0, 1, 2, 1]).cuda()

    def keys() -> torch.Tensor:
        return torch.randint(0, 300, (n,), generator=gen).cuda()

    def launch(indices: torch.Tensor):
        return dedup_launch(indices, offsets, ftab, T, batch, None, 16, 0)

    for _ in range(3):  # the kept scratch of this size, and its sort graph
        launch(keys())
    static = keys()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        launch(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = launch(static)
    for _ in range(3):
        fresh = keys()
        static.copy_(fresh)
        graph.replay()
        between = keys()
        eager = launch(between)
        torch.cuda.synchronize()
        for out, batch_keys in ((got, fresh), (eager, between)):
            want = dedup_batch(batch_keys.cpu(), offsets.cpu(), ftab.cpu(), T, batch)
            info = launch_info(out.info.cpu(), n, T, F)
            assert info.ready
            u = info.unique
            assert torch.equal(out.keys[:u].cpu(), want.keys)
            assert torch.equal(out.inverse.cpu(), want.inverse)
            assert torch.equal(out.order.cpu(), want.order)
            assert torch.equal(out.counts[:u].cpu(), want.counts)
