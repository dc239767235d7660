"""The spec's ``dynamicemb.types``: the :class:`Storage` interface an external storage
implements (``DynamicEmbTableOptions.external_storage``), and :class:`DynamicEmbeddingTable`,
the default storage (a table's own hash table). Both are demb-storage's
(:mod:`demb_storage.storage`, docs/storage.md)."""

from __future__ import annotations

from demb_storage import DynamicEmbeddingTable, Storage

__all__ = ["DynamicEmbeddingTable", "Storage"]
