"""The unchecked CUDA backward of demb::summed_update, which sums each key of at most 32 entries
in the update kernel itself (the window sums only sum the longer keys first): the same tables,
bit for bit, as the checked two-pass backward (window sums, then optimizer_update), for every
optimizer, keys of 1 to 1,100 entries, several tables and more than one launch's 32; with SGD
also the closed form in float64; work queued after the backward on its stream sees every row
updated. Marker ``cuda``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.cuda

LR = 0.05
# optimizer_update's nine floats: lr, eps, beta1, beta2, weight decay, FTRL power, beta, l1, l2.
OPTIMIZERS = {
    "sgd": ("sgd", [LR] + [0.0] * 8),
    "adam": ("adam", [LR, 1e-8, 0.9, 0.999, 0.01, 0.0, 0.0, 0.0, 0.0]),
    "adagrad": ("adagrad", [LR, 1e-8] + [0.0] * 7),
    "rowwise_adagrad": ("rowwise_adagrad", [LR, 1e-8] + [0.0] * 7),
    "ftrl_sqrt": ("ftrl", [LR, 0.0, 0.0, 0.0, 0.0, -0.5, 1.0, 0.01, 0.001]),
    "ftrl": ("ftrl", [LR, 0.0, 0.0, 0.0, 0.0, -0.6, 1.0, 0.01, 0.001]),
}
# Entries per key: one entry, a few, a full window chunk, one over, several chunks, and a hot key
# of more than 32 chunks (the finish pass folds it with its whole block).
COUNTS = [1, 2, 3, 1, 7, 31, 32, 1, 33, 64, 65, 100, 1, 1100, 2, 1]


def state_width(name: str, dim: int) -> int:
    """Floats of optimizer state after a row of ``dim`` (row-wise Adagrad: its 16 bytes)."""
    return {"sgd": 0, "adagrad": dim, "rowwise_adagrad": 4}.get(name, 2 * dim)


def batch(gen, counts, sizes, dim, name, rows=2048):
    """A deduplicated batch: key ``u`` has ``counts[u]`` entries scattered over ``N``, the keys
    split into tables of ``sizes``; each table's value buffer with positive state words (the
    accumulators of Adagrad and FTRL must be), and one key without a slot."""
    unique = len(counts)
    inverse = torch.repeat_interleave(torch.arange(unique), torch.tensor(counts))
    inverse = inverse[torch.randperm(inverse.numel(), generator=gen)]
    order = torch.argsort(inverse, stable=True)
    count = torch.tensor(counts)
    starts = torch.cumsum(count, 0) - count
    slots = torch.cat([torch.randperm(rows, generator=gen)[:s] for s in sizes])
    slots[min(4, unique - 1)] = -1
    width = dim + state_width(name, dim)
    values = [torch.rand(rows, width, generator=gen) + 0.05 for _ in sizes]
    for v in values:
        v[:, :dim] -= 0.5
    return {
        "order": order.cuda(),
        "starts": starts.cuda(),
        "slots": slots.cuda(),
        "values": [v.cuda() for v in values],
        "sizes": list(sizes),
        "n": inverse.numel(),
        "inverse": inverse,
    }


def backward(b, grad, dim, name, check, steps):
    """One summed_update backward of ``grad`` (N, dim) into ``b``'s tables."""
    kind, hyper = OPTIMIZERS[name]
    trigger = torch.zeros((), device="cuda", requires_grad=True)
    out = torch.zeros(b["n"], dim, device="cuda")
    wired = torch.ops.demb.summed_update(
        trigger, out, b["order"], b["starts"], None, None, None, b["slots"], b["sizes"],
        b["values"], [dim] * len(b["sizes"]), steps, kind, hyper, None, check, dim, None,
    )  # fmt: skip
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wired.backward(grad)
        torch.cuda.synchronize()
    return sum(e.name == "demb::optimizer_update" for e in prof.events())


def twins(gen, counts, sizes, dim, name):
    fused = batch(gen, counts, sizes, dim, name)
    checked = {**fused, "values": [v.clone() for v in fused["values"]]}
    return fused, checked


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("dim", [4, 12, 128])
def test_an_unchecked_backward_equals_the_checked_one_bit_for_bit(name, dim):
    gen = torch.Generator().manual_seed(dim)
    sizes = (5, 0, len(COUNTS) - 5)  # an empty table between two
    fused, checked = twins(gen, COUNTS, sizes, dim, name)
    steps_f = torch.zeros(3, dtype=torch.int64)
    steps_c = torch.zeros(3, dtype=torch.int64)
    for _ in range(2):
        grad = torch.randn(fused["n"], dim, generator=gen).cuda()
        assert backward(fused, grad, dim, name, False, steps_f) == 0  # the fused kernel
        assert backward(checked, grad, dim, name, True, steps_c) == 1  # optimizer_update
        for a, b in zip(fused["values"], checked["values"], strict=True):
            assert torch.equal(a, b)
    assert steps_f.tolist() == steps_c.tolist() == [2, 2, 2]


