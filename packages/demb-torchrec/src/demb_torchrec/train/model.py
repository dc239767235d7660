"""The model of ``demb train``: TorchRec's DLRM whose 26 sparse features are dynamic tables,
planned by :class:`~demb_torchrec.DynamicEmbeddingShardingPlanner` and sharded by
``DistributedModelParallel`` over the process group (one rank without ``torch.distributed``:
a group of one is made on the spot).

Only public APIs are used: this is also their integration test.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from demb_storage import (
    AdmissionStrategy,
    FrequencyAdmissionStrategy,
    KVCounter,
    ProbabilisticAdmissionStrategy,
    RocksDBStorage,
    RowLayout,
)

from demb_torchrec._args import optimizer_spec
from demb_torchrec.capacity import get_table_value_bytes
from demb_torchrec.constraints import DynamicEmbParameterConstraints
from demb_torchrec.errors import ConfigError, DembError
from demb_torchrec.optimizers import FTRL
from demb_torchrec.options import (
    DynamicEmbInitializerArgs,
    DynamicEmbInitializerMode,
    DynamicEmbScoreStrategy,
    DynamicEmbTableOptions,
    EvictedItemMode,
)
from demb_torchrec.planner import DynamicEmbeddingShardingPlanner
from demb_torchrec.sharders import DynamicEmbeddingBagCollectionSharder
from demb_torchrec.train.batch import NUM_DENSE, ClickBatch, feature_names
from demb_torchrec.train.config import Settings, resolve_function

__all__ = ["Rank", "TrainModel", "build_model", "init_rank", "to_inputs"]


class _RawIdsInRange(logging.Filter):
    """Drops TorchRec's first-batch warning that a feature's ids lie outside ``[0,
    num_embeddings)``: the ids of a dynamic table are raw keys, any int64 (the table hashes
    them), so the warning would fire for every feature of every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "which is out of range" not in record.getMessage()


logging.getLogger("torchrec.sparse.jagged_tensor_validator").addFilter(_RawIdsInRange())


@dataclass(frozen=True)
class Rank:
    """This process's place: ``rank`` of ``world_size`` on ``device``."""

    rank: int
    world_size: int
    device: torch.device
    group: dist.ProcessGroup

    @property
    def first(self) -> bool:
        return self.rank == 0


def init_rank() -> Rank:
    """Join the process group ``torchrun`` describes (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``PORT``), or make a group of one (gloo, a free local
    port) when the process was started alone. NCCL and ``cuda:LOCAL_RANK`` when CUDA is
    visible, gloo and the CPU otherwise."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a lone process: a group of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    group = dist.GroupMember.WORLD
    assert group is not None
    return Rank(rank, world, device, group)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class TrainModel:
    """The sharded DLRM, its dense parameters and their optimizer."""

    dmp: torch.nn.Module
    dense_params: list[torch.nn.Parameter]
    dense_opt: torch.optim.Optimizer
    rank: Rank


_SCORES: dict[str, DynamicEmbScoreStrategy | tuple[DynamicEmbScoreStrategy, ...]] = {
    "STEP": DynamicEmbScoreStrategy.STEP,
    "TIMESTAMP": DynamicEmbScoreStrategy.TIMESTAMP,
    "LFU": DynamicEmbScoreStrategy.LFU,
    "TIMESTAMP+LFU": (DynamicEmbScoreStrategy.TIMESTAMP, DynamicEmbScoreStrategy.LFU),
}


def table_options(
    settings: Settings, name: str, rank: Rank | None = None
) -> DynamicEmbTableOptions:
    """The dynamic-table options of table ``name`` from its settings; with caching, its device
    budget (``hbm_fraction`` of the table's value bytes over ``rank``'s world) and its
    external storage (this rank's RocksDB directory ``<external_storage>/<name>.rank<r>``).

    Raises:
        ConfigError: options the table rejects (naming ``tables.<name>``).
    """
    s = settings.table(name)
    tiers = _tiers(settings, name, rank)
    mode = DynamicEmbInitializerMode(s["initializer"])
    std = float(s["init_std"])
    init = (
        DynamicEmbInitializerArgs(mode=mode, lower=-std, upper=std)
        if mode is DynamicEmbInitializerMode.UNIFORM
        else DynamicEmbInitializerArgs(mode=mode, std_dev=std, lower=-2 * std, upper=2 * std)
    )
    try:
        return DynamicEmbTableOptions(
            max_capacity=int(s["capacity"]),
            init_capacity=int(s["init_capacity"]) or None,
            bucket_capacity=int(s["bucket_capacity"]),
            max_load_factor=float(s["max_load_factor"]),
            score_strategy=_SCORES[s["score_strategy"]],
            evicted_item_mode=EvictedItemMode[s["evicted_item_mode"]],
            dist_type=s["dist_type"],
            initializer_args=init,
            admit_strategy=_admission(s),
            score_function=_score_function(s, name),
            **tiers,
        )
    except (ValueError, TypeError, NotImplementedError) as err:
        raise ConfigError(f"tables.{name}: {err}") from None


def _tiers(settings: Settings, name: str, rank: Rank | None) -> dict[str, Any]:
    """A table's memory options: ``global_hbm_for_values`` (given, or ``hbm_fraction`` of
    :func:`~demb_torchrec.get_table_value_bytes`: by default 1.0, every value on the device),
    and with caching ``caching`` and ``external_storage``."""
    s = settings.table(name)
    world, r = (1, 0) if rank is None else (rank.world_size, rank.rank)
    kind = settings["optimizer"]["kind"]
    dim = int(settings["train"]["dim"])
    budget = int(s["global_hbm_for_values"])
    if not budget:
        shape = _Shape(int(s["capacity"]), dim)
        total = get_table_value_bytes(shape, kind, world, int(s["bucket_capacity"]))
        budget = math.ceil(float(s["hbm_fraction"]) * total)
    out: dict[str, Any] = {"caching": bool(s["caching"]), "global_hbm_for_values": budget}
    if s["external_storage"]:
        state = optimizer_spec(kind, {}).state_dim(dim, torch.float32)
        path = Path(s["external_storage"]) / f"{name}.rank{r}"
        out["external_storage"] = RocksDBStorage(
            path,
            [RowLayout(dim, state)],
            score_words=2 if s["score_strategy"] == "TIMESTAMP+LFU" else 1,
            names=[name],
            overwrite=True,
        )
    return out


@dataclass(frozen=True)
class _Shape:
    """What :func:`~demb_torchrec.get_table_value_bytes` reads of a table's config."""

    num_embeddings: int
    embedding_dim: int


