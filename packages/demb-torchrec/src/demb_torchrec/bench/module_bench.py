"""``demb bench module``: the table module on the reference workload, timed per phase.

Prints forward / backward / train (forward + backward with the fused update, each timed between
synchronizations) / eval ms, each the median of the timed steps after warm-up (eval: one eval
forward after each training step), a train step timed whole (no synchronization between its
forward and backward), and eval loop ms (eval forwards back to back, as an inference replica
runs them, after the training steps), beside the bytes a step must move and the same run's
copy bandwidth; on the CPU also TorchRec's static ``EmbeddingCollection`` on FBGEMM's fused CPU
TBE (DistributedModelParallel, one gloo rank) on the same batches. Writes JSON.
"""

from __future__ import annotations

import logging
import os
import platform
import statistics
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from tqdm import tqdm

from demb_torchrec.batched_tables import DynamicEmbeddingTables
from demb_torchrec.bench.compare import copy_bandwidth
from demb_torchrec.bench.workload import Workload, all_on_device, floor_bytes, make_batches, timed
from demb_torchrec.options import DynamicEmbPoolingMode, DynamicEmbTableOptions

__all__ = ["REFERENCE_H200", "TARGETS_H200", "ready", "run"]

REFERENCE_H200 = {"train_ms": 2.014, "forward_ms": 1.356, "backward_ms": 0.658, "eval_ms": 0.721}
"""The reference system on an H200 (measured with its own code, 2026-11-29), Adam, NONE pooling."""
TARGETS_H200 = {"train_ms": 1.0, "eval_ms": 0.35}

_BASELINE_OPTIMIZERS = {"sgd", "adagrad", "rowwise_adagrad"}  # what FBGEMM's CPU TBE runs


def build(w: Workload, device: torch.device) -> DynamicEmbeddingTables:
    cap = w.spare_capacity
    options = [
        DynamicEmbTableOptions(
            dim=w.dim,
            max_capacity=cap,
            bucket_capacity=128,
            local_hbm_for_values=all_on_device(w.dim, cap, w.optimizer),
        )
        for _ in range(w.tables)
    ]
    mode = DynamicEmbPoolingMode.NONE if w.pooling == "none" else DynamicEmbPoolingMode.SUM
    return DynamicEmbeddingTables(
        options,
        pooling_mode=mode,
        device=device,
        optimizer=w.optimizer,
        check_gradients=w.check_gradients,
        learning_rate=0.01,
    )


def prefill(module: DynamicEmbeddingTables, w: Workload, chunk: int = 1 << 20) -> None:
    """Insert every row key of every table (initialized rows), chunk by chunk."""
    module.train()
    with torch.no_grad():
        for start in range(0, w.rows, chunk):
            keys = torch.arange(start, min(start + chunk, w.rows), device=module.device)
            indices = keys.repeat(w.tables)
            offsets = torch.arange(indices.numel() + 1, device=module.device)
            module(indices, offsets)


