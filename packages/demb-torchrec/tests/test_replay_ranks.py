"""Online training's replica pattern on 2 and (``slow``) 1 and 4 CPU ranks (gloo): each window's
``incremental_dump`` of a trained model A, gathered over the ranks, replayed with
``replay_increment`` into an untrained model B built alike, leaves B's dynamic tables equal to
A's bit for bit on every rank (index slices, and embeddings with Adam state at occupied slots),
through evictions and an ``erase_keys`` call; each rank upserts exactly the delta's keys it owns
and skips the rest. On 2 and 4 ranks, a rank's own (ungathered) delta replayed on the next rank
upserts nothing there. The equality checks run in the ranks (``_replay_rank.py``); this test
checks the counts over the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

RANK_SCRIPT = Path(__file__).with_name("_replay_rank.py")
WINDOWS = 4
ERASE_WINDOW = 2
TABLES = {("ec", "ua"), ("ec", "ub"), ("ebc", "ia")}
RETAINING = {("ec", "ua"), ("ebc", "ia")}


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "world", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(4, marks=pytest.mark.slow)]
)
def test_gathered_deltas_replay_into_an_equal_replica(run_ranks, world):
    results = run_ranks(RANK_SCRIPT, world, str(WINDOWS))
    evicted = dict.fromkeys(RETAINING, 0)
    for window in range(WINDOWS):
        per_rank = [r["windows"][window] for r in results]
        for name in TABLES:
            rows = [p[name] for p in per_rank]
            first = rows[0]
            assert first["rows"] > 0, f"window {window} {name}: an empty delta"
            for r, row in enumerate(rows):  # every rank got the same gathered delta
                assert row["keys"] == first["keys"], f"window {window} {name}: rank {r}"
                assert row["erased_keys"] == first["erased_keys"], f"window {window} {name}"
                assert row["upserted"] + row["skipped"] == row["rows"]
            assert sum(row["upserted"] for row in rows) == first["rows"], (
                f"window {window} {name}: {[row['upserted'] for row in rows]} upserted of "
                f"{first['rows']} rows"
            )
            own_erased = sorted(k for row in rows for k in row["own_erased"])
            assert first["erased_keys"] == own_erased, f"window {window} {name}"
            if window == ERASE_WINDOW:
                held_by_b = sum(row["erased_held_by_b"] for row in rows)
                assert held_by_b > 0, f"{name}: the erase should take keys B holds"
                assert len(own_erased) > held_by_b, f"{name}: and keys B does not hold"
                assert sum(row["erased"] for row in rows) >= held_by_b
            else:
                assert own_erased == [], f"window {window} {name}"
                assert all(row["erased"] == 0 for row in rows), f"window {window} {name}"
            if name in RETAINING:
                evicted[name] += sum(row["evicted"] for row in rows)
            else:
                assert all(row["evicted"] is None for row in rows)
    assert all(n > 0 for n in evicted.values()), f"no evictions: {evicted}"
    handoffs = [r["handoff"] for r in results]
    if world == 1:
        assert handoffs == [None]
    else:
        assert all(h is not None and h.keys() == TABLES for h in handoffs)
        assert all(n > 0 for h in handoffs for n in h.values())
