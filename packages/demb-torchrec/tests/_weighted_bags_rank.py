"""One rank of test_weighted_bags.py: a model of four EmbeddingBagCollections of dynamic tables,
``ws`` and ``wm`` built ``is_weighted=True``, ``us`` and ``um`` ``is_weighted=False``, ``*s``
pooling SUM, ``*m`` MEAN, each with two tables (dims 4 and 8), planned by
DynamicEmbeddingShardingPlanner and sharded row-wise under DistributedModelParallel over gloo,
SGD applied in backward. Each rank inserts the keys it owns with known rows (:func:`row`), then
looks up a batch whose KJTs all carry weights: once in eval mode, once in training mode, whose
backward (output gradients :func:`gradient`) updates the rows; and feeds each collection's
dynamic-table kernels one bag of its keys per feature directly, with weights 0.5 and without.
Saves to OUT per collection the eval and training bags and the kernels' (weighted, unweighted)
bags, and every table's keys and rows after the update.

Usage: ``python _weighted_bags_rank.py RANK WORLD STORE OUT``.
"""

from __future__ import annotations

import logging
import warnings

import torch

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

COLLECTIONS = ("ws", "wm", "us", "um")  # (un)weighted, SUM / MEAN
WEIGHTED = {"ws": True, "wm": True, "us": False, "um": False}
POOLING = {"ws": "sum", "wm": "mean", "us": "sum", "um": "mean"}
# per collection: (table, feature, dim), in the collection's feature order
TABLES = {c: ((f"{c}_a", f"f{c}_a", 4), (f"{c}_b", f"f{c}_b", 8)) for c in COLLECTIONS}
NUM_EMBEDDINGS = 64
KEYS = 12  # keys 0..KEYS-1 of each table hold known rows
BATCH = 4  # samples per rank
LR = 0.5


def row(table: str, key: int, dim: int) -> torch.Tensor:
    """The known row of ``key`` in ``table`` (multiples of 1/8: sums stay exact)."""
    offset = COLLECTIONS.index(table[:2]) + 0.25 * (table[-1] == "b")
    return torch.arange(dim, dtype=torch.float32) * 0.25 + key * 0.5 + offset - 1.0


def batch(
    rank: int, collection: str
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """Per feature of ``collection``, this rank's (lengths, values, weights): bags of 0-3 ids
    (repeats included, one full bag), weights multiples of 1/4 from 0.25 to 2."""
    gen = torch.Generator().manual_seed(31 + 4 * rank + COLLECTIONS.index(collection))
    lengths, values, weights = [], [], []
    for _ in TABLES[collection]:
        ln = torch.randint(0, 4, (BATCH,), generator=gen)
        ln[rank % BATCH] = 3
        n = int(ln.sum())
        lengths.append(ln)
        values.append(torch.randint(0, KEYS, (n,), generator=gen))
        weights.append(torch.randint(1, 9, (n,), generator=gen).float() * 0.25)
    return lengths, values, weights


def gradient(rank: int, collection: str, width: int) -> torch.Tensor:
    """The gradient of this rank's ``(BATCH, width)`` bags of ``collection`` (multiples of
    1/4)."""
    gen = torch.Generator().manual_seed(77 + 4 * rank + COLLECTIONS.index(collection))
    return torch.randint(-4, 5, (BATCH, width), generator=gen).float() * 0.25


def main() -> None:
    from _rank_join import join, leave  # beside this script (also loaded as a module by tests)

    rank, world, out_path, device, _ = join(0)
    import _rank_common as common
    from demb_planner import owner_rank
    from demb_torchrec.dump import dynamic_tables
    from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder
    from torch import nn
    from torchrec import KeyedJaggedTensor, PoolingType
    from torchrec.optim import SGD
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    poolings = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.collections = nn.ModuleDict(
                {
                    c: common.bag_collection(
                        [(n, f, d, NUM_EMBEDDINGS) for n, f, d in TABLES[c]],
                        poolings[POOLING[c]],
                        is_weighted=WEIGHTED[c],
                    )
                    for c in COLLECTIONS
                }
            )

        def forward(self, *features: KeyedJaggedTensor) -> list[torch.Tensor]:
            return [
                self.collections[c](f).values() for c, f in zip(COLLECTIONS, features, strict=True)
            ]

    model = Model()
    assert [model.collections[c].is_weighted() for c in COLLECTIONS] == [True, True, False, False]
    apply_optimizer_in_backward(SGD, model.parameters(), {"lr": LR})
    all_configs = common.table_configs(*model.collections.values())
    constraints = {c.name: common.dynamic() for c in all_configs}
    sharder = DynamicEmbeddingBagCollectionSharder()
    dmp = common.shard(model, all_configs, constraints, [sharder], device)
    tables = dynamic_tables(dmp)
    assert sorted(t.name for t in tables) == sorted(n for c in COLLECTIONS for n, _, _ in TABLES[c])
    keys = torch.arange(KEYS)
    mine = keys[torch.from_numpy(owner_rank(keys.numpy(), world, "roundrobin", None)) == rank]
    for t in tables:  # this rank's keys, with their known rows
        config = t.module.tables.configs[t.index]
        assert config.state_dim == 0  # SGD
        rows: list[torch.Tensor | None] = [None] * t.module.num_tables
        rows[t.index] = torch.stack([row(t.name, int(k), config.dim) for k in mine])
        words = max(config.score_layout.index_words) + 1
        scores = torch.zeros((words, mine.numel()), dtype=torch.int64)
        t.module.tables.insert_or_assign(mine, torch.full_like(mine, t.index), scores, rows)

    def kjt(collection: str) -> KeyedJaggedTensor:
        lengths, values, weights = batch(rank, collection)
        names = [f for _, f, _ in TABLES[collection]]
        return common.features(names, lengths, values, device, weights)

    features = [kjt(c) for c in COLLECTIONS]
    dmp.eval()
    with torch.no_grad():
        eval_bags = dmp(*features)
        # Each collection's kernels, fed one bag of this rank's keys per feature directly,
        # with weights 0.5 and without weights.
        kernel_bags = {}
        for c in COLLECTIONS:
            pairs = []
            for kernel in common.dynamic_kernels(dmp.module.collections[c]):
                names = kernel.config.feature_names()
                local = {
                    w: KeyedJaggedTensor(
                        keys=names,
                        values=mine.repeat(len(names)).to(device),
                        lengths=torch.full((len(names),), mine.numel()).to(device),
                        weights=None
                        if w is None
                        else torch.full((len(names) * mine.numel(),), w).to(device),
                    )
                    for w in (None, 0.5)
                }
                pairs.append((kernel(local[0.5]).cpu(), kernel(local[None]).cpu()))
            kernel_bags[c] = pairs
    dmp.train()
    train_bags = dmp(*features)
    grads = [
        gradient(rank, c, b.shape[1]).to(device)
        for c, b in zip(COLLECTIONS, train_bags, strict=True)
    ]
    torch.autograd.backward(train_bags, grads)
    content = {}
    for t in tables:
        export = t.module.tables.export(t.index)
        content[t.name] = (export.keys.cpu(), export.values.cpu())
    torch.save(
        {
            "eval": dict(zip(COLLECTIONS, [b.cpu() for b in eval_bags], strict=True)),
            "train": dict(zip(COLLECTIONS, [b.detach().cpu() for b in train_bags], strict=True)),
            "tables": content,
            "kernels": kernel_bags,
        },
        out_path,
    )
    leave()


if __name__ == "__main__":
    main()
