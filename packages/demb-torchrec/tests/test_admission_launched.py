"""The CUDA training forward with admission and one sync (demb_torchrec._launched_admission: the
dedup leaves its sizes on the device, the find, the admitters and the insert run on the batch's
full size with the rows past its unique keys masked, one read-back at the end) against the same
module forced onto the two-sync path (dedup_batch, then the rest): bit-identical outputs,
tables, counters, toss indices and admission counts over steps with new keys, counter and table
evictions, a batch whose keys outgrow the dedup's key-bits guess (the one-sync path then falls
back, its toss index rewound) and all-hit batches; a bad batch raises and changes nothing
(marker ``cuda``). The CPU against CUDA comparison of admission (whose CUDA module takes this
path: its tables cannot grow) is test_admission_module.py's."""

from __future__ import annotations

import demb_torchrec._find_or_insert as fi
import pytest
import torch
from _launch_streams import admission_state, admission_strategy, launch_batches, launch_module
from demb_torchrec import (
    DynamicEmbPoolingMode,
)

pytestmark = pytest.mark.cuda


def module(mode, kind, seed=3):
    return launch_module(mode, seed, admit_strategy=admission_strategy(kind))


def batches(gen):
    return launch_batches(gen, steps=8, wide=4, narrow_from=6, key_range=600)


def assert_same(a, b):
    for x, y in zip(admission_state(a), admission_state(b), strict=True):
        assert torch.equal(x.cpu(), y.cpu())


@pytest.mark.parametrize("mode", [DynamicEmbPoolingMode.NONE, DynamicEmbPoolingMode.SUM])
@pytest.mark.parametrize("kind", ["frequency", "probabilistic"])
def test_one_sync_admission_equals_the_two_sync_admission(mode, kind, monkeypatch):
    one, two = module(mode, kind), module(mode, kind)
    assert not one.tables.may_grow
    assert one.admission.rewindable
    real = fi.launched_admitted
    used: list[bool] = []

    def route(s, bags):  # s: the module's ForwardState
        if s.tables is two.tables:
            return None  # the two-sync path
        out = real(s, bags)
        used.append(out is not None)
        return out

    monkeypatch.setattr(fi, "launched_admitted", route)
    gen = torch.Generator().manual_seed(11)
    for cpu_indices, cpu_offsets in batches(gen):
        indices, offsets = cpu_indices.cuda(), cpu_offsets.cuda()
        outs = [m(indices, offsets) for m in (one, two)]
        assert torch.equal(outs[0], outs[1])
        grad = torch.randn_like(outs[0])
        for out in outs:
            out.backward(grad)
        assert_same(one, two)
    assert one.tables.steps == two.tables.steps
    rejected = one.admission.read_counts()["rejected"]
    assert int(rejected.sum()) > 0  # some keys were kept out
    assert True in used  # the one-sync path ran
    assert False in used  # and fell back once (the batch of wide keys)


def test_a_bad_batch_raises_and_changes_nothing():
    m = module(DynamicEmbPoolingMode.NONE, "probabilistic")
    offsets = torch.tensor([0, 1, 2, 3], device="cuda")
    m(torch.tensor([1, 2, 3], device="cuda"), offsets).sum().backward()
    before = admission_state(m)
    steps = list(m.tables.steps)
    with pytest.raises(ValueError, match="empty-key sentinel"):
        m(torch.tensor([1, -1, 5], device="cuda"), offsets)
    with pytest.raises(ValueError, match="offsets"):
        m(torch.tensor([1, 4, 5], device="cuda"), torch.tensor([0, 2, 1, 3], device="cuda"))
    assert m.tables.steps == steps
    for a, b in zip(admission_state(m), before, strict=True):
        assert torch.equal(a.cpu(), b.cpu())
