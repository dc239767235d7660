"""One rank of test_cache_delta_ranks.py: deltas of caching tables over gloo CPU ranks.

Every rank builds the same model twice (A and B): an EmbeddingCollection of two caching tables
(``ua``: TIMESTAMP, ``ub``: (TIMESTAMP, LFU); a device cache of 16 rows a rank over a host
table, Adam applied in backward), planned and sharded row-wise under DistributedModelParallel.
Only A is trained. For each of WINDOWS windows: A trains STEPS steps on random keys (more than
the caches hold: rows move between the tiers); ``incremental_dump(A, threshold, pg=WORLD)``
is replayed into B with ``replay_increment``, and on every rank the union of B's tiers must
equal A's: the same keys, rows (embedding and Adam state) and score columns. This rank upserts
exactly the delta's keys it owns and skips the others.

Usage: ``python _cache_delta_rank.py RANK WORLD STORE OUT WINDOWS``
"""

from __future__ import annotations

import logging
import warnings

import torch

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

TABLES = (("ua", "fa", 8, 300), ("ub", "fb", 8, 300))  # name, feature, dim, rows per rank
KEY_RANGE = 250
BATCH = 16
STEPS = 3


def main() -> None:
    from _rank_join import join, leave  # beside this script

    rank, world, out_path, device, (windows_arg,) = join(1)
    windows = int(windows_arg)
    import _rank_common as common
    import torch.distributed as dist
    from demb_planner import owner_rank
    from demb_torchrec import (
        DynamicEmbScoreStrategy,
        get_score,
        incremental_dump,
        replay_increment,
    )
    from demb_torchrec.dump import dynamic_tables
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder
    from torchrec.optim import Adam
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    s = DynamicEmbScoreStrategy
    strategies = {"ua": s.TIMESTAMP, "ub": (s.TIMESTAMP, s.LFU)}
    tables = tuple((n, f, d, r * world) for n, f, d, r in TABLES)
    row_bytes = 8 * 3 * 4  # Adam: embedding and two state columns, float32

    def build() -> torch.nn.Module:
        model = common.sequence_collection(tables)
        apply_optimizer_in_backward(Adam, model.parameters(), {"lr": 0.05})
        constraints = {
            n: common.dynamic(
                score_strategy=strategies[n],
                bucket_capacity=16,
                caching=True,
                global_hbm_for_values=16 * row_bytes * world,
            )
            for n, _, _, _ in TABLES
        }
        configs = common.table_configs(model)
        sharder = DynamicEmbeddingCollectionSharder()
        return common.shard(model, configs, constraints, [sharder], device)

    def train_step(model: torch.nn.Module, window: int, step: int) -> None:
        gen = torch.Generator().manual_seed(((window * STEPS + step) * 8 + rank) * 2)
        lengths, values = [], []
        for _ in TABLES:
            ln = torch.randint(1, 4, (BATCH,), generator=gen)
            lengths.append(ln)
            values.append(torch.randint(0, KEY_RANGE, (int(ln.sum()),), generator=gen))
        kjt = common.features([f for _, f, _, _ in TABLES], lengths, values, device)
        out = model(kjt)
        sum(out[f].values().square().sum() for _, f, _, _ in TABLES).backward()

    def union(t: object) -> tuple[torch.Tensor, ...]:
        cache = t.module.cache  # type: ignore[attr-defined]
        ex = cache.export(t.index)  # type: ignore[attr-defined]
        order = torch.argsort(ex.keys)
        return ex.keys[order], ex.values[order], ex.scores[order]

    a, b = build(), build()
    threshold = get_score(a)
    counts = []
    for window in range(windows):
        for step in range(STEPS):
            train_step(a, window, step)
        deltas = incremental_dump(a, threshold, pg=dist.group.WORLD)
        stats = replay_increment(b, deltas)
        threshold = {
            c: {r.table_names[i]: int(r.meta[i]["current_score"]) for i in range(len(r.keys))}
            for c, r in deltas.items()
        }
        per_table = {}
        ta = {t.name: t for t in dynamic_tables(a)}
        tb = {t.name: t for t in dynamic_tables(b)}
        for collection, delta in deltas.items():
            for i, name in enumerate(delta.table_names):
                keys = delta.keys[i]
                mine = int((owner_rank(keys.numpy(), world, "roundrobin") == rank).sum())
                st = stats[collection][name]
                assert (st.upserted, st.skipped) == (mine, keys.numel() - mine), (
                    f"rank {rank} window {window} {name}: {st}; {mine} of {keys.numel()} mine"
                )
                slots = delta.meta[i]["slot_index"]
                parts = zip(
                    ("keys", "rows", "scores"), union(ta[name]), union(tb[name]), strict=True
                )
                for part, x, y in parts:
                    assert torch.equal(x, y), f"rank {rank} window {window} {name}: {part} differ"
                per_table[name] = {
                    "rows": keys.numel(),
                    "upserted": st.upserted,
                    "below": int((slots == -1).sum()),
                    "cached": int((slots >= 0).sum()),
                }
        counts.append(per_table)
    torch.save({"windows": counts}, out_path)
    leave()


if __name__ == "__main__":
    main()
