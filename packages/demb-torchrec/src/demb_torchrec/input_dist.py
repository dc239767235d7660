"""The row-wise input dist of dynamic tables: each key goes to the rank that owns it.

TorchRec's row-wise input dist bucketizes ids by row blocks and turns them into local row
numbers (FBGEMM's ``block_bucketize_sparse_features``): that needs ids below
``num_embeddings``. A dynamic table takes any int64 key, so this dist routes keys by the table's
``dist_type`` (the ownership rule of :mod:`demb_planner.ownership`, run by
:func:`demb_kernels.bucketize_by_owner`) and sends them unchanged, in the same layout TorchRec's
all-to-all and sequence output dist expect.

For an ``EmbeddingCollection`` (one row back per id) the dist first deduplicates each
feature's ids: a key is sent once per feature, with its number of occurrences as the KJT's
(float32) weight (the owner counts them as LFU frequency, so scores are those of the full
batch), and :attr:`unbucketize_permute_tensor` maps each original id to its unique key's
returned row (TorchRec's output dist selects the rows by it with ``index_select``, whose
backward sums the occurrences' gradients). An ``EmbeddingBagCollection``'s dist sends bags as
they are: the owner pools them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from demb_kernels import bucketize_by_owner
from demb_planner import continuous_block_size
from torchrec.distributed.dist_data import KJTAllToAll
from torchrec.distributed.embedding_sharding import BaseSparseFeaturesDist
from torchrec.distributed.sharding.rw_sharding import RwSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from demb_torchrec._dedup import dedup
from demb_torchrec.errors import ConfigError, InputTypeError, NotSupportedError

__all__ = ["DynamicRwSparseFeaturesDist"]


class DynamicRwSparseFeaturesDist(RwSparseFeaturesDist):  # type: ignore[misc]
    """Route each feature's keys to their owner ranks, then all-to-all them (TorchRec's
    ``KJTAllToAll``).

    A subclass of TorchRec's ``RwSparseFeaturesDist`` only because TorchRec's sharded
    collection reads :attr:`unbucketize_permute_tensor` from dists of that type; none of its
    state (row blocks) is used.

    Args:
        pg: the process group the tables are sharded over.
        num_features: features of the batch (all routed by one rule).
        dist_type: ``"roundrobin"``, ``"hash_roundrobin"`` or ``"continuous"``.
        feature_hash_sizes: ``num_embeddings`` of each feature's table (``continuous``
            blocks are ``ceil(num_embeddings / world_size)`` keys).
        is_sequence: keep the permutation that puts the looked-up rows back in input order
            (:attr:`unbucketize_permute_tensor`, for the sequence output dist).
        device: where the block sizes live.
        dedup: (sequence only) send each feature's unique keys once, with their counts as
            weights. Off where the tables clip gradients per occurrence (the owner would
            see one summed gradient per key instead).
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        num_features: int,
        dist_type: str,
        feature_hash_sizes: list[int],
        is_sequence: bool,
        device: torch.device | None = None,
        dedup: bool = False,
    ) -> None:
        if dedup and not is_sequence:
            raise ConfigError("dedup: only a sequence dist (one row per id) deduplicates ids")
        BaseSparseFeaturesDist.__init__(self)  # not RwSparseFeaturesDist's row blocks
        self._world_size: int = pg.size()
        self._dist_type = dist_type
        self._block_sizes: torch.Tensor | None = None
        if dist_type == "continuous":
            sizes = [continuous_block_size(n, self._world_size) for n in feature_hash_sizes]
            self._block_sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        self._is_sequence = is_sequence
        self._dedup = dedup
        self._num_features = num_features
        self._feature_ids = torch.arange(num_features, dtype=torch.int64, device=device)
        self._key_bits = [64]
        self._dist = KJTAllToAll(pg=pg, splits=[num_features] * self._world_size)
        self.unbucketize_permute_tensor: torch.Tensor | None = None

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Route ``sparse_features`` (one stride for every feature) and start the
        all-to-all."""
        if sparse_features.variable_stride_per_key():
            raise NotSupportedError(
                "variable_stride_per_key",
                "dynamic tables: variable batch sizes per feature are not supported yet",
            )
        values = sparse_features.values()
        if values.dtype not in (torch.int64, torch.int32):
            raise InputTypeError(
                "values",
                f"the ids of features {sparse_features.keys()} must be int64 or int32, got "
                f"{values.dtype}",
            )
        lengths = sparse_features.lengths().view(-1)
        weights = sparse_features.weights_or_none()
        stride = sparse_features.stride()
        inverse: torch.Tensor | None = None
        if self._dedup and values.numel() and stride:
            lengths, values, weights, inverse = self._unique(sparse_features, stride)
        routed = bucketize_by_owner(
            lengths,
            values,
            self._world_size,
            self._dist_type,
            weights=weights,
            block_sizes=self._block_sizes,
        )
        permute = routed.unbucketize_permute
        if inverse is not None:
            permute = permute[inverse]
        self.unbucketize_permute_tensor = permute if self._is_sequence else None
        bucketized = KeyedJaggedTensor(
            keys=list(sparse_features.keys()) * self._world_size,
            values=routed.values,
            weights=routed.weights,
            lengths=routed.lengths,
            stride=stride,
        )
        out: Awaitable[Awaitable[KeyedJaggedTensor]] = self._dist(bucketized)
        return out

    def _unique(
        self, features: KeyedJaggedTensor, stride: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each feature's unique keys as the feature's first bag: ``(lengths, keys, counts,
        inverse)``, ``inverse`` ``(N,)`` the position in ``keys`` of each original id."""
        values = features.values().to(torch.int64)
        counters = features.weights_or_none()
        batch = dedup(
            values,
            features.offsets().to(torch.int64),
            self._feature_ids.to(values.device),
            self._num_features,
            stride,
            None if counters is None else counters.to(torch.int64),
            self._key_bits[0],
        )
        self._key_bits[0] = batch.key_bits
        per_feature = torch.tensor(
            [batch.table_bounds[f + 1] - batch.table_bounds[f] for f in range(self._num_features)],
            dtype=features.lengths().dtype,
            device=values.device,
        )
        lengths = torch.zeros(
            (self._num_features, stride), dtype=per_feature.dtype, device=values.device
        )
        lengths[:, 0] = per_feature
        # float32 weights (what KJT weights and the bucketize op carry; exact below 2**24)
        counts = batch.occurrence_counts().to(torch.float32)
        return lengths.view(-1), batch.keys, counts, batch.inverse
