"""The CUDA training forward with one sync (demb_torchrec._launched: the dedup leaves its sizes on
the device, one read-back after the lookup) against the same module forced onto the two-sync
path (dedup_batch, then find_or_insert): bit-identical outputs, tables and steps over steps with
new keys, evictions, a batch whose keys outgrow the dedup's key-bits guess (the one-sync path
then falls back) and all-hit batches; a bad batch raises and changes nothing; the read-backs
with PyTorch's pinned memory registered instead of allocated (marker ``cuda``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import demb_torchrec._find_or_insert as fi
import pytest
import torch
from _launch_streams import launch_batches, launch_module
from demb_kernels.table import timestamp
from demb_torchrec import (
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
)

pytestmark = pytest.mark.cuda


def module(mode, strategy, seed=3):
    return launch_module(mode, seed, score_strategy=strategy)


def batches(gen):
    return launch_batches(gen)


def table_state(m):
    state = []
    for t in range(m.num_tables):
        ex = m.tables.export(t)
        order = torch.argsort(ex.keys)
        state += [ex.keys[order], ex.scores[order], ex.values[order]]
    return state


@pytest.mark.parametrize("mode", list(DynamicEmbPoolingMode))
@pytest.mark.parametrize("strategy", [DynamicEmbScoreStrategy.STEP, DynamicEmbScoreStrategy.LFU])
def test_one_sync_forward_equals_the_two_sync_forward(mode, strategy, monkeypatch):
    one, two = module(mode, strategy), module(mode, strategy)
    real = fi.launched_find_or_insert
    used: list[bool] = []

    counted: list[bool] = []

    def route(state, *args):  # state: the module's ForwardState
        if state.tables is two.tables:
            return None  # the two-sync path
        out = real(state, *args)
        used.append(out is not None)
        if out is not None:  # counts are made only for tables that read them (LFU)
            counted.append(out[0].counts is not None)
        return out

    monkeypatch.setattr(fi, "launched_find_or_insert", route)
    gen = torch.Generator().manual_seed(11)
    for cpu_indices, cpu_offsets in batches(gen):
        indices, offsets = cpu_indices.cuda(), cpu_offsets.cuda()
        counters = torch.randint(1, 4, indices.shape, device="cuda")
        lfu = strategy is DynamicEmbScoreStrategy.LFU
        outs = [m(indices, offsets, None, counters if lfu else None) for m in (one, two)]
        assert torch.equal(outs[0], outs[1])
        grad = torch.randn_like(outs[0])
        for out in outs:
            out.backward(grad)
        for a, b in zip(table_state(one), table_state(two), strict=True):
            assert torch.equal(a, b)
    assert one.steps == two.steps == [8, 8]
    assert one.tables.steps == two.tables.steps
    assert True in used  # the one-sync path ran
    assert False in used  # and fell back once (the batch of wide keys)
    assert counted == [strategy is DynamicEmbScoreStrategy.LFU] * len(counted)


def test_modules_trained_from_two_threads_at_once_match_one_trained_alone():
    """Each thread reads back through pinned scratch of its own (PinnedScratch): two threads
    training a module each over the same batches at once, forward and backward on the calling
    thread, end with the tables and outputs of a module trained alone."""
    gen = torch.Generator().manual_seed(5)
    data = [(i.cuda(), o.cuda()) for i, o in batches(gen)]
    grads = [torch.randn(int(o[-1]), 8, generator=gen).cuda() for _, o in data]

    def train(m, outs):
        with torch.autograd.set_multithreading_enabled(False):
            for (indices, offsets), grad in zip(data, grads, strict=True):
                out = m(indices, offsets)
                outs.append(out.detach().clone())
                out.backward(grad)
        torch.cuda.synchronize()

    mode, strategy = DynamicEmbPoolingMode.NONE, DynamicEmbScoreStrategy.STEP
    alone, alone_outs = module(mode, strategy), []
    train(alone, alone_outs)
    pair = [module(mode, strategy), module(mode, strategy)]
    pair_outs: list[list[torch.Tensor]] = [[], []]
    errors: list[BaseException] = []

    def run(k):
        try:
            train(pair[k], pair_outs[k])
        except BaseException as e:  # re-raised below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for m, outs in zip(pair, pair_outs, strict=True):
        for got, want in zip(outs, alone_outs, strict=True):
            assert torch.equal(got, want)
        for a, b in zip(table_state(m), table_state(alone), strict=True):
            assert torch.equal(a, b)


def test_a_bad_batch_raises_and_changes_nothing():
    m = module(DynamicEmbPoolingMode.NONE, DynamicEmbScoreStrategy.STEP)
    offsets = torch.tensor([0, 1, 2, 3], device="cuda")
    m(torch.tensor([1, 2, 3], device="cuda"), offsets).sum().backward()
    before = table_state(m)
    steps = list(m.tables.steps)
    with pytest.raises(ValueError, match="empty-key sentinel"):
        m(torch.tensor([1, -1, 5], device="cuda"), offsets)
    with pytest.raises(ValueError, match="offsets"):
        m(torch.tensor([1, 4, 5], device="cuda"), torch.tensor([0, 2, 1, 3], device="cuda"))
    assert m.tables.steps == steps
    for a, b in zip(table_state(m), before, strict=True):
        assert torch.equal(a, b)


def test_timed_scores_come_from_the_dedups_clock(monkeypatch):
    """With every table scoring by the clock (TIMESTAMP), the one-sync forward takes the batch's
    scores from the GPU timer its dedup's first kernel read (dedup_launch's clock words), not
    from a launch of their own (next_score_args is never called): every key the step touched
    scores one reading, taken between two readings of the GPU timer before and after it."""
    m = module(DynamicEmbPoolingMode.NONE, DynamicEmbScoreStrategy.TIMESTAMP)
    assert m.tables.scores_from_gpu_clock

    def not_called(self):
        raise AssertionError("next_score_args: the one-sync forward reads the dedup's clock")

    monkeypatch.setattr(type(m.tables), "next_score_args", not_called)
    offsets = torch.tensor([0, 2, 3, 5], device="cuda")
    for indices in ([1, 2, 3, 4, 5], [2, 7, 7, 9, 1]):  # new keys, then some found again
        before = int(timestamp("cuda"))
        m(torch.tensor(indices, device="cuda"), offsets).sum().backward()
        after = int(timestamp("cuda"))
        touched = {0: set(indices[:2]), 1: set(indices[2:])}
        for t, keys in touched.items():
            ex = m.tables.export(t)
            mine = torch.isin(ex.keys, torch.tensor(sorted(keys), device="cuda"))
            scores = ex.scores[mine, 0].unique().tolist()
            assert int(mine.sum()) == len(keys)
            assert len(scores) == 1, (t, scores)
            assert before <= scores[0] <= after, (t, scores, before, after)


def test_the_read_backs_work_with_registered_pinned_memory():
    """The forward's read-back of its sizes and the backward's NaN/inf flag are copied into
    pinned memory by a kernel storing through the buffer's device mapping (demb-kernels'
    PinnedScratch, a block from PyTorch's pinned allocator kept per thread). With PyTorch's
    pinned memory made by cudaHostRegister instead of
    cudaHostAlloc (``pinned_use_cuda_host_register``), the one-sync forward and the NaN check
    still pass their tests: in a child process, as the allocator reads its settings once."""
    behaviour = Path(__file__).with_name("test_module_behaviour.py")
    tests = [
        f"{__file__}::test_one_sync_forward_equals_the_two_sync_forward",
        f"{behaviour}::test_a_nan_gradient_is_rejected_and_no_row_changes",
    ]
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "pinned_use_cuda_host_register:True"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda"]
    done = subprocess.run(
        [*command, *tests], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout, done.stdout[-2000:]
    assert "skipped" not in done.stdout, done.stdout[-2000:]