@settings(max_examples=30, deadline=None)
@given(
    counts=st.lists(st.one_of(st.integers(1, 40), st.integers(1, 300)), min_size=1, max_size=60),
    split=st.floats(0.0, 1.0),
    dim=st.sampled_from([4, 8, 12, 64, 124, 128]),
    name=st.sampled_from(list(OPTIMIZERS)),
    seed=st.integers(0, 2**16),
)
def test_any_batch_gives_the_checked_tables(counts, split, dim, name, seed):
    """Random entry counts per key (windows holding short and long keys side by side), tables
    and widths: the unchecked backward equals the checked one bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    first = round(split * len(counts))
    fused, checked = twins(gen, counts, (first, len(counts) - first), dim, name)
    grad = torch.randn(fused["n"], dim, generator=gen).cuda()
    assert backward(fused, grad, dim, name, False, torch.zeros(2, dtype=torch.int64)) == 0
    assert backward(checked, grad, dim, name, True, torch.zeros(2, dtype=torch.int64)) == 1
    for a, b in zip(fused["values"], checked["values"], strict=True):
        assert torch.equal(a, b)


def test_an_unchecked_sgd_backward_gives_the_closed_form():
    """Each slot's row minus the learning rate times its key's summed entries, in float64."""
    gen = torch.Generator().manual_seed(11)
    dim = 8
    b = batch(gen, COUNTS, (7, len(COUNTS) - 7), dim, "sgd")
    before = [v.double().cpu() for v in b["values"]]
    grad = torch.randn(b["n"], dim, generator=gen)
    backward(b, grad.cuda(), dim, "sgd", False, torch.zeros(2, dtype=torch.int64))
    sums = torch.zeros(len(COUNTS), dim, dtype=torch.float64)
    sums.index_add_(0, b["inverse"], grad.double())
    slots = b["slots"].cpu()
    for t, (lo, hi) in enumerate([(0, 7), (7, len(COUNTS))]):
        want = before[t].clone()
        for u in range(lo, hi):
            if slots[u] >= 0:
                want[slots[u]] -= LR * sums[u]
        torch.testing.assert_close(b["values"][t].double().cpu(), want, rtol=1e-5, atol=1e-5)


def test_more_tables_than_one_launch_takes():
    """33 tables: two launches, the second's keys found from its first key on."""
    gen = torch.Generator().manual_seed(12)
    counts = [c for _ in range(5) for c in (1, 3, 40, 2, 1, 9, 1)]  # 35 keys
    sizes = [1] * 32 + [3]
    fused, checked = twins(gen, counts, sizes, 8, "adam")
    grad = torch.randn(fused["n"], 8, generator=gen).cuda()
    steps = [torch.zeros(33, dtype=torch.int64) for _ in range(2)]
    assert backward(fused, grad, 8, "adam", False, steps[0]) == 0
    assert backward(checked, grad, 8, "adam", True, steps[1]) == 1
    for a, b in zip(fused["values"], checked["values"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dim", [3, 132], ids=["not-float4", "wider-than-128"])
def test_rows_the_fused_kernel_does_not_take_go_through_optimizer_update(dim):
    gen = torch.Generator().manual_seed(13)
    fused, checked = twins(gen, COUNTS, (5, len(COUNTS) - 5), dim, "adam")
    grad = torch.randn(fused["n"], dim, generator=gen).cuda()
    assert backward(fused, grad, dim, "adam", False, torch.zeros(2, dtype=torch.int64)) == 1
    assert backward(checked, grad, dim, "adam", True, torch.zeros(2, dtype=torch.int64)) == 1
    for a, b in zip(fused["values"], checked["values"], strict=True):
        assert torch.equal(a, b)


def test_work_queued_after_the_backward_sees_every_update():
    """On a stream of its own, without a sync: the rows copied right after the backward (on
    that stream) are the updated ones, long keys (summed before the update) included."""
    gen = torch.Generator().manual_seed(14)
    counts = [1, 2, 40, 5, 3000, 1, 700, 9] * 400
    dim = 128
    fused, checked = twins(gen, counts, (1600, 1600), dim, "adam")
    grad = torch.randn(fused["n"], dim, generator=gen).cuda()
    backward(checked, grad, dim, "adam", True, torch.zeros(2, dtype=torch.int64))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        trigger = torch.zeros((), device="cuda", requires_grad=True)
        wired = torch.ops.demb.summed_update(
            trigger, torch.zeros(fused["n"], dim, device="cuda"), fused["order"],
            fused["starts"], None, None, None, fused["slots"], fused["sizes"], fused["values"],
            [dim] * 2, torch.zeros(2, dtype=torch.int64), "adam", OPTIMIZERS["adam"][1], None,
            False, dim, None,
        )  # fmt: skip
        wired.backward(grad)
        copies = [v.clone() for v in fused["values"]]
    torch.cuda.synchronize()
    for a, b in zip(copies, checked["values"], strict=True):
        assert torch.equal(a, b)