def _admission(s: dict[str, Any]) -> AdmissionStrategy | None:
    """A table's admission strategy from its settings (None: every key is admitted)."""
    if s["admit_strategy"] == "frequency":
        counter = KVCounter(int(s["counter_capacity"]))
        return FrequencyAdmissionStrategy(int(s["admit_threshold"]), counter)
    if s["admit_strategy"] == "probabilistic":
        return ProbabilisticAdmissionStrategy(float(s["admit_probability"]))
    return None


def _score_function(s: dict[str, Any], name: str) -> Callable[..., Any] | None:
    """A table's ``score_function`` from its setting (None when empty)."""
    path = s["score_function"]
    if not path:
        return None
    if s["score_strategy"] != "TIMESTAMP+LFU":
        raise ConfigError(
            f"tables.{name}.score_function={path!r}: needs score_strategy TIMESTAMP+LFU "
            f"(the table's is {s['score_strategy']})"
        )
    return resolve_function(f"tables.{name}.score_function", path)


def _optimizer(settings: Settings) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    import torchrec.optim as trec_optim

    o = dict(settings["optimizer"])
    kind = o.pop("kind")
    classes: dict[str, type[torch.optim.Optimizer]] = {
        "sgd": trec_optim.SGD,
        "adam": trec_optim.Adam,
        "adagrad": trec_optim.Adagrad,
        "rowwise_adagrad": trec_optim.RowWiseAdagrad,
        "ftrl": FTRL,
    }
    return classes[kind], o


def build_model(settings: Settings, rank: Rank) -> TrainModel:
    """The DLRM of ``settings`` sharded over ``rank``'s group (collective: every rank calls).

    The dense parameters start from ``data.seed`` (the same on every rank); the dynamic tables
    start empty.

    Raises:
        ConfigError: a setting the tables, the optimizer or the planner rejects.
    """
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner.types import Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.models.dlrm import DLRM
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    train = settings["train"]
    dim = int(train["dim"])
    names = feature_names()
    configs = [
        EmbeddingBagConfig(
            name=n,
            embedding_dim=dim,
            num_embeddings=int(settings.table(n)["capacity"]),
            feature_names=[n],
        )
        for n in names
    ]
    constraints = {
        n: DynamicEmbParameterConstraints(
            use_dynamicemb=True, dynamicemb_options=table_options(settings, n, rank)
        )
        for n in names
    }
    torch.manual_seed(int(settings["data"]["seed"]))
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    model = DLRM(
        ebc, NUM_DENSE, list(train["bottom_mlp"]), list(train["top_mlp"]), dense_device=rank.device
    )
    optimizer, kwargs = _optimizer(settings)
    try:
        apply_optimizer_in_backward(optimizer, model.sparse_arch.parameters(), kwargs)
        sharder = DynamicEmbeddingBagCollectionSharder()
        hbm = (
            {"hbm_cap": torch.cuda.get_device_properties(rank.device).total_memory}
            if rank.device.type == "cuda"
            else {}
        )  # TorchRec's default topology assumes 32 GB of HBM: give it the device's own
        topology = Topology(world_size=rank.world_size, compute_device=rank.device.type, **hbm)
        planner = DynamicEmbeddingShardingPlanner(configs, topology, constraints=constraints)
        plan = planner.collective_plan(model, [sharder], rank.group)
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(rank.group),
            plan=plan,
            sharders=[sharder],
            device=rank.device,
        )
    except DembError as err:
        raise ConfigError(f"building the model: {err}") from err
    dense = [p for n, p in dmp.named_parameters() if "sparse_arch" not in n]
    dense_opt = torch.optim.Adam(dense, lr=float(train["dense_lr"]))
    return TrainModel(dmp, dense, dense_opt, rank)


def to_inputs(batch: ClickBatch, device: torch.device) -> tuple[torch.Tensor, Any]:
    """A batch as DLRM's inputs: dense ``(B, 13)`` float32 and a ``KeyedJaggedTensor`` of the
    26 features, one id per sample each (on ``device``)."""
    from torchrec import KeyedJaggedTensor

    b = len(batch)
    kjt = KeyedJaggedTensor(
        keys=feature_names(),
        values=batch.sparse.t().reshape(-1).contiguous(),
        lengths=torch.ones(b * batch.sparse.shape[1], dtype=torch.int32),
    )
    return batch.dense.to(device), kjt.to(device)
