"""A pure-PyTorch reference of the table module, for tests.

Rows live in Python dicts (key -> float64 row and state), lookups are
``torch.nn.functional.embedding_bag`` over float64 rows, gradients come from torch autograd
(each occurrence's gradient, clipped, summed per key) and updates from demb-optim's float64
:func:`~demb_optim.reference_update`. Initial rows come from
:func:`demb_kernels.init_reference.reference_rows`, the independent model of the initializer.
No table capacity and no eviction: tests that use it size tables so nothing is evicted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from demb_kernels.init_reference import reference_rows
from demb_optim import OptimizerSpec, clip_gradient, reference_update
from demb_storage import InitializerArgs
from torch.nn import functional

from demb_torchrec.options import DynamicEmbPoolingMode

__all__ = ["ReferenceTables"]

_BAG_MODE = {DynamicEmbPoolingMode.SUM: "sum", DynamicEmbPoolingMode.MEAN: "mean"}


class ReferenceTables:
    """The reference of :class:`~demb_torchrec.DynamicEmbeddingTables` (float32 tables).

    Args:
        dims: embedding dim of each table.
        feature_table_map: the table of each feature.
        pooling_mode: SUM, MEAN or NONE.
        optimizer: the optimizer spec.
        init_args: per table, complete initializer args (bounds set).
        seeds: per table, the initializer seed (``demb_storage.table_seed``).
    """

    def __init__(
        self,
        dims: Sequence[int],
        feature_table_map: Sequence[int],
        pooling_mode: DynamicEmbPoolingMode,
        optimizer: OptimizerSpec,
        init_args: Sequence[InitializerArgs],
        seeds: Sequence[int],
    ) -> None:
        self.dims = list(dims)
        self.ftm = list(feature_table_map)
        self.mode = pooling_mode
        self.spec = optimizer
        self.init_args = list(init_args)
        self.seeds = list(seeds)
        self.rows: list[dict[int, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in dims]
        """Per table, key -> (float64 embedding ``(dim,)``, float64 state ``(state_dim,)``)."""
        self.steps = [0] * len(dims)

    def initial(self, t: int, key: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Table ``t``'s first row for ``key`` (float32-rounded) and its initial state."""
        a = self.init_args[t]
        row = reference_rows(
            [key],
            self.dims[t],
            self.seeds[t],
            a.mode.value,
            a.mean,
            a.std_dev,
            a.lower if a.lower is not None else 0.0,
            a.upper if a.upper is not None else 1.0,
            a.value,
        )
        w = torch.from_numpy(row[0]).to(torch.float32).to(torch.float64)
        return w, self.spec.initial_state(self.dims[t]).to(torch.float64)

    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
        grad_out: torch.Tensor | None = None,
        *,
        training: bool = True,
    ) -> torch.Tensor:
        """The float64 output of a batch; with ``grad_out`` (the gradient of the loss with
        respect to the output), also one optimizer step on the rows it touched."""
        features = len(self.ftm)
        batch = (offsets.numel() - 1) // features
        outs, occurrences = [], []
        for f, t in enumerate(self.ftm):
            begin, end = int(offsets[f * batch]), int(offsets[(f + 1) * batch])
            keys = [int(k) for k in indices[begin:end]]
            if training:
                for k in keys:
                    if k not in self.rows[t]:
                        self.rows[t][k] = self.initial(t, k)
            zero = torch.zeros(self.dims[t], dtype=torch.float64)
            picked = [self.rows[t][k][0] if k in self.rows[t] else zero for k in keys]
            emb = torch.stack(picked) if picked else zero.new_zeros(0, self.dims[t])
            emb = emb.requires_grad_(grad_out is not None)
            occurrences.append((t, keys, emb))
            if self.mode is DynamicEmbPoolingMode.NONE:
                outs.append(emb)
                continue
            bags = offsets[f * batch : (f + 1) * batch + 1] - begin
            w = None if weights is None else weights[begin:end].to(torch.float64)
            outs.append(
                functional.embedding_bag(
                    torch.arange(len(keys)),
                    emb,
                    bags,
                    mode=_BAG_MODE[self.mode],
                    per_sample_weights=w,
                    include_last_offset=True,
                )
            )
        out = torch.cat(outs, dim=0 if self.mode is DynamicEmbPoolingMode.NONE else 1)
        if grad_out is not None:
            torch.autograd.backward([(out * grad_out.to(torch.float64)).sum()])
            self._update(occurrences)
        return out.detach()

    def _update(self, occurrences: list[tuple[int, list[int], torch.Tensor]]) -> None:
        self.steps = [s + 1 for s in self.steps]
        for t in range(len(self.dims)):
            summed: dict[int, torch.Tensor] = {}
            for tt, keys, emb in occurrences:
                if tt != t or emb.grad is None:
                    continue
                grads = clip_gradient(self.spec, emb.grad)
                for k, g in zip(keys, grads, strict=True):
                    summed[k] = summed[k] + g if k in summed else g.clone()
            if not summed:
                continue
            keys = list(summed)
            w = torch.stack([self.rows[t][k][0] for k in keys])
            s = torch.stack([self.rows[t][k][1] for k in keys])
            w_new, s_new = reference_update(
                self.spec, w, s, torch.stack([summed[k] for k in keys]), self.steps[t]
            )
            for i, k in enumerate(keys):
                self.rows[t][k] = (w_new[i], s_new[i])
