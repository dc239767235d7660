"""Deltas of caching tables on 2 and (``slow``) 1 and 4 CPU ranks (gloo): each window's
gathered ``incremental_dump`` of a trained sharded model A, replayed into an untrained B built
alike, leaves the union of B's tiers equal to A's on every rank (keys, rows with Adam state,
score columns), each rank upserting exactly the delta's keys it owns. The equality checks run
in the ranks (``_cache_delta_rank.py``); this test checks the counts over the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

RANK_SCRIPT = Path(__file__).with_name("_cache_delta_rank.py")
WINDOWS = 3


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)]
)
def test_gathered_caching_deltas_replay_into_an_equal_replica(run_ranks, world):
    results = run_ranks(RANK_SCRIPT, world, str(WINDOWS))
    for window in range(WINDOWS):
        for name in ("ua", "ub"):
            rows = [r["windows"][window][name] for r in results]
            first = rows[0]
            assert all(r["rows"] == first["rows"] for r in rows)  # one gathered delta
            assert sum(r["upserted"] for r in rows) == first["rows"]  # each key on its owner
            assert first["below"] > 0, f"window {window} {name}: no row below the caches"
            assert first["cached"] > 0, f"window {window} {name}: no row in the caches"
