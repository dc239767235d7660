"""The specification's ``dynamicemb.shard`` path: the sharders, under the name the spec imports.

``from demb_torchrec.shard import DynamicEmbeddingCollectionSharder`` is
:class:`demb_torchrec.sharders.DynamicEmbeddingCollectionSharder`.
"""

from __future__ import annotations

from demb_torchrec.sharders import (
    DynamicEmbeddingBagCollectionSharder,
    DynamicEmbeddingCollectionSharder,
)

__all__ = ["DynamicEmbeddingBagCollectionSharder", "DynamicEmbeddingCollectionSharder"]
