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

    rank, _, out_path, device, (mode, ckpt) = join(2)
    import _rank_common as common
    from demb_torchrec import (
        DynamicEmbDump,
        DynamicEmbInitializerArgs,
        DynamicEmbInitializerMode,
        DynamicEmbLoad,
    )
    from demb_torchrec.dump import dynamic_tables
    from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder as BagSharder
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder as SequenceSharder
    from torch import nn
    from torchrec import KeyedJaggedTensor
    from torchrec.optim import Adam
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.seq = common.sequence_collection(COLLECTIONS["seq"])
            self.bags = common.bag_collection(COLLECTIONS["bags"])
            self.frozen = common.sequence_collection(COLLECTIONS["frozen"])

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
        names = [f for _, f, _, _ in COLLECTIONS[collection]]
        return common.features(names, [lengths], [values], device)

    model = Model()
    training = mode == "train"
    for c in COLLECTIONS:
        if training or c not in NO_OPTIMIZER:
            apply_optimizer_in_backward(Adam, getattr(model, c).parameters(), {"lr": 0.05})
    init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.NORMAL, std_dev=0.1)
    constraints = {
        n: common.dynamic(initializer_args=init, training=training or c not in TRAINING_FALSE)
        for c, tables in COLLECTIONS.items()
        for n, *_ in tables
    }
    sharders = [SequenceSharder(), BagSharder()]
    all_configs = common.table_configs(*(getattr(model, c) for c in COLLECTIONS))
    dmp = common.shard(model, all_configs, constraints, sharders, device)
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
