"""The row-wise input dist of dynamic tables: each key goes to the rank that owns it.

TorchRec's row-wise input dist bucketizes ids by row blocks and turns them into local row
numbers (FBGEMM's ``block_bucketize_sparse_features``): that needs ids below
``num_embeddings``. A dynamic table takes any int64 key, so this dist routes keys by the table's
``dist_type`` (the ownership rule of :mod:`demb_planner.ownership`, run by
:func:`demb_kernels.bucketize_by_owner`) and sends them unchanged, in the same layout TorchRec's
all-to-all and sequence output dist expect.
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
    """

    def __init__(
        self,
        pg: dist.ProcessGroup,
        num_features: int,
        dist_type: str,
        feature_hash_sizes: list[int],
        is_sequence: bool,
        device: torch.device | None = None,
    ) -> None:
        BaseSparseFeaturesDist.__init__(self)  # not RwSparseFeaturesDist's row blocks
        self._world_size: int = pg.size()
        self._dist_type = dist_type
        self._block_sizes: torch.Tensor | None = None
        if dist_type == "continuous":
            sizes = [continuous_block_size(n, self._world_size) for n in feature_hash_sizes]
            self._block_sizes = torch.tensor(sizes, dtype=torch.int64, device=device)
        self._is_sequence = is_sequence
        self._dist = KJTAllToAll(pg=pg, splits=[num_features] * self._world_size)
        self.unbucketize_permute_tensor: torch.Tensor | None = None

    def forward(
        self, sparse_features: KeyedJaggedTensor
    ) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        """Route ``sparse_features`` (one stride for every feature) and start the
        all-to-all."""
        if sparse_features.variable_stride_per_key():
            raise NotImplementedError(
                "dynamic tables: variable batch sizes per feature are not supported yet"
            )
        routed = bucketize_by_owner(
            sparse_features.lengths().view(-1),
            sparse_features.values(),
            self._world_size,
            self._dist_type,
            weights=sparse_features.weights_or_none(),
            block_sizes=self._block_sizes,
        )
        self.unbucketize_permute_tensor = routed.unbucketize_permute if self._is_sequence else None
        bucketized = KeyedJaggedTensor(
            keys=list(sparse_features.keys()) * self._world_size,
            values=routed.values,
            weights=routed.weights,
            lengths=routed.lengths,
            stride=sparse_features.stride(),
        )
        out: Awaitable[Awaitable[KeyedJaggedTensor]] = self._dist(bucketized)
        return out
