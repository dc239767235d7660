"""One rank of test_replay_ranks.py: online training's A/B replica pattern over gloo CPU ranks.

Every rank builds the same model three times (A, B and, on 2 or more ranks, C): an
EmbeddingCollection of two dynamic tables (``ua``: TIMESTAMP, roundrobin, evictions retained;
``ub``: (TIMESTAMP, LFU), roundrobin: a collection's tables share their dist_type) and an
EmbeddingBagCollection of one (``ia``: STEP, hash_roundrobin, evictions retained), planned and
sharded row-wise under
DistributedModelParallel, Adam applied in backward. Each rank's shard of a table is a few
buckets of 16 slots (``init_capacity = max_capacity``, the same on every rank: no table grows),
so the random keys of each window evict keys. Only A is trained.

For each of WINDOWS windows: A trains STEPS steps on fresh random keys (in window
``ERASE_WINDOW``, ``erase_keys`` removes keys A holds, old ones that B holds too and new ones
that it does not, after the first step; the next step feeds some of them again); then
``incremental_dump(A, threshold, pg=WORLD)`` is replayed into B with ``replay_increment`` and,
on every rank, B's tables must equal A's bit for bit: each table's index slice (keys, digests,
score words, size) and the value rows (embedding and Adam state) at its occupied slots. The
replay's counts are checked against the gathered delta: this rank upserts exactly the delta's
keys it owns and skips the others.

At the end (2 or more ranks), rank ``r``'s own delta since the first threshold
(``incremental_dump(A, start, pg=None)``: every row it holds) goes to rank ``(r + 1) % world``
and is replayed there into the untrained C: every key is another rank's, so nothing is
upserted and C stays empty.

A mismatch raises AssertionError (the rank fails, its log in the test's message). Saves to OUT
``{"windows": [per window {(collection, table): counts}], "handoff": {...} or None}`` for the
test's checks over the ranks.

Usage: ``python _replay_rank.py RANK WORLD STORE OUT WINDOWS``
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

EC_TABLES = (("ua", "fa", 8, 64), ("ub", "fb", 8, 64))  # name, feature, dim, rows per rank
EBC_TABLES = (("ia", "fc", 8, 48),)
KEY_RANGE = {"fa": 600, "fb": 400, "fc": 500}
"""Half the keys of each feature are drawn from ``[0, KEY_RANGE)`` (more than the tables hold:
evictions), half from the hot ``[0, HOT)`` (keys touched again in later windows)."""
HOT = 48
BATCH = 8
STEPS = 3
ERASE_WINDOW = 2
EMPTY = -1


def batch_keys(
    window: int, step: int, rank: int, feature: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lengths and keys of ``feature`` in one step's batch of ``rank``."""
    seed = ((window * STEPS + step) * 8 + rank) * 4 + sorted(KEY_RANGE).index(feature)
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (BATCH,), generator=gen)
    n = int(lengths.sum())
    cold = torch.randint(0, KEY_RANGE[feature], (n,), generator=gen)
    hot = torch.randint(0, HOT, (n,), generator=gen)
    return lengths, torch.where(torch.rand(n, generator=gen) < 0.5, hot, cold)


