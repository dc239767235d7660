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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from demb_kernels.init_rows import init_new_rows, new_rows_args
from demb_kernels.lookup import (
    MAX_GATHER_TABLES,
    gather_table_rows,
    status_count_tensor,
)
from demb_optim import reduce_gradients
from demb_storage import (
    InsertOutcome,
    ScoredHashTable,
    TableConfigError,
    new_rows_spec,
    table_seed,
)
from torch.nn import functional

from demb_torchrec._args import check_batch_args, check_weight_args, optimizer_spec, resolve_device
from demb_torchrec._autograd import Reduced, TrainStep, summed_per_key, trained_rows
from demb_torchrec._dedup import DedupedBatch, dedup
from demb_torchrec._direct import eval_none, eval_pooled, pooled_from_tables
from demb_torchrec._launched import launched_find_or_insert
from demb_torchrec._pooling import bag_rows, pool, pool_uniform
from demb_torchrec._unique_rows import is_zero, unique_rows
from demb_torchrec.options import DynamicEmbPoolingMode, DynamicEmbTableOptions, table_config

__all__ = ["BatchedDynamicEmbeddingTablesV2", "DynamicEmbeddingTables"]

_OUTPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NONE = DynamicEmbPoolingMode.NONE


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
        self.check_gradients = check_gradients
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
        self.tables = ScoredHashTable(configs, self.device)
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
        self._new_rows = new_rows_args(self.dims, specs, self.initial_states)
        self.step_counts = torch.zeros(len(configs), dtype=torch.int64)
        """``(T,)`` int64 on the CPU: each table's updates so far (Adam's bias correction)."""
        self.features_of_table = [
            [f for f, t in enumerate(ftm) if t == tt] for tt in range(len(configs))
        ]
        self._feature_tables = torch.tensor(ftm, dtype=torch.int64, device=self.device)
        # Tables whose missing keys an eval forward fills (eval_initializer_args not zeros).
        self._eval_fills = [
            t for t, a in enumerate(self.eval_args) if self.features_of_table[t] and not is_zero(a)
        ]
        # An eval SUM / MEAN pools straight from float32 tables when no missing key needs an
        # eval initializer other than zeros (no dedup).
        self._eval_pools_slots = not self._eval_fills and all(
            c.dtype == torch.float32 for c in configs
        )
        # A training SUM / MEAN pools straight from float32 tables of one dim (no gather of the
        # unique keys' rows) unless gradients are clipped per occurrence.
        self._train_pools_slots = (
            len(set(self.dims)) == 1
            and all(c.dtype == torch.float32 for c in configs)
            and not self.optimizer.gradient_clipping
        )
        # One-launch gathers (demb::gather_table_rows) need one dim, one dtype, <= 64 tables.
        self._fused_gather = (
            len(set(self.dims)) == 1
            and len({c.dtype for c in configs}) == 1
            and len(configs) <= MAX_GATHER_TABLES
        )
        # So does pooling every feature's bags in one pass (demb::pool_table_rows), from float32
        # rows. (On the CPU since f2cff25 and 233c0d4 too: the scaled SUM benchmark's eval
        # forward took 0.84-0.86 ms with it against 1.06-1.17 ms for one embedding_bag per
        # feature and their cat, on a 2-vCPU VM.)
        self._pools_in_one_pass = self._fused_gather and configs[0].dtype == torch.float32
        self.sums_workspace: torch.Tensor | None = (
            torch.empty(0, dtype=torch.float32) if self.device.type == "cpu" else None
        )
        """On the CPU, the tensor a backward sums its keys' gradients into, kept across steps:
        a fresh one faults in new pages every step (on a 2-core VM, 5-15 ms of a 20 ms SUM
        backward went to zero-filling the sums)."""
        self._trigger = torch.zeros((), device=self.device, requires_grad=True)
        # The dedup's guesses: the low bits the keys differ in, and a radix that packs (table,
        # key) in fewer sort passes (demb_kernels.launched.packed_radix; 0: none). A list: set
        # in place on the hot path, no nn.Module attribute set.
        self._key_bits = [64, 0]
        # Whether the last training batch had every key in the table: then the next one asks
        # find_or_insert for its rows (read before the all-found read-back, wasted on a miss).
        self._found_whole = [False]

    @property
    def num_tables(self) -> int:
        """``T``."""
        return len(self.dims)

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
        features = len(self.feature_table_map)
        indices, offsets, batch_size = check_batch_args(
            indices, offsets, self.device, self.index_type, features
        )
        check_weight_args(indices, pooling_weights, frequency_counters, self.pooling_mode)
        grad = self.training and torch.is_grad_enabled()
        if grad and not all(self.trainable[t] for t in self.feature_table_map):
            frozen = [n for n, ok in zip(self.table_names, self.trainable, strict=True) if not ok]
            raise RuntimeError(
                f"tables {frozen} were built with training=False (no optimizer state): use "
                "module.eval() or torch.no_grad() to look them up"
            )
        if indices.numel() == 0 or batch_size == 0:
            return self._empty(batch_size, grad)
        if not self.training and self._fused_gather and self.pooling_mode is _NONE:
            return eval_none(self, indices, offsets, batch_size).to(self.output_dtype)
        if not self.training and self.pooling_mode is not _NONE and self._eval_pools_slots:
            return eval_pooled(self, indices, offsets, batch_size, pooling_weights)
        status: torch.Tensor | None = None
        missing: list[int] | None = None  # per table, keys without a slot (None: unknown)
        gathered: torch.Tensor | None = None  # the NONE rows, read by find_or_insert
        launched = None
        if self.training and self.device.type == "cuda" and not self.tables.may_grow:
            launched = launched_find_or_insert(
                self, indices, offsets, batch_size, frequency_counters
            )  # one sync; None: the dedup must sort on more key bits
        if launched is not None:
            batch, slots, status, gathered = launched
        else:
            # The batch scores are made before the dedup's sync, not in the idle gap after it.
            scores = self.tables.next_score_args() if self.training else None
            batch = dedup(
                indices,
                offsets,
                self._feature_tables,
                self.num_tables,
                batch_size,
                frequency_counters,
                self._key_bits[0],
            )
            self._key_bits[0] = batch.key_bits  # the next batch's keys likely span as many
            if scores is not None:
                slots, status, gathered = self._find_or_insert(batch, scores)
            else:
                slots, missing = self._find(batch)
        fills = missing is not None and any(missing)
        fills = fills and not all(is_zero(a) for a in self.eval_args)
        if self._fused_gather and self.pooling_mode is _NONE and not fills:
            out = self._forward_none(batch, slots, grad, gathered)
        elif self.training and self.pooling_mode is not _NONE and self._train_pools_slots:
            out = pooled_from_tables(self, batch, slots, offsets, batch_size, pooling_weights, grad)
        else:
            rows, whole = unique_rows(self, batch, slots, missing, not self.training)
            args = (offsets, batch_size)
            if whole is not None:
                out = self._forward_uniform(batch, slots, whole, grad, args, pooling_weights)
            else:
                out = self._forward_mixed(batch, slots, rows, grad, args, pooling_weights)
        if status is not None:  # the forward's work is queued: failed inserts are counted now
            counts = status_count_tensor(status, batch.table_bounds)
            self.tables.record_failures(counts[1], int(status.numel()))
        return out if out.dtype == self.output_dtype else out.to(self.output_dtype)

    def value_buffers(self) -> list[torch.Tensor]:
        """Per table, the ``(capacity, dim + state)`` value rows."""
        return self.tables.values

    # ------------------------------------------------------------------------------ internals
    def _forward_none(
        self,
        batch: DedupedBatch,
        slots: torch.Tensor,
        grad: bool,
        gathered: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """No pooling: each occurrence's row read straight from its table (one launch, or
        ``gathered``: those rows, read by find_or_insert), and in backward each key's
        occurrence gradients summed in the dedup's sorted order."""
        out = gathered
        if out is None:
            out = gather_table_rows(
                self.tables.values, slots, batch.tables, batch.inverse, self.dims[0], check=False
            )
        if not grad:
            return out
        return summed_per_key(self, self._trigger, batch, slots, out, self.dims[0])

    def _forward_uniform(
        self,
        batch: DedupedBatch,
        slots: torch.Tensor,
        whole: torch.Tensor,
        grad: bool,
        args: tuple[torch.Tensor, int],
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """Every feature of one dim: rows of all tables in one ``(U, D)`` tensor."""
        offsets, batch_size = args
        features = len(self.feature_table_map)
        index: torch.Tensor | None = batch.inverse
        if grad and self.optimizer.gradient_clipping:  # one row per occurrence: clipped first
            occurrences = functional.embedding(batch.inverse, whole)
            unique = whole.shape[0]

            def reduce_occurrences(g: Sequence[torch.Tensor]) -> Reduced:
                summed = reduce_gradients(self.optimizer, g[0], batch.inverse, unique)
                return batch.per_table(summed), [summed]

            step = TrainStep(self, [occurrences], batch.per_table(slots), reduce_occurrences)
            (whole,) = trained_rows(self._trigger, step)
            index = None
        elif grad and self.pooling_mode is not _NONE:
            return self._pooled_trained(batch, slots, whole, offsets, batch_size, weights)
        elif grad:
            step = TrainStep(
                self,
                [whole],
                batch.per_table(slots),
                lambda g: (batch.per_table(g[0]), [g[0]]),
            )
            (whole,) = trained_rows(self._trigger, step)
        return pool_uniform(whole, index, offsets, batch_size, features, self.pooling_mode, weights)

    def _pooled_trained(
        self,
        batch: DedupedBatch,
        slots: torch.Tensor,
        whole: torch.Tensor,
        offsets: torch.Tensor,
        batch_size: int,
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """SUM / MEAN over one dim, trained: the bags pooled outside autograd, and in backward
        each key's gradient summed straight from its bags' output gradients (scaled by weight,
        or by ``1 / bag size`` for MEAN) in the dedup's order, as the NONE path sums its rows:
        no ``(U, D)`` gradient of the pooling and no sort in backward."""
        features = len(self.feature_table_map)
        with torch.no_grad():
            out = pool_uniform(
                whole, batch.inverse, offsets, batch_size, features, self.pooling_mode, weights
            )
        n = batch.order.numel()
        rows, scale = bag_rows(offsets, batch_size, features, n, self.pooling_mode, weights)
        return summed_per_key(self, self._trigger, batch, slots, out, whole.shape[1], rows, scale)

    def _forward_mixed(
        self,
        batch: DedupedBatch,
        slots: torch.Tensor,
        rows: list[torch.Tensor],
        grad: bool,
        args: tuple[torch.Tensor, int],
        weights: torch.Tensor | None,
    ) -> torch.Tensor:
        """Tables of several dims: per-feature pooling over per-table rows."""
        offsets, batch_size = args
        ftm, bounds = self.feature_table_map, batch.feature_bounds
        local = [
            batch.inverse[bounds[f] : bounds[f + 1]] - batch.table_bounds[t]
            for f, t in enumerate(ftm)
        ]
        sources = [rows[t] for t in ftm]
        if grad and self.optimizer.gradient_clipping:
            per_feature = [
                functional.embedding(i, rows[t]) for t, i in zip(ftm, local, strict=True)
            ]
            at_occurrence = list(local)

            def reduce_occurrences(g: Sequence[torch.Tensor]) -> Reduced:
                summed = []
                for t, feats in enumerate(self.features_of_table):
                    count = batch.table_bounds[t + 1] - batch.table_bounds[t]
                    if not feats:
                        summed.append(torch.zeros(count, self.dims[t], device=self.device))
                        continue
                    occ = torch.cat([g[f] for f in feats])
                    at = torch.cat([at_occurrence[f] for f in feats])
                    summed.append(reduce_gradients(self.optimizer, occ, at, count))
                return summed, summed

            step = TrainStep(self, per_feature, batch.per_table(slots), reduce_occurrences)
            sources = list(trained_rows(self._trigger, step))
            local = [torch.arange(s.shape[0], device=self.device) for s in sources]
        elif grad:
            step = TrainStep(self, rows, batch.per_table(slots), lambda g: (list(g), list(g)))
            outs = trained_rows(self._trigger, step)
            sources = [outs[t] for t in ftm]
        return pool(sources, local, offsets, batch_size, bounds, self.pooling_mode, weights)

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
            (out,) = trained_rows(
                self._trigger, TrainStep(self, [out], none, lambda g: (empty, []))
            )
        return out.to(self.output_dtype)

    def _find_or_insert(
        self, batch: DedupedBatch, scores: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Slots of the batch's unique keys, inserting missing ones, and their
        :class:`InsertStatus` (None when every key was found: all HIT); the new rows (and their
        optimizer state) are initialized by one launch queued behind the insert: no sync. Keys
        that got no slot (FAILED) have slot -1, and are counted once the forward's work is
        queued. ``scores``: the batch scores, made before the dedup (``next_score_args``).
        With NONE pooling from one-launch gathers, a batch whose keys are all found also
        returns its output rows, read by find_or_insert (None otherwise), when the previous
        batch was found whole too (a batch with a new key would waste that read)."""
        gather = (batch.inverse, self.dims[0]) if self._gathers_rows() else None
        outcome = self.tables.find_or_insert(
            batch.keys,
            batch.tables,
            counts=batch.occurrence_counts(),
            zero_new_rows=False,
            check=False,
            count_failures=False,
            score_args=scores,
            gather_rows=gather,
        )
        return self._initialize_new(batch, outcome)

    def _gathers_rows(self) -> bool:
        """Whether find_or_insert also reads the NONE output rows (kept only when every key is
        found): one-launch gathers from tables on the module's device, and the previous batch
        found whole (a batch with a new key would waste that read)."""
        fused = self._fused_gather and self.pooling_mode is _NONE
        return fused and self._found_whole[0] and self.tables.values[0].device == self.device

    def _initialize_new(
        self, batch: DedupedBatch, outcome: InsertOutcome
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """After a find_or_insert of ``batch``'s unique keys: ``(slots, status, rows)``, the new
        rows (and their optimizer state) initialized by one launch queued behind the insert;
        status and rows None as :meth:`_find_or_insert` returns them."""
        self._found_whole[0] = outcome.all_hit
        if outcome.all_hit:  # no row is new and none failed: nothing to initialize or count
            return outcome.slots, None, outcome.rows
        init_new_rows(
            self.tables.values,
            outcome.slots,
            batch.keys,
            batch.tables,
            outcome.status,
            self._new_rows,
        )
        return outcome.slots, outcome.status, None

    def _find(self, batch: DedupedBatch) -> tuple[torch.Tensor, list[int]]:
        slots = self.tables.find(batch.keys, batch.tables, check=False)
        return slots, batch.count_per_table(slots < 0)


BatchedDynamicEmbeddingTablesV2 = DynamicEmbeddingTables
"""The spec's name of :class:`DynamicEmbeddingTables`."""