def ready(
    w: Workload, device: torch.device, count: int = 4
) -> tuple[DynamicEmbeddingTables, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """The workload's module with every row inserted, ``count`` batches of it, and an output
    gradient (the same for every batch)."""
    module = build(w, device)
    prefill(module, w)
    batches = make_batches(w, count, device)
    with torch.no_grad():
        grad = torch.randn_like(module(*batches[0])) * 1e-3
    return module, batches, grad


def _unique(batch: tuple[torch.Tensor, torch.Tensor], w: Workload) -> int:
    indices, offsets = batch
    bounds = offsets[:: w.samples].tolist()
    total = 0
    for t in range(w.tables):
        total += int(torch.unique(indices[bounds[t] : bounds[t + 1]]).numel())
    return total


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def _record(phases: dict[str, list[float]], times: tuple[float, float, float]) -> None:
    fwd, bwd, ev = times
    for name, t in (("forward", fwd), ("backward", bwd), ("train", fwd + bwd), ("eval", ev)):
        phases[name].append(t)


def _demb_step(
    module: DynamicEmbeddingTables,
    batch: tuple[torch.Tensor, torch.Tensor],
    grad: torch.Tensor,
    caller_thread: bool = False,
) -> tuple[float, float, float]:
    """Seconds of a training forward, its backward, and an eval forward of ``batch``. With
    ``caller_thread``, the backward runs on the calling thread
    (``torch.autograd.set_multithreading_enabled(False)``) instead of autograd's device
    thread."""
    device = module.device
    module.train()
    box: list[torch.Tensor] = []
    fwd = timed(lambda: box.append(module(*batch)), device)
    with torch.autograd.set_multithreading_enabled(not caller_thread):
        bwd = timed(lambda: torch.autograd.backward([box[0]], [grad]), device)
    module.eval()
    with torch.no_grad():
        ev = timed(lambda: module(*batch), device)
    return fwd, bwd, ev


def _train_phases(
    module: DynamicEmbeddingTables,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    grad: torch.Tensor,
    steps: int,
    warmup: int,
    label: str,
    caller_thread: bool,
) -> dict[str, list[float]]:
    """Seconds of each phase of the timed steps (:func:`_demb_step`), cycling through
    ``batches``."""
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "train": [], "eval": []}
    desc = label + (" (caller thread)" if caller_thread else "")
    for i in tqdm(range(warmup + steps), desc=desc, leave=False):
        times = _demb_step(module, batches[i % len(batches)], grad, caller_thread)
        if i >= warmup:
            _record(phases, times)
    return phases


Batch = tuple[torch.Tensor, torch.Tensor]


def _timed_loop(
    run: Callable[[Batch], object],
    batches: list[Batch],
    steps: int,
    warmup: int,
    device: torch.device,
) -> list[float]:
    """Seconds of each timed ``run(batch)`` (:func:`timed`) of ``warmup + steps`` back to back,
    cycling through ``batches``; the warm-up ones dropped."""
    times = []
    for i in range(warmup + steps):
        t = timed(partial(run, batches[i % len(batches)]), device)
        if i >= warmup:
            times.append(t)
    return times


def _step_loop(
    module: DynamicEmbeddingTables,
    batches: list[Batch],
    grad: torch.Tensor,
    steps: int,
    warmup: int,
    caller_thread: bool,
) -> list[float]:
    """Seconds of each timed training step taken whole: the forward and then the backward with
    no synchronization between them (as a training loop runs them), cycling through
    ``batches``. Not what ``train`` reports (the forward and the backward each timed between
    synchronizations, as the targets are read)."""
    module.train()

    def step(batch: Batch) -> None:
        torch.autograd.backward([module(*batch)], [grad])

    with torch.autograd.set_multithreading_enabled(not caller_thread):
        return _timed_loop(step, batches, steps, warmup, module.device)


def _eval_loop(
    module: DynamicEmbeddingTables,
    batches: list[Batch],
    steps: int,
    warmup: int,
) -> list[float]:
    """Seconds of each timed eval forward of a run of them back to back (no training between),
    cycling through ``batches``."""
    module.eval()
    with torch.no_grad():
        return _timed_loop(lambda batch: module(*batch), batches, steps, warmup, module.device)


