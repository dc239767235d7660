"""One rank of test_eval_build.py: a model of three collections of dynamic tables, sharded
row-wise under DistributedModelParallel over gloo: ``seq`` (an EmbeddingCollection), ``bags``
(an EmbeddingBagCollection, SUM) and ``frozen`` (an EmbeddingCollection).

MODE ``train``: Adam applied in backward to every collection; trains a few steps, looks up the
eval batch (:func:`batch` at step ``EVAL_STEP``) in eval mode, then
``DynamicEmbDump(CKPT, model)`` (rows only). Saves the eval outputs and every table's keys and
rows.

MODE ``eval``: the eval (export) build of the same model: ``seq`` and ``bags`` without any
optimizer (no ``apply_optimizer_in_backward``), ``bags`` and ``frozen`` planned with
``training=False``, ``frozen`` with Adam applied. ``DynamicEmbLoad(CKPT, model)`` (rows only),
then the eval batch is looked up in eval mode (grad enabled); then each collection tries a
training step on it (training mode, grad enabled, ``backward``). Saves the eval outputs, every
table's optimizer state width and number of keys after the load and the eval lookup, each
collection's error (where raised: ``forward`` or ``backward``, and the message), and every
table's keys and rows at the end.

Usage: ``python _eval_build_rank.py RANK WORLD STORE OUT MODE CKPT``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

# per collection: (table, feature, dim, num_embeddings)
COLLECTIONS = {
    "seq": (("ua", "fa", 8, 1000), ("ub", "fb", 8, 500)),
    "bags": (("ia", "fc", 8, 600),),
    "frozen": (("za", "fz", 4, 400),),
}
NO_OPTIMIZER = ("seq", "bags")  # in the eval build
TRAINING_FALSE = ("bags", "frozen")  # in the eval build
STEPS = 3
EVAL_STEP = 100
BATCH = 5  # samples per rank
KEY_RANGE = 16  # trained keys are below it; the eval batch also asks for unseen keys


def batch(step: int, rank: int, collection: str) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (lengths, values) of ``collection``'s features at ``step``: 0-3 ids per
    sample; at ``EVAL_STEP`` a quarter of the ids are keys no training step saw."""
    gen = torch.Generator().manual_seed(
        1000 * step + 10 * rank + list(COLLECTIONS).index(collection)
    )
    tables = COLLECTIONS[collection]
    lengths = torch.randint(0, 4, (len(tables) * BATCH,), generator=gen)
    lengths[0] = 3
    n = int(lengths.sum())
    values = torch.randint(0, KEY_RANGE, (n,), generator=gen)
    if step == EVAL_STEP:
        unseen = torch.rand(n, generator=gen) < 0.25
        values = torch.where(unseen, values + 10_000, values)
    return lengths, values


