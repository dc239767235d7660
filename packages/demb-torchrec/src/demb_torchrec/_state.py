"""What the table module's forward paths share: :class:`ForwardState`, built once by
:class:`~demb_torchrec.DynamicEmbeddingTables` and handed to each path object in place of the
module (the paths never import the module)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import torch
from demb_kernels.init_rows import NewRowsArgs
from demb_kernels.lookup import MAX_GATHER_TABLES
from demb_optim import OptimizerSpec
from demb_storage import InitializerArgs, InitializerMode, ScoredHashTable

from demb_torchrec.options import DynamicEmbPoolingMode

if TYPE_CHECKING:
    from demb_torchrec._admission import ModuleAdmission

__all__ = ["Bags", "ForwardState", "is_zero"]


class Bags(NamedTuple):
    """A checked, non-empty batch in TBE layout, as the forward paths take it."""

    indices: torch.Tensor
    """``(N,)`` int64 keys, feature-major."""
    offsets: torch.Tensor
    """``(F * B + 1,)`` int64 bag offsets (``offsets[0] = 0``, non-decreasing, ``N`` last)."""
    batch_size: int
    """``B``."""
    weights: torch.Tensor | None
    """``(N,)`` float32 weights of a weighted SUM, or None."""
    counters: torch.Tensor | None
    """``(N,)`` integer per-index counts for LFU scores, or None (each occurrence counts 1)."""


def is_zero(args: InitializerArgs) -> bool:
    """Whether ``args`` initializes rows to zeros (CONSTANT 0)."""
    return args.mode is InitializerMode.CONSTANT and args.value == 0.0


@dataclasses.dataclass(slots=True, eq=False)
class ForwardState:
    """The module's tables and settings as its forward paths read them; one object, shared by
    the module and every path (the lists ``key_bits`` and ``found_whole`` are set in place on
    the hot path). It is also what the backward's update reads
    (:class:`demb_torchrec._autograd.Updatable`).

    The fields after ``trigger`` are derived from the others when the state is built.
    """

    tables: ScoredHashTable
    """The fused tables (their ``values`` may be replaced when a table grows: read per call)."""
    dims: list[int]
    """``T`` embedding dims."""
    feature_table_map: list[int]
    """The table of each feature."""
    feature_tables: torch.Tensor
    """``(F,)`` int64 on :attr:`device`: :attr:`feature_table_map` as a tensor."""
    pooling_mode: DynamicEmbPoolingMode
    output_dtype: torch.dtype
    device: torch.device
    optimizer: OptimizerSpec
    check_gradients: bool
    """Before each update, reject NaN/inf gradients (one sync)."""
    step_counts: torch.Tensor
    """``(T,)`` int64 on the CPU: each table's updates so far (Adam's bias correction)."""
    sums_workspace: torch.Tensor | None
    """On the CPU, a float32 tensor the backward's sums go into (resized in place)."""
    eval_args: list[InitializerArgs]
    """Per table, what an eval forward reads for a missing key."""
    seeds: list[int]
    """Per table, its initializer seed."""
    new_rows: NewRowsArgs
    """:func:`demb_kernels.init_rows.init_new_rows`' per-table arguments."""
    trigger: torch.Tensor
    """The zero-size tensor that requires grad: what wires a step's rows to its update."""
    admission: ModuleAdmission | None = None
    """The module's admitters, or None (every table admits every key)."""
    rejected: list[torch.Tensor | None] = dataclasses.field(default_factory=lambda: [None])
    """With admission, the last training batch's ``(U,)`` bool keys the admitters rejected
    (set in place by the lookup, read by the path that makes the rows)."""
    key_bits: list[int] = dataclasses.field(default_factory=lambda: [64, 0])
    """The dedup's guesses: the low bits the keys differ in, and a radix that packs (table,
    key) in fewer sort passes (:func:`demb_kernels.launched.packed_radix`; 0: none)."""
    found_whole: list[bool] = dataclasses.field(default_factory=lambda: [False])
    """Whether the last training batch had every key in the table: then the next one asks
    find_or_insert for its rows (read before the all-found read-back, wasted on a miss)."""
    num_tables: int = dataclasses.field(init=False)
    """``T``."""
    num_features: int = dataclasses.field(init=False)
    """``F``."""
    dim: int = dataclasses.field(init=False)
    """The first table's dim: every table's on the paths of one dim."""
    features_of_table: list[list[int]] = dataclasses.field(init=False)
    """Per table, its features."""
    one_dim: bool = dataclasses.field(init=False)
    """Every table has one dim."""
    fused_gather: bool = dataclasses.field(init=False)
    """One-launch gathers (``demb::gather_table_rows``): one dim, one dtype, <= 64 tables."""
    pools_in_one_pass: bool = dataclasses.field(init=False)
    """Every feature's bags pooled in one pass (``demb::pool_table_rows``): one-launch gathers
    from float32 rows, on the CPU too (the scaled SUM benchmark's eval forward took 0.84-0.86 ms
    with it against 1.06-1.17 ms for one embedding_bag per feature and their cat, on a 2-vCPU
    VM)."""
    gathers_none_rows: bool = dataclasses.field(init=False)
    """NONE pooling from one-launch gathers: a training find_or_insert may read the output
    rows itself (:meth:`gathers_rows`)."""

    def __post_init__(self) -> None:
        configs = self.tables.configs
        self.num_tables = len(self.dims)
        self.num_features = len(self.feature_table_map)
        self.dim = self.dims[0]
        self.features_of_table = [
            [f for f, t in enumerate(self.feature_table_map) if t == tt]
            for tt in range(self.num_tables)
        ]
        self.one_dim = len(set(self.dims)) == 1
        self.fused_gather = (
            self.one_dim
            and len({c.dtype for c in configs}) == 1
            and len(configs) <= MAX_GATHER_TABLES
        )
        self.pools_in_one_pass = self.fused_gather and configs[0].dtype == torch.float32
        self.gathers_none_rows = (
            self.fused_gather and self.pooling_mode is DynamicEmbPoolingMode.NONE
        )

    def value_buffers(self) -> list[torch.Tensor]:
        """Per table, the ``(capacity, dim + state)`` value rows."""
        return self.tables.values

    def gathers_rows(self) -> bool:
        """Whether a training find_or_insert also reads the NONE output rows (kept only when
        every key is found): one-launch gathers from tables on the module's device, and the
        previous batch found whole (a batch with a new key would waste that read)."""
        return (
            self.gathers_none_rows
            and self.found_whole[0]
            and self.tables.values[0].device == self.device
        )
