"""The one-sync admission forward's own logic on the CPU (demb_torchrec._launched_admission), its
two CUDA-only ops replaced by stand-ins built on the CPU ops: the launched dedup by
``dedup_batch`` with its outputs padded to the batch's size with junk past the unique keys (and
its go flag cleared when the keys span more bits than the module's guess, as the CUDA sort
clears it), the gated insert by ``find_or_insert`` of the first ``U`` rows. Against the same
module on the ordinary path: identical outputs, tables, counters, toss indices and admission
counts, a fallback (the junk and the masks reach nothing; the toss index is set back) included.
The ops themselves are tested on CUDA (test_admission_launched.py)."""

from __future__ import annotations

import demb_torchrec._find_or_insert as fi
import demb_torchrec._launched as launched_mod
import demb_torchrec._launched_admission as la
import pytest
import torch
from _launch_streams import (
    admission_state,
    admission_strategy,
    fake_dedup_launch,
    launch_batches,
)
from demb_torchrec import (
    DynamicEmbeddingTables,
    DynamicEmbPoolingMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
)


def fake_find_or_insert_launched(table, launched, score_args, *, counts=True, skips=False):
    words = launched.info.tolist()
    u, go = words[-3], words[-2]
    if not go:
        return None, words
    outcome = table.find_or_insert(
        launched.keys[:u],
        launched.tables[:u],
        counts=launched.counts[:u] if counts else None,
        zero_new_rows=False,
        check=False,
        count_failures=False,
        score_args=score_args,
        skips=skips,
    )
    return outcome, words


def module(mode, kind, both):
    def opts(admits):
        return DynamicEmbTableOptions(  # STEP scores: the two modules' clocks would differ
            dim=8,
            max_capacity=256,
            bucket_capacity=128,
            admit_strategy=admission_strategy(kind) if admits else None,
            score_strategy=DynamicEmbScoreStrategy.STEP,
        )

    return DynamicEmbeddingTables(
        [opts(both), opts(True)],  # both: one admitter over both tables; else the second's
        feature_table_map=[0, 1, 1],
        pooling_mode=mode,
        optimizer="adam",
        learning_rate=0.05,
        seed=3,
    )


@pytest.mark.parametrize("mode", [DynamicEmbPoolingMode.NONE, DynamicEmbPoolingMode.SUM])
@pytest.mark.parametrize("kind", ["frequency", "probabilistic"])
@pytest.mark.parametrize("both", [True, False])
def test_the_one_sync_logic_equals_the_ordinary_path(mode, kind, both, monkeypatch):
    monkeypatch.setattr(launched_mod, "dedup_launch", fake_dedup_launch)
    monkeypatch.setattr(la, "find_or_insert_launched", fake_find_or_insert_launched)
    real_init = fi.FindOrInsert.__init__

    def init(self, s):
        real_init(self, s)
        self._launches = True

    monkeypatch.setattr(fi.FindOrInsert, "__init__", init)
    one = module(mode, kind, both)  # its paths' lookups made now: they take the one-sync logic
    monkeypatch.setattr(fi.FindOrInsert, "__init__", real_init)
    two = module(mode, kind, both)  # the ordinary path (a CPU module)
    assert not one.tables.may_grow
    real = fi.launched_admitted
    used: list[bool] = []

    def route(s, bags):
        out = real(s, bags)
        used.append(out is not None)
        return out

    monkeypatch.setattr(fi, "launched_admitted", route)
    gen = torch.Generator().manual_seed(11)
    batches = launch_batches(gen, steps=8, wide=4, narrow_from=6, key_range=600)
    for indices, offsets in batches:
        outs = [m(indices, offsets) for m in (one, two)]
        assert torch.equal(outs[0], outs[1])
        grad = torch.randn(outs[0].shape, generator=gen)
        for out in outs:
            out.backward(grad)
        for a, b in zip(admission_state(one), admission_state(two), strict=True):
            assert torch.equal(a, b)
    assert one.tables.steps == two.tables.steps
    assert int(one.admission.read_counts()["rejected"].sum()) > 0
    assert True in used  # the one-sync logic ran
    assert False in used  # and fell back (the batch of wide keys), nothing changed by it
