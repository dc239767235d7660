"""``demb bench update``: throughput of the fused optimizer update
(:func:`demb_optim.apply_update`), beside the same run's copy bandwidth (its floor) and a
pure-torch update of the same rows.

The full size (the default on a GPU): D=128 over 350,000 unique rows of a
2,000,000-row table, float32 rows, each optimizer in turn (Adam, FTRL, SGD, Adagrad, row-wise
Adagrad); the CPU default is a tenth of the rows (``scale`` 0.1). Bytes counted per updated
row: the row read and written (embedding + state), its float32 gradient row read and its slot
read. Each figure is those bytes over the median of ``iters`` calls after a warm-up one (CUDA
events on a GPU, the wall clock on the CPU):

* the fused update itself (``apply_update(check=False)``, what a trainer that produced the
  slots and gradients calls), beside the device copy bandwidth (the floor: a copy of the same
  bytes) and beside the pure-torch update of the same rows (:func:`torch_update`: gather,
  the optimizer's float32 arithmetic in torch ops, scatter back), timed the same way;
* the fused update with ``check=True`` (finite gradients, slots in range: one sync) beside the
  unchecked one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from demb_optim import (
    FTRL,
    SGD,
    SPEC_TYPES,
    Adagrad,
    Adam,
    OptimizerKind,
    OptimizerSpec,
    RowWiseAdagrad,
    apply_update,
)

from demb_torchrec.bench.compare import (
    Comparison,
    copy_bandwidth,
    format_si,
    machine_info,
    median_seconds,
    print_comparisons,
    run_cases,
)

__all__ = ["OPTIMIZERS", "UpdateWorkload", "moved_bytes", "run", "torch_update"]

OPTIMIZERS = ("adam", "ftrl", "sgd", "adagrad", "rowwise_adagrad")
"""The optimizers timed, in order."""
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class UpdateWorkload:
    """Updated rows of a table of ``table_rows`` rows of ``dim`` (+ state) in ``dtype``, per
    optimizer; timed ``iters`` times. The defaults are the full size."""

    rows: int = 350_000
    table_rows: int = 2_000_000
    dim: int = 128
    dtype: str = "float32"
    iters: int = 10
    optimizers: tuple[str, ...] = OPTIMIZERS
    copy_mib: int = 512
    """The size of the copy that measures the device's bandwidth."""

    def __post_init__(self) -> None:
        if not 0 < self.rows <= self.table_rows:
            raise ValueError(f"rows={self.rows!r}: must be in [1, table_rows]")
        if self.dim < 1:
            raise ValueError(f"dim={self.dim!r}: must be >= 1")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {', '.join(_DTYPES)}")
        if self.iters < 1:
            raise ValueError(f"iters={self.iters!r}: must be >= 1")
        unknown = set(self.optimizers) - set(OPTIMIZERS)
        if unknown or not self.optimizers:
            raise ValueError(f"optimizers={self.optimizers!r}: must be among {OPTIMIZERS}")
        if self.copy_mib < 1:
            raise ValueError(f"copy_mib={self.copy_mib!r}: must be >= 1")

    def scaled(self, scale: float) -> UpdateWorkload:
        """Rows and table rows times ``scale`` (the rest unchanged)."""
        return replace(
            self,
            rows=max(1, round(self.rows * scale)),
            table_rows=max(1, round(self.table_rows * scale)),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        """The rows' dtype."""
        return _DTYPES[self.dtype]

    def as_dict(self) -> dict[str, Any]:
        """The workload as JSON fields."""
        return {**asdict(self), "optimizers": list(self.optimizers)}


def moved_bytes(rows: int, width: int, element_size: int, dim: int) -> int:
    """Bytes an update of ``rows`` rows must move: each row of ``width`` elements read and
    written, its float32 gradient row and its int64 slot read."""
    return rows * (2 * width * element_size + dim * 4 + 8)


def torch_update(
    spec: OptimizerSpec,
    values: torch.Tensor,
    slots: torch.Tensor,
    grads: torch.Tensor,
    dim: int,
    step: int,
) -> None:
    """The update of ``apply_update`` (no gradient clipping) in plain torch ops, the baseline:
    the rows ``slots`` of ``values`` gathered, updated in float32 (state kept in the rows'
    dtype, as the fused kernel keeps it) and scattered back in place."""
    rows = values.index_select(0, slots).float()
    w, s, g = rows[:, :dim], rows[:, dim:], grads
    lr = spec.learning_rate
    if isinstance(spec, SGD):
        w = w - lr * g
    elif isinstance(spec, Adam):
        m = spec.beta1 * s[:, :dim] + (1 - spec.beta1) * g
        v = spec.beta2 * s[:, dim:] + (1 - spec.beta2) * g * g
        m_hat = m / (1 - spec.beta1**step)
        v_hat = v / (1 - spec.beta2**step)
        w = w - lr * (m_hat / (v_hat.sqrt() + spec.eps) + spec.weight_decay * w)
        s = torch.cat([m, v], dim=1)
    elif isinstance(spec, RowWiseAdagrad):
        s = s.clone()
        s[:, 0] += (g * g).mean(dim=1)
        w = w - lr * g / (s[:, :1].sqrt() + spec.eps)
    elif isinstance(spec, Adagrad):
        s = s + g * g
        w = w - lr * g / (s.sqrt() + spec.eps)
    elif isinstance(spec, FTRL):
        z, n = s[:, :dim], s[:, dim:]
        n_new = n + g * g
        p = spec.learning_rate_power
        rate, rate_new = n.pow(-p), n_new.pow(-p)
        z = z + g - (rate_new - rate) / lr * w
        denom = (spec.ftrl_beta + rate_new) / lr + spec.l2_reg
        w = torch.where(z.abs() <= spec.l1_reg, 0.0, (z.sign() * spec.l1_reg - z) / denom)
        s = torch.cat([z, n_new], dim=1)
    else:
        raise TypeError(f"no torch update for {type(spec).__name__}")
    values.index_copy_(0, slots, torch.cat([w, s], dim=1).to(values.dtype))


def _time_optimizer(
    w: UpdateWorkload, name: str, slots: torch.Tensor, grads: torch.Tensor, device: torch.device
) -> dict[str, Any]:
    """Seconds of the fused update (unchecked and checked) and of :func:`torch_update` for one
    optimizer, on a fresh table."""
    spec = SPEC_TYPES[OptimizerKind(name)]()
    dtype = w.torch_dtype
    width = w.dim + spec.state_dim(w.dim, dtype)
    gen = torch.Generator(device=device).manual_seed(1)
    values = torch.rand(w.table_rows, width, generator=gen, device=device).to(dtype)
    count = [1]

    def fused(check: bool = False) -> None:
        count[0] += 1
        apply_update(spec, [values], [slots], [grads], [w.dim], count, check=check)

    def plain() -> None:
        count[0] += 1
        torch_update(spec, values, slots, grads, w.dim, count[0])

    fused()
    seconds = median_seconds(fused, device, w.iters)
    checked = median_seconds(lambda: fused(check=True), device, w.iters)
    plain()
    torch_seconds = median_seconds(plain, device, w.iters)
    moved = moved_bytes(w.rows, width, values.element_size(), w.dim)
    return {
        "optimizer": name,
        "dim": w.dim,
        "dtype": w.dtype,
        "rows": w.rows,
        "row_width": width,
        "bytes": moved,
        "seconds": seconds,
        "seconds_with_check": checked,
        "torch_seconds": torch_seconds,
        "bytes_per_s": moved / seconds,
        "bytes_per_s_with_check": moved / checked,
        "torch_bytes_per_s": moved / torch_seconds,
    }


def _comparisons(rows: list[dict[str, Any]], bandwidth: float) -> list[Comparison]:
    out = []
    for r in rows:
        r["fraction_of_copy_bandwidth"] = r["bytes_per_s"] / bandwidth
        r["speedup_over_torch"] = r["torch_seconds"] / r["seconds"]
        case = f"{r['optimizer']} {r['dtype']} D={r['dim']}"
        fused = r["bytes_per_s"]
        out += [
            Comparison(case, fused, bandwidth, "B/s", "copy bandwidth (floor)"),
            Comparison(case, fused, r["torch_bytes_per_s"], "B/s", "torch update (same rows)"),
            Comparison(
                f"{case} check=True", r["bytes_per_s_with_check"], fused, "B/s", "check=False"
            ),
        ]
    return out


def run(w: UpdateWorkload, device: torch.device) -> dict[str, Any]:
    """Time each optimizer's fused update of ``w`` on ``device``; print a table of each figure
    beside its baseline and return the report."""
    bandwidth = copy_bandwidth(device, w.copy_mib)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(w.table_rows, generator=gen)[: w.rows].to(device)
    grads = torch.randn(w.rows, w.dim, generator=gen).to(device)
    rows = run_cases(device, w.optimizers, lambda o: [_time_optimizer(w, o, slots, grads, device)])
    comparisons = _comparisons(rows, bandwidth)
    print_comparisons(
        f"fused optimizer update on {device}: {w.rows:,} unique rows of {w.table_rows:,}, "
        f"D={w.dim} {w.dtype}; figures are the bytes an update moves (row + state read and "
        f"written, gradient and slot read) per second; copy bandwidth "
        f"{format_si(bandwidth, 'B/s')} (read + write)",
        comparisons,
    )
    for r in rows:
        print(
            f"  {r['optimizer']:<16} fused {r['seconds'] * 1e3:8.3f} ms  check=True "
            f"{r['seconds_with_check'] * 1e3:8.3f} ms  torch {r['torch_seconds'] * 1e3:8.3f} ms"
        )
    return {
        "benchmark": "update",
        "machine": machine_info(device),
        "workload": w.as_dict(),
        "copy_bandwidth_bytes_per_s": bandwidth,
        "target_fraction": 0.7,
        "results": rows,
        "comparisons": [c.as_dict() for c in comparisons],
    }
