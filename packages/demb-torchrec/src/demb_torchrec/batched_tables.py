"""The table module: several dynamic tables, fused, looked up and trained as one layer.

:class:`DynamicEmbeddingTables` (exported under the spec's name
``BatchedDynamicEmbeddingTablesV2``) takes a TBE-layout batch (``indices`` feature-major,
``offsets`` of ``F * B`` bags) and returns pooled rows ``(B, sum of dims)`` or, without
pooling, one row per index ``(N, D)``. A training forward deduplicates each table's keys, finds
or inserts them (new rows initialized from ``initializer_args`` and the optimizer's initial
state, scores per ``score_strategy``), then pools; ``loss.backward()`` sums each unique key's
gradient (clipping each occurrence first when the optimizer clips) and runs demb-optim's fused
update on the table rows in place. No dense gradient of a table exists at any point. An eval
forward (``module.eval()``) inserts nothing: missing keys read ``eval_initializer_args``.

How a forward runs is picked once, when the module is built (:mod:`demb_torchrec._paths`): one
path object for training forwards and one for eval forwards, chosen from the tables' dims and
dtypes, the pooling mode, the optimizer's clipping and the eval initializers; ``forward`` checks
the batch and hands it to the one ``self.training`` selects. The paths share the module's tables
and settings through one :class:`~demb_torchrec._state.ForwardState`, never the module itself.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from demb_kernels.init_rows import new_rows_args
from demb_kernels.lookup import status_count_tensor
from demb_storage import ScoredHashTable, TableConfigError, new_rows_spec, table_seed

from demb_torchrec._admission import admission_of
from demb_torchrec._args import (
    batch_error,
    check_batch_args,
    check_weight_args,
    optimizer_spec,
    resolve_device,
)
from demb_torchrec._autograd import TrainStep, trained_rows
from demb_torchrec._cache_tier import CacheTier
from demb_torchrec._paths import eval_path, train_path
from demb_torchrec._state import Bags, ForwardState
from demb_torchrec._tiers import place_tables
from demb_torchrec.errors import TrainingStateError
from demb_torchrec.options import DynamicEmbPoolingMode, DynamicEmbTableOptions, table_config

__all__ = ["BatchedDynamicEmbeddingTablesV2", "DynamicEmbeddingTables"]

_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class DynamicEmbeddingTables(torch.nn.Module):
    """``T`` dynamic tables fused into one layer (the spec's ``BatchedDynamicEmbeddingTablesV2``).

    Args:
        table_options: one :class:`DynamicEmbTableOptions` per table (``dim`` and
            ``max_capacity`` set). ``initializer_args`` bounds left None complete to
            ``+-1/sqrt(max_capacity)`` (the planner completes them from ``num_embeddings``).
        table_names: unique names (default ``table_0``, ...).
        feature_table_map: the table of each feature (default one feature per table).
        pooling_mode: SUM / MEAN (mixed dims allowed) or NONE (all features of one dim).
        output_dtype: float32, float16 or bfloat16.
        device: where tables and batches live (default: ``device_id`` of the options, else
            the current CUDA device if any, else the CPU).
        optimizer: FBGEMM ``EmbOptimType``, ``DynamicEmbOptimType``, a name, or a demb-optim
            ``OptimizerSpec``.
        seed: seeds every table's initializer (a key's initial row depends on the seed, its
            table and the key only).
        check_gradients: before each update, reject NaN/inf gradients (one sync). False: no
            check, a NaN/inf gradient reaches its rows; on CUDA without pooling the update then
            sums each key of up to 32 occurrences itself, one pass less over their gradients.
        **optimizer_kwargs: the optimizer's hyper-parameters (``learning_rate``, ``eps``,
            ``beta1``, ``weight_decay``, ``initial_accumulator_value``, ``gradient_clipping``,
            ``max_gradient``, FTRL's ...); an unknown one raises ``TypeError``.
    """

    def __init__(
        self,
        table_options: Sequence[DynamicEmbTableOptions],
        table_names: Sequence[str] | None = None,
        feature_table_map: Sequence[int] | None = None,
        pooling_mode: DynamicEmbPoolingMode = DynamicEmbPoolingMode.SUM,
        output_dtype: torch.dtype = torch.float32,
        device: torch.device | str | int | None = None,
        optimizer: object = "sgd",
        *,
        seed: int = 0,
        check_gradients: bool = True,
        **optimizer_kwargs: float | bool,
    ) -> None:
        super().__init__()
        options = list(table_options)
        if not options:
            raise TableConfigError("table_options", options, "needs at least one table")
        names = list(table_names or [f"table_{t}" for t in range(len(options))])
        if len(names) != len(options) or len(set(names)) != len(names):
            raise TableConfigError("table_names", names, "must be unique, one per table")
        ftm = list(range(len(options)) if feature_table_map is None else feature_table_map)
        if not ftm or any(not isinstance(t, int) or not 0 <= t < len(options) for t in ftm):
            raise TableConfigError("feature_table_map", ftm, "must be table indices")
        if output_dtype not in _OUTPUT_DTYPES:
            raise TableConfigError("output_dtype", output_dtype, "float32, float16 or bfloat16")
        self.pooling_mode = DynamicEmbPoolingMode(pooling_mode)
        self.output_dtype = output_dtype
        self.table_names = names
        self.feature_table_map = ftm
        self.device = resolve_device(device, options)
        self.optimizer = optimizer_spec(optimizer, optimizer_kwargs)
        configs = []
        for name, o in zip(names, options, strict=True):
            dtype = o.embedding_dtype or torch.float32
            state = self.optimizer.state_dim(o.dim, dtype) if o.dim else 0
            configs.append(table_config(o, state, name))
        self.options = options
        index_types = {o.index_type for o in options if o.index_type is not None}
        if len(index_types) > 1:
            raise TableConfigError(
                "index_type", sorted(map(str, index_types)), "tables of one module share it"
            )
        self.index_type: torch.dtype | None = index_types.pop() if index_types else None
        """The dtype ``indices`` must have when an option sets ``index_type`` (else int64 or
        int32)."""
        self.dims = [c.dim for c in configs]
        self.trainable = [o.training for o in options]
        if self.pooling_mode is DynamicEmbPoolingMode.NONE and len({self.dims[t] for t in ftm}) > 1:
            raise TableConfigError(
                "pooling_mode", self.pooling_mode, "NONE needs every feature's table of one dim"
            )
        placement = place_tables(options, configs, names, self.device)
        self.tables = ScoredHashTable(placement.configs, self.device, names=names)
        """The module's tables; for a caching table, its device cache."""
        pairs = list(zip(options, configs, strict=True))
        self.init_args = [o.initializer_args.complete(c.max_capacity) for o, c in pairs]
        self.eval_args = [o.eval_initializer_args.complete(c.max_capacity) for o, c in pairs]
        self.seeds = [table_seed(seed, t) for t in range(len(configs))]
        self.initial_states = [
            self.optimizer.initial_state(c.dim, c.dtype).float().to(self.device)
            if c.state_dim
            else None
            for c in configs
        ]
        specs = [new_rows_spec(a, s) for a, s in zip(self.init_args, self.seeds, strict=True)]
        self.admission = admission_of(
            [o.admit_strategy for o in options],
            [o.admission_counter for o in options],
            names,
            self.init_args,
            [c.max_capacity for c in configs],
            self.dims,
            self.seeds,
            self.device,
        )
        """The tables' admitters (:mod:`demb_torchrec._admission`), or None: every key is
        admitted."""
        self.step_counts = torch.zeros(len(configs), dtype=torch.int64)
        """``(T,)`` int64 on the CPU: each table's updates so far (Adam's bias correction)."""
        self.sums_workspace: torch.Tensor | None = (
            torch.empty(0, dtype=torch.float32) if self.device.type == "cpu" else None
        )
        """On the CPU, the tensor a backward sums its keys' gradients into, kept across steps:
        a fresh one faults in new pages every step (on a 2-core VM, 5-15 ms of a 20 ms SUM
        backward went to zero-filling the sums)."""
        self._state = ForwardState(
            tables=self.tables,
            dims=self.dims,
            feature_table_map=ftm,
            feature_tables=torch.tensor(ftm, dtype=torch.int64, device=self.device),
            pooling_mode=self.pooling_mode,
            output_dtype=output_dtype,
            device=self.device,
            optimizer=self.optimizer,
            check_gradients=check_gradients,
            step_counts=self.step_counts,
            sums_workspace=self.sums_workspace,
            eval_args=self.eval_args,
            seeds=self.seeds,
            new_rows=new_rows_args(self.dims, specs, self.initial_states),
            trigger=torch.zeros((), device=self.device, requires_grad=True),
            admission=self.admission,
        )
        self.features_of_table = self._state.features_of_table
        self.cache: CacheTier | None = None
        """The storage tier under the caching tables (:mod:`demb_torchrec._cache`), or None
        when no table caches."""
        if any(b is not None for b in placement.below):
            eval_specs = [
                new_rows_spec(a, s) for a, s in zip(self.eval_args, self.seeds, strict=True)
            ]
            self.cache = CacheTier(
                self._state,
                placement.below,
                new_rows_args(self.dims, eval_specs, [None] * len(configs)),
                placement.retains,
            )
        # The forward's paths, picked now (docs/architecture.md, "The table module's paths").
        self._train_path = train_path(self._state)
        self._eval_path = eval_path(self._state)
        # The tables built with training=False when a feature looks one up (else empty): a
        # training forward with grad then raises.
        self._frozen: list[str] = []
        if not all(self.trainable[t] for t in ftm):
            self._frozen = [n for n, ok in zip(names, self.trainable, strict=True) if not ok]

    @property
    def num_tables(self) -> int:
        """``T``."""
        return len(self.dims)

    @property
    def check_gradients(self) -> bool:
        """Whether each update first rejects NaN/inf gradients (one sync); settable."""
        return self._state.check_gradients

    @check_gradients.setter
    def check_gradients(self, check: bool) -> None:
        self._state.check_gradients = check

    @property
    def steps(self) -> list[int]:
        """Each table's updates so far (:attr:`step_counts` as a list)."""
        counts: list[int] = self.step_counts.tolist()
        return counts

    def set_score(self, table_name: str, score: int) -> None:
        """The score a CUSTOMIZED table gives the keys of the next forwards."""
        self.tables.set_score(self.table_names.index(table_name), score)

    # ------------------------------------------------------------------------------ forward
    def forward(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        pooling_weights: torch.Tensor | None = None,
        frequency_counters: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Look up a batch.

        Args:
            indices: ``(N,)`` int64/int32 keys, feature-major.
            offsets: ``(F * B + 1,)`` int64/int32 bag offsets (``offsets[0] = 0``,
                non-decreasing, ``offsets[-1] = N``).
            pooling_weights: ``(N,)`` float32 weights of a weighted SUM (not differentiable).
            frequency_counters: ``(N,)`` integer per-index counts for LFU scores (default:
                each occurrence counts 1).

        Returns:
            SUM / MEAN: ``(B, sum of the features' dims)``; NONE: ``(N, D)``;
            ``output_dtype``.
        """
        indices, offsets, batch_size = check_batch_args(
            indices, offsets, self.device, self.index_type, self._state.num_features
        )
        check_weight_args(indices, pooling_weights, frequency_counters, self.pooling_mode)
        grad = self.training and torch.is_grad_enabled()
        if grad and self._frozen:
            raise TrainingStateError(
                self._frozen,
                "built with training=False (no optimizer state): use module.eval() or "
                "torch.no_grad() to look them up",
            )
        if self.cache is not None:  # the trigger of this forward, not an earlier one's
            self._state.trigger = self.cache.base_trigger
        if indices.numel() == 0 or batch_size == 0:
            return self._empty(batch_size, grad)
        bags = Bags(indices, offsets, batch_size, pooling_weights, frequency_counters)
        try:
            if self.cache is not None:
                return self._cached_forward(bags, grad)
            if not self.training:
                return self._eval_path.forward(bags)
            out, status, bounds = self._train_path.forward(bags, grad)
        except ValueError as e:  # a native op's check of the batch's data: named as ours
            raise batch_error(e, self.table_names) from e
        if status is not None:  # the forward's work is queued: failed inserts are counted now
            counts = status_count_tensor(status, bounds)
            self.tables.record_failures(counts[1], int(status.numel()))
        return out if out.dtype == self.output_dtype else out.to(self.output_dtype)

    def value_buffers(self) -> list[torch.Tensor]:
        """Per table, the ``(capacity, dim + state)`` value rows."""
        return self.tables.values

    def prefetch(
        self,
        indices: torch.Tensor,
        offsets: torch.Tensor,
        forward_stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Read ahead, for the next forward, the rows of a batch's keys that the caching
        tables' caches miss and their storages hold (TorchRec's prefetch convention: call it
        with the next batch while the current step runs). The next forward takes them from the
        device instead of the storage; nothing else changes (no insert, no score). Nothing for
        a module without caching.

        Args:
            indices, offsets: the batch, as :meth:`forward` takes it.
            forward_stream: the CUDA stream the next forward runs on, when another one.
        """
        indices, offsets, batch_size = check_batch_args(
            indices, offsets, self.device, self.index_type, self._state.num_features
        )
        if self.cache is None or indices.numel() == 0 or batch_size == 0:
            return
        bags = Bags(indices, offsets, batch_size, None, None)
        try:
            self.cache.prefetch(bags, forward_stream)
        except ValueError as e:  # a native op's check of the batch's data: named as ours
            raise batch_error(e, self.table_names) from e

    def flush(self) -> None:
        """Write every row of the caching tables' caches back to their storage and empty the
        caches (the storage then holds every key); nothing for a module without caching."""
        if self.cache is not None:
            self.cache.flush()

    def cache_stats(self, reset: bool = True) -> dict[str, dict[str, int]]:
        """Per caching table, since the last read: ``cache_hits``, ``storage_hits``,
        ``misses`` (new keys), ``write_backs`` (rows written to the storage), ``overflows``
        (keys trained outside a full cache bucket), ``evictions`` (keys the storage dropped)
        and ``prefetched`` (storage hits read ahead by :meth:`prefetch`). Empty for a module
        without caching."""
        if self.cache is None:
            return {}
        stats = self.cache.read_stats(reset)
        below = self.cache.below
        return {n: st for n, st, b in zip(self.table_names, stats, below, strict=True) if b}

    # ------------------------------------------------------------------------------ internals
    def _cached_forward(self, bags: Bags, grad: bool) -> torch.Tensor:
        """A forward of a module with caching tables: the tier's lookup, then the training
        path's output (without gradient in eval)."""
        assert self.cache is not None
        if not self.training:
            out = self._train_path.output(self.cache.eval_lookup(bags), bags, False)
        else:
            batch, slots, status, _ = self.cache.train_lookup(bags, grad)
            out = self._train_path.output((batch, slots, status, None), bags, grad)
            counts = status_count_tensor(status, batch.table_bounds)
            self.tables.record_failures(counts[1], int(status.numel()))
        return out if out.dtype == self.output_dtype else out.to(self.output_dtype)

    def _empty(self, batch_size: int, grad: bool) -> torch.Tensor:
        """The output of a batch without indices; in training it still takes part in
        backward (a step with no rows: Adam's step count advances, as in FBGEMM)."""
        if self.pooling_mode is DynamicEmbPoolingMode.NONE:
            shape = (0, self.dims[self.feature_table_map[0]])
        else:
            shape = (batch_size, sum(self.dims[t] for t in self.feature_table_map))
        out = torch.zeros(shape, device=self.device)
        if grad:
            empty = [torch.zeros(0, d, device=self.device) for d in self.dims]
            none = [torch.zeros(0, dtype=torch.int64, device=self.device) for _ in self.dims]
            step = TrainStep(self._state, [out], none, lambda g: (empty, []))
            (out,) = trained_rows(self._state.trigger, step)
        return out.to(self.output_dtype)


BatchedDynamicEmbeddingTablesV2 = DynamicEmbeddingTables
"""The spec's name of :class:`DynamicEmbeddingTables`."""