def time_demb(w: Workload, device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    """The demb figures of the workload: each phase's median ms; on CUDA also with the backward
    on the calling thread (``caller_thread_*_ms``: autograd hands a CUDA backward to its device
    thread by default, and the calling thread waits for it)."""
    module, batches, grad = ready(w, device)
    state_dim = module.tables.configs[0].state_dim
    label = f"demb {w.optimizer}"
    phases = _train_phases(module, batches, grad, steps, warmup, label, caller_thread=False)
    phases["step"] = _step_loop(module, batches, grad, steps, warmup, caller_thread=False)
    if device.type == "cuda":
        caller = _train_phases(module, batches, grad, steps, warmup, label, caller_thread=True)
        phases.update({f"caller_thread_{k}": v for k, v in caller.items()})
        phases["caller_thread_step"] = _step_loop(
            module, batches, grad, steps, warmup, caller_thread=True
        )
    phases["eval_loop"] = _eval_loop(module, batches, steps, warmup)
    lookups = int(batches[0][0].numel())
    unique = _unique(batches[0], w)
    return {
        **{f"{k}_ms": _median_ms(v) for k, v in phases.items()},
        "lookups": lookups,
        "unique": unique,
        "bytes_train": floor_bytes(w, lookups, unique, state_dim, train=True),
        "bytes_eval": floor_bytes(w, lookups, unique, state_dim, train=False),
    }


def time_torchrec(w: Workload, steps: int, warmup: int) -> dict[str, Any]:
    """TorchRec's EmbeddingCollection (NONE pooling) or EmbeddingBagCollection (SUM) on FBGEMM's
    fused CPU TBE, through DistributedModelParallel with one gloo rank."""
    import torch.distributed as dist

    logging.disable(logging.WARNING)
    from torchrec import (
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
        KeyedJaggedTensor,
    )
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    logging.disable(logging.NOTSET)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("gloo", rank=0, world_size=1)
    names = [f"f{t}" for t in range(w.tables)]
    meta, cpu = torch.device("meta"), torch.device("cpu")
    collection: torch.nn.Module
    if w.pooling == "none":
        configs = [
            EmbeddingConfig(
                name=f"t{t}", embedding_dim=w.dim, num_embeddings=w.rows, feature_names=[names[t]]
            )
            for t in range(w.tables)
        ]
        collection = EmbeddingCollection(tables=configs, device=meta)
    else:
        bag_configs = [
            EmbeddingBagConfig(
                name=f"t{t}", embedding_dim=w.dim, num_embeddings=w.rows, feature_names=[names[t]]
            )
            for t in range(w.tables)
        ]
        collection = EmbeddingBagCollection(tables=bag_configs, device=meta)
    from torchrec.optim import RowWiseAdagrad

    optims: dict[str, type[torch.optim.Optimizer]] = {
        "sgd": torch.optim.SGD,
        "adagrad": torch.optim.Adagrad,
        "rowwise_adagrad": RowWiseAdagrad,
    }
    optim = optims[w.optimizer]
    apply_optimizer_in_backward(optim, collection.parameters(), {"lr": 0.01})
    model = DistributedModelParallel(collection, device=torch.device("cpu"))
    batches = make_batches(w, 4, torch.device("cpu"))
    kjts = [
        KeyedJaggedTensor.from_offsets_sync(keys=names, values=i, offsets=o) for i, o in batches
    ]

    def forward(kjt: KeyedJaggedTensor) -> torch.Tensor:
        out = model(kjt)
        if w.pooling == "none":
            return torch.cat([out[n].values() for n in names])
        values: torch.Tensor = out.values()
        return values

    def train_step(kjt: KeyedJaggedTensor) -> tuple[float, float]:
        model.train()
        box: list[torch.Tensor] = []
        fwd = timed(lambda: box.append(forward(kjt)), cpu)
        bwd = timed(lambda: torch.autograd.backward([box[0].sum()]), cpu)
        return fwd, bwd

    phases: dict[str, list[float]] = {"forward": [], "backward": [], "train": [], "eval": []}
    for i in tqdm(range(warmup + steps), desc="torchrec", leave=False):
        kjt = kjts[i % len(kjts)]
        fwd, bwd = train_step(kjt)
        model.eval()
        with torch.no_grad():
            ev = timed(partial(forward, kjt), cpu)
        if i >= warmup:
            _record(phases, (fwd, bwd, ev))
    return {f"{k}_ms": _median_ms(v) for k, v in phases.items()}


_PHASE_KEYS = ("forward_ms", "backward_ms", "train_ms", "eval_ms")


def _phases(r: dict[str, Any]) -> str:
    return "  ".join(f"{p[:-3]} {r[p]:.3f} ms" for p in _PHASE_KEYS)


def _print_demb(
    w: Workload, report: dict[str, Any], demb: dict[str, Any], device: torch.device
) -> None:
    copy = report["copy_bandwidth_bytes_per_s"]
    print(f"workload: {w.as_dict()} on {report['gpu'] or device}")
    print(
        f"lookups/step {demb['lookups']:,}  unique {demb['unique']:,}  "
        f"copy bandwidth {copy / 1e9:.0f} GB/s"
    )
    unchecked = "" if w.check_gradients else " (check_gradients=False: no NaN/inf check)"
    print(f"demb {w.optimizer}{unchecked}: {_phases(demb)}")
    print(
        "  eval loop (eval forwards back to back, no training between): "
        f"{demb['eval_loop_ms']:.3f} ms"
    )
    if "caller_thread_train_ms" in demb:
        caller = {p: demb[f"caller_thread_{p}"] for p in _PHASE_KEYS}
        print(
            "  backward on the calling thread (torch.autograd.set_multithreading_enabled("
            f"False)): {_phases(caller)}"
        )
    whole = f"{demb['step_ms']:.3f} ms"
    if "caller_thread_step_ms" in demb:
        whole += f" (backward on the calling thread: {demb['caller_thread_step_ms']:.3f} ms)"
    print(
        "  a train step timed whole (forward then backward, no sync between them, as a training "
        f"loop runs them): {whole}; 'train' above, which the targets read, syncs between them"
    )
    print(
        f"  a train step must move {demb['bytes_train'] / 1e6:.0f} MB: floor "
        f"{demb['floor_train_ms']:.3f} ms, train is "
        f"{demb['train_ms'] / demb['floor_train_ms']:.1f}x "
        f"it; eval {demb['bytes_eval'] / 1e6:.0f} MB: floor {demb['floor_eval_ms']:.3f} ms, "
        f"{demb['eval_ms'] / demb['floor_eval_ms']:.1f}x"
    )
    if device.type == "cuda":
        report["targets_h200"] = TARGETS_H200
        report["reference_h200"] = REFERENCE_H200
        print(
            f"  targets (H200): train <= {TARGETS_H200['train_ms']} ms, eval <= "
            f"{TARGETS_H200['eval_ms']} ms; reference system (H200): train "
            f"{REFERENCE_H200['train_ms']} ms, eval {REFERENCE_H200['eval_ms']} ms"
        )


def run(
    w: Workload, device: torch.device, steps: int, warmup: int, baseline: bool
) -> dict[str, Any]:
    """Time the workload (and, on the CPU, the TorchRec baseline); print and return a report."""
    copy = copy_bandwidth(device)
    report: dict[str, Any] = {
        "workload": w.as_dict(),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "steps": steps,
        "warmup": warmup,
        "copy_bandwidth_bytes_per_s": copy,
    }
    demb = time_demb(w, device, steps, warmup)
    demb["floor_train_ms"] = demb["bytes_train"] / copy * 1e3
    demb["floor_eval_ms"] = demb["bytes_eval"] / copy * 1e3
    report["demb"] = demb
    _print_demb(w, report, demb, device)
    if baseline and device.type == "cpu":
        if w.optimizer in _BASELINE_OPTIMIZERS:
            base = time_torchrec(w, steps, warmup)
            report["torchrec"] = base
            report["train_ratio_to_torchrec"] = demb["train_ms"] / base["train_ms"]
            report["eval_ratio_to_torchrec"] = demb["eval_ms"] / base["eval_ms"]
            print(
                f"torchrec {w.optimizer} (FBGEMM CPU TBE): {_phases(base)}; demb / torchrec: "
                f"train {report['train_ratio_to_torchrec']:.2f}x, "
                f"eval {report['eval_ratio_to_torchrec']:.2f}x (target <= 1.5)"
            )
        else:
            print(f"torchrec baseline: n/a ({w.optimizer} is not in FBGEMM's CPU TBE)")
    return report
