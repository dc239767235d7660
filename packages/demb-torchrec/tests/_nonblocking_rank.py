"""One rank of test_nonblocking_dump.py's multi-rank tests: a model with an EmbeddingCollection
(table ``ua``, roundrobin) and an EmbeddingBagCollection (table ``ia``, continuous), planned and
sharded row-wise under DistributedModelParallel, Adam applied in backward.

It trains a few steps, dumps to ``DIR/blocking`` (the reference), then to ``DIR/background``
with ``blocking=False`` while its shard writes are held until more training steps (with new
keys: inserts, evictions, updates; their collectives run while the writer thread waits) have
run, then waits. Then a background dump to ``DIR/failed`` whose writer raises on rank 1: every
rank's ``wait()`` must raise. Saves to OUT ``{"held_while_training", "changed", "failed"}``.

Usage: ``python _nonblocking_rank.py RANK WORLD STORE OUT DIR [DEVICE]``.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

logging.disable(logging.WARNING)
warnings.filterwarnings("ignore")

EC_TABLES = (("ua", "fa", 8, 600),)  # name, feature, dim, num_embeddings
EBC_TABLES = (("ia", "fc", 8, 600),)
BATCH = 5


def main() -> None:
    from _rank_join import join, leave  # beside this script

    rank, _, out_path, device, (folder,) = join(1)
    import _rank_common as common
    from demb_io import ShardData, ShardMeta
    from demb_torchrec import DynamicEmbDump, DynamicEmbScoreStrategy
    from demb_torchrec import dump as dump_module
    from demb_torchrec.dump import dynamic_tables
    from demb_torchrec.errors import CheckpointError
    from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder as BagSharder
    from demb_torchrec.sharders import DynamicEmbeddingCollectionSharder as SequenceSharder
    from torch import nn
    from torchrec import KeyedJaggedTensor
    from torchrec.optim import Adam
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ec = common.sequence_collection(EC_TABLES)
            self.ebc = common.bag_collection(EBC_TABLES)

        def forward(self, seq: KeyedJaggedTensor, pooled: KeyedJaggedTensor) -> torch.Tensor:
            rows = self.ec(seq)
            loss = sum(rows[f].values().square().sum() for _, f, _, _ in EC_TABLES)
            return loss + self.ebc(pooled).values().square().sum()

    model = Model()
    apply_optimizer_in_backward(Adam, model.parameters(), {"lr": 0.05})
    lfu = DynamicEmbScoreStrategy.LFU
    constraints = {
        n: common.dynamic(dist_type=dist_type, score_strategy=lfu)
        for tables, dist_type in ((EC_TABLES, "roundrobin"), (EBC_TABLES, "continuous"))
        for n, *_ in tables
    }
    sharders = [SequenceSharder(), BagSharder()]
    dmp = common.shard(
        model, common.table_configs(model.ec, model.ebc), constraints, sharders, device
    )

    def train(steps: range) -> None:
        for step in steps:
            gen = torch.Generator().manual_seed(100 * step + rank)

            def kjt(tables: tuple[tuple[str, str, int, int], ...]) -> KeyedJaggedTensor:
                lengths = torch.randint(0, 40, (len(tables) * BATCH,), generator=gen)  # noqa: B023
                keys = torch.randint(0, 3000, (int(lengths.sum()),), generator=gen)  # noqa: B023
                return common.features([f for _, f, _, _ in tables], [lengths], [keys], device)

            dmp(kjt(EC_TABLES), kjt(EBC_TABLES)).backward()

    def held() -> dict[str, tuple[set[int], torch.Tensor]]:
        out = {}
        for t in dynamic_tables(dmp):
            ex = t.module.tables.export(t.index)
            out[t.name] = (set(ex.keys.tolist()), ex.values.cpu())
        return out

    train(range(3))
    root = Path(folder)
    DynamicEmbDump(root / "blocking", dmp, optim=True)
    before = held()

    write = dump_module._write_shard
    gate = threading.Event()
    started: list[str] = []

    def gated(folder: Path, meta: ShardMeta, chunks: Iterator[ShardData]) -> None:
        started.append(meta.table)
        assert gate.wait(timeout=120)
        write(folder, meta, chunks)

    dump_module._write_shard = gated
    handle = DynamicEmbDump(root / "background", dmp, optim=True, blocking=False)
    train(range(3, 7))
    held_while_training = not handle.done() and len(started) == 1
    gate.set()
    handle.wait()
    after = held()
    changed = all(
        before[n][0] - after[n][0] and not torch.equal(before[n][1], after[n][1]) for n in before
    )

    def broken(folder: Path, meta: ShardMeta, chunks: Iterator[ShardData]) -> None:
        if rank == 1:
            raise OSError("rank 1 disk full")
        write(folder, meta, chunks)

    dump_module._write_shard = broken
    failed = ""
    try:
        DynamicEmbDump(root / "failed", dmp, optim=True, blocking=False).wait()
    except CheckpointError as err:
        failed = str(err)
    dump_module._write_shard = write
    torch.save(
        {"held_while_training": held_while_training, "changed": changed, "failed": failed},
        out_path,
    )
    leave()


if __name__ == "__main__":
    main()