def main() -> None:
    from _rank_join import join, leave  # beside this script (also loaded as a module by tests)

    rank, world, out_path, device, (mode, ckpt) = join(2)
    import torchrec.optim as trec_optim
    from demb_torchrec import (
        DynamicEmbDump,
        DynamicEmbInitializerArgs,
        DynamicEmbInitializerMode,
        DynamicEmbLoad,
        DynamicEmbParameterConstraints,
        DynamicEmbTableOptions,
    )
    from demb_torchrec.dump import dynamic_tables
    from demb_torchrec.planner import DynamicEmbeddingShardingPlanner
    from demb_torchrec.sharders import (
        DynamicEmbeddingBagCollectionSharder,
        DynamicEmbeddingCollectionSharder,
    )
    from torch import nn
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        KeyedJaggedTensor,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    meta = torch.device("meta")
    configs: dict[str, list[Any]] = {
        "seq": [
            EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f])
            for n, f, d, r in COLLECTIONS["seq"]
        ],
        "bags": [
            EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f])
            for n, f, d, r in COLLECTIONS["bags"]
        ],
        "frozen": [
            EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f])
            for n, f, d, r in COLLECTIONS["frozen"]
        ],
    }

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = EmbeddingCollection(tables=configs["seq"], device=meta)
            self.bags = EmbeddingBagCollection(tables=configs["bags"], device=meta)
            self.frozen = EmbeddingCollection(tables=configs["frozen"], device=meta)

        def forward(self, *features: KeyedJaggedTensor) -> dict[str, Any]:
            return {
                c: outputs(c, getattr(self, c)(f))
                for c, f in zip(COLLECTIONS, features, strict=True)
            }

    def outputs(collection: str, out: Any) -> Any:
        """Per feature rows (an EmbeddingCollection) or the bags."""
        if collection == "bags":
            return out.values()
        return {f: out[f].values() for _, f, _, _ in COLLECTIONS[collection]}

    def loss(collection: str, out: Any) -> torch.Tensor:
        if collection == "bags":
            return out.square().sum()
        return sum((rows.square().sum() for rows in out.values()), torch.zeros(()))

    def kjt(step: int, collection: str) -> KeyedJaggedTensor:
        lengths, values = batch(step, rank, collection)
        return KeyedJaggedTensor.from_lengths_sync(
            keys=[f for _, f, _, _ in COLLECTIONS[collection]], values=values, lengths=lengths
        ).to(device)

    model = Model()
    training = mode == "train"
    for c in COLLECTIONS:
        if training or c not in NO_OPTIMIZER:
            apply_optimizer_in_backward(
                trec_optim.Adam, getattr(model, c).parameters(), {"lr": 0.05}
            )
    init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.1)
    constraints = {
        n: DynamicEmbParameterConstraints(
            use_dynamicemb=True,
            dynamicemb_options=DynamicEmbTableOptions(
                initializer_args=init, training=training or c not in TRAINING_FALSE
            ),
        )
        for c, tables in COLLECTIONS.items()
        for n, *_ in tables
    }
    sharders = [DynamicEmbeddingCollectionSharder(), DynamicEmbeddingBagCollectionSharder()]
    planner = DynamicEmbeddingShardingPlanner(
        [config for c in COLLECTIONS for config in configs[c]],
        Topology(world_size=world, compute_device=device.type),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.GroupMember.WORLD),
        plan=plan,
        sharders=sharders,
        device=device,
    )
    tables = dynamic_tables(dmp)

    def sizes() -> dict[str, int]:
        return {t.name: int(t.module.tables.export(t.index).keys.numel()) for t in tables}

    def contents() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for t in tables:
            export = t.module.tables.export(t.index)
            dim = t.module.tables.configs[t.index].dim
            out[t.name] = (export.keys.cpu(), export.values[:, :dim].cpu())
        return out

    def detached(out: Any) -> Any:
        if isinstance(out, dict):
            return {k: detached(v) for k, v in out.items()}
        return out.detach().cpu()

    eval_features = [kjt(EVAL_STEP, c) for c in COLLECTIONS]
    result: dict[str, Any] = {}
    if training:
        for step in range(STEPS):
            out = dmp(*[kjt(step, c) for c in COLLECTIONS])
            sum((loss(c, out[c]) for c in COLLECTIONS), torch.zeros(())).backward()
        dmp.eval()
        with torch.no_grad():
            result["eval"] = detached(dmp(*eval_features))
        DynamicEmbDump(ckpt, dmp)
    else:
        result["state_dims"] = {t.name: t.module.tables.configs[t.index].state_dim for t in tables}
        DynamicEmbLoad(ckpt, dmp)
        dmp.eval()
        result["eval"] = detached(dmp(*eval_features))  # grad enabled: eval mode suffices
        result["eval_sizes"] = sizes()  # nothing inserted by the eval lookup
        dmp.train()
        errors: dict[str, tuple[str, str] | None] = {}
        for c, features in zip(COLLECTIONS, eval_features, strict=True):
            stage = "forward"
            try:
                out = outputs(c, getattr(dmp.module, c)(features))
                stage = "backward"
                loss(c, out).backward()
                errors[c] = None
            except RuntimeError as err:
                errors[c] = (stage, str(err))
        result["errors"] = errors
    result["tables"] = contents()
    torch.save(result, out_path)
    leave()


if __name__ == "__main__":
    main()