def main() -> None:
    from _rank_join import join, leave  # beside this script

    rank, world, out_path, device, (windows_arg,) = join(1)
    windows = int(windows_arg)
    import _rank_common as common
    import torch.distributed as dist
    from demb_planner import owner_rank
    from demb_torchrec import (
        DynamicEmbInitializerArgs,
        DynamicEmbInitializerMode,
        DynamicEmbScoreStrategy,
        EvictedItemMode,
        erase_keys,
        get_score,
        incremental_dump,
        replay_increment,
    )
    from demb_torchrec.dump import dynamic_tables
    from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder as BagSharder
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder as SequenceSharder
    from torch import nn
    from torchrec import KeyedJaggedTensor
    from torchrec.optim import Adam
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    strategies = DynamicEmbScoreStrategy
    retain = EvictedItemMode.RETAIN_KEY
    discard = EvictedItemMode.DISCARD
    per_table = {  # score strategy, dist_type, evicted_item_mode
        "ua": (strategies.TIMESTAMP, "roundrobin", retain),
        "ub": ((strategies.TIMESTAMP, strategies.LFU), "roundrobin", discard),
        "ia": (strategies.STEP, "hash_roundrobin", retain),
    }
    ec_tables = tuple((n, f, d, r * world) for n, f, d, r in EC_TABLES)
    ebc_tables = tuple((n, f, d, r * world) for n, f, d, r in EBC_TABLES)
    dist_types = {n: v[1] for n, v in per_table.items()}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = common.sequence_collection(ec_tables)
            self.ebc = common.bag_collection(ebc_tables)

        def forward(self, seq: KeyedJaggedTensor, pooled: KeyedJaggedTensor) -> torch.Tensor:
            rows = self.ec(seq)
            loss = sum(rows[f].values().square().sum() for _, f, _, _ in EC_TABLES)
            return loss + self.ebc(pooled).values().square().sum()

    def build() -> nn.Module:
        model = Model()
        apply_optimizer_in_backward(Adam, model.parameters(), {"lr": 0.05})
        init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.1)
        constraints = {
            n: common.dynamic(
                initializer_args=init,
                score_strategy=strategy,
                dist_type=dist_type,
                evicted_item_mode=mode,
                bucket_capacity=16,
            )
            for n, (strategy, dist_type, mode) in per_table.items()
        }
        sharders = [SequenceSharder(), BagSharder()]
        configs = common.table_configs(model.ec, model.ebc)
        return common.shard(model, configs, constraints, sharders, device)

    def train_step(
        model: nn.Module, window: int, step: int, extra: dict[str, torch.Tensor]
    ) -> None:
        def kjt(tables: tuple[tuple[str, str, int, int], ...]) -> KeyedJaggedTensor:
            lengths, values = [], []
            for name, feature, _, _ in tables:
                ln, keys = batch_keys(window, step, rank, feature)
                more = extra.get(name)
                if more is not None and more.numel():  # one more bag of these keys
                    ln = torch.cat([ln, torch.tensor([more.numel()])])
                    keys = torch.cat([keys, more])
                else:
                    ln = torch.cat([ln, torch.zeros(1, dtype=torch.int64)])
                lengths.append(ln)
                values.append(keys)
            return common.features([f for _, f, _, _ in tables], lengths, values, device)

        model(kjt(EC_TABLES), kjt(EBC_TABLES)).backward()

    def by_name(model: nn.Module) -> dict[tuple[str, str], Any]:
        return {(t.collection, t.name): t for t in dynamic_tables(model)}

    def held(t: Any) -> torch.Tensor:
        return t.module.tables.export(t.index).keys.cpu()

    def check_equal(a: nn.Module, b: nn.Module, where: str) -> None:
        ta, tb = by_name(a), by_name(b)
        assert ta.keys() == tb.keys(), f"{where}: tables {sorted(ta)} vs {sorted(tb)}"
        for name, x in ta.items():
            y = tb[name]
            ia, ib = x.module.tables.index, y.module.tables.index
            lo, hi = ia.slot_range(x.index)
            assert ib.slot_range(y.index) == (lo, hi), f"{where} {name}: slot ranges differ"
            keys_a, keys_b = ia.keys[lo:hi], ib.keys[lo:hi]
            if not torch.equal(keys_a, keys_b):
                bad = (keys_a != keys_b).nonzero().flatten()
                s = int(bad[0])
                raise AssertionError(
                    f"rank {rank} {where} {name}: {bad.numel()} of {hi - lo} slots hold other "
                    f"keys in B, first slot {s}: A {int(keys_a[s])}, B {int(keys_b[s])}"
                )
            for field in ("digests", "scores"):
                fa, fb = getattr(ia, field)[..., lo:hi], getattr(ib, field)[..., lo:hi]
                if not torch.equal(fa, fb):
                    cols = (fa != fb).reshape(-1, hi - lo).any(0).nonzero().flatten()
                    s = int(cols[0])
                    raise AssertionError(
                        f"rank {rank} {where} {name}: {field} differ at {cols.numel()} slots, "
                        f"first slot {s} (key {int(keys_a[s])}): A {fa[..., s].tolist()}, "
                        f"B {fb[..., s].tolist()}"
                    )
            size_a, size_b = int(ia.sizes[x.index]), int(ib.sizes[y.index])
            assert size_a == size_b, f"rank {rank} {where} {name}: size A {size_a}, B {size_b}"
            occupied = keys_a != EMPTY
            assert size_a == int(occupied.sum()), f"{where} {name}: A's size != occupied slots"
            rows_a = x.module.tables.values[x.index][occupied]
            rows_b = y.module.tables.values[y.index][occupied]
            if not torch.equal(rows_a, rows_b):
                bad = (rows_a != rows_b).any(1).nonzero().flatten()
                keys = keys_a[occupied][bad]
                raise AssertionError(
                    f"rank {rank} {where} {name}: {bad.numel()} of {size_a} rows differ, keys "
                    f"{keys[:5].tolist()}; first A {rows_a[bad[0]].tolist()} "
                    f"B {rows_b[bad[0]].tolist()}"
                )

    a, b = build(), build()
    start = get_score(a)
    assert start is not None
    threshold = start
    results: list[dict[tuple[str, str], dict[str, int]]] = []
    for window in range(windows):
        erased_now: dict[tuple[str, str], torch.Tensor] = {}
        extra: dict[str, torch.Tensor] = {}
        for step in range(STEPS):
            train_step(a, window, step, extra)
            extra = {}
            if window == ERASE_WINDOW and step == 0:
                ta, tb = by_name(a), by_name(b)
                request: dict[str, dict[str, torch.Tensor]] = {}
                for (collection, name), t in ta.items():
                    keys = held(t)
                    in_b = torch.isin(keys, held(tb[(collection, name)]))
                    pick = torch.cat([keys[in_b][:4], keys[~in_b][:2]])
                    request.setdefault(collection, {})[name] = pick
                    erased_now[(collection, name)] = pick
                    extra[name] = pick[::2]  # fed again by the next step
                removed = erase_keys(a, request)
                for (collection, name), pick in erased_now.items():
                    assert removed[collection][name] == pick.numel(), (
                        f"erase_keys removed {removed[collection][name]} of {pick.numel()} keys "
                        f"A holds ({collection}/{name})"
                    )
        held_before = {k: held(t) for k, t in by_name(b).items()}
        deltas = incremental_dump(a, threshold, pg=dist.group.WORLD)
        stats = replay_increment(b, deltas)
        threshold = {
            c: {r.table_names[i]: int(r.meta[i]["current_score"]) for i in range(len(r.keys))}
            for c, r in deltas.items()
        }
        where = f"window {window}"
        check_equal(a, b, where)
        window_result = {}
        for collection, delta in deltas.items():
            for i, name in enumerate(delta.table_names):
                keys = delta.keys[i]
                assert torch.unique(keys).numel() == keys.numel(), f"{where} {name}: repeated keys"
                mine = int((owner_rank(keys.numpy(), world, dist_types[name]) == rank).sum())
                st = stats[collection][name]
                assert (st.upserted, st.skipped) == (mine, keys.numel() - mine), (
                    f"rank {rank} {where} {collection}/{name}: {st}, but the delta's "
                    f"{keys.numel()} keys include {mine} this rank owns"
                )
                erased = delta.erased_keys[i]
                erased = torch.zeros(0, dtype=torch.int64) if erased is None else erased
                own_erased = erased_now.get((collection, name), torch.zeros(0, dtype=torch.int64))
                evicted = delta.evicted_keys[i]
                window_result[(collection, name)] = {
                    "rows": keys.numel(),
                    "upserted": st.upserted,
                    "skipped": st.skipped,
                    "erased": st.erased,
                    "erased_keys": sorted(erased.tolist()),
                    "own_erased": sorted(own_erased.tolist()),
                    "erased_held_by_b": int(
                        torch.isin(own_erased, held_before[(collection, name)]).sum()
                    ),
                    "evicted": None if evicted is None else evicted.numel(),
                    "keys": sorted(keys.tolist()),
                }
        results.append(window_result)

    handoff = None
    if world >= 2:
        c = build()
        own = incremental_dump(a, start, pg=None)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, own)
        source = (rank - 1) % world
        got = everyone[source]
        stats = replay_increment(c, got)
        handoff = {}
        ta = by_name(a)
        for collection, delta in got.items():
            for i, name in enumerate(delta.table_names):
                keys = delta.keys[i]
                st = stats[collection][name]
                assert (st.upserted, st.erased, st.skipped) == (0, 0, keys.numel()), (
                    f"rank {rank}: {collection}/{name} of rank {source}'s own delta ({keys.numel()}"
                    f" keys): {st}"
                )
                handoff[(collection, name)] = keys.numel()
        for collection, delta in own.items():  # every row this rank holds
            for i, name in enumerate(delta.table_names):
                mine = held(ta[(collection, name)])
                assert torch.equal(torch.sort(delta.keys[i]).values, torch.sort(mine).values), (
                    f"rank {rank}: its own delta of {collection}/{name} since the start has "
                    f"{delta.keys[i].numel()} keys, the table holds {mine.numel()}"
                )
        for name, t in by_name(c).items():
            index = t.module.tables.index
            lo, hi = index.slot_range(t.index)
            assert bool((index.keys[lo:hi] == EMPTY).all()), f"rank {rank}: C's {name} holds keys"
            assert int(index.sizes[t.index]) == 0, f"rank {rank}: C's {name} has a size"
            assert not bool(index.digests[lo:hi].any()), f"rank {rank}: C's {name} has digests"
            assert not bool(index.scores[:, lo:hi].any()), f"rank {rank}: C's {name} has scores"
    torch.save({"windows": results, "handoff": handoff}, out_path)
    leave()


if __name__ == "__main__":
    main()
