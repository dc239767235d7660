"""demb-kernels: the native ops of demb (C++ CPU and CUDA kernels behind the ``demb`` library).

Import this package to load the ops and register their fake (meta) kernels.
:mod:`demb_kernels.ops` has the key-routing ops, :mod:`demb_kernels.table` the scored hash
table's index and ops (docs/hash_table.md), :mod:`demb_kernels.rows` the value-row copies;
:mod:`demb_kernels.reference` and :mod:`demb_kernels.table_reference` are the pure references
the tests compare against.
"""

from demb_kernels import (  # noqa: F401  (register the ops' fake kernels)
    _fakes,
    delta_ops,
    launched,
    lookup,
    pooling,
    rows,
)
from demb_kernels._library import OPS, cuda_kernels_built, has_kernel
from demb_kernels.ops import BucketizedFeatures, bucketize_by_owner, hash64, route_keys

__all__ = [
    "OPS",
    "BucketizedFeatures",
    "bucketize_by_owner",
    "cuda_kernels_built",
    "has_kernel",
    "hash64",
    "route_keys",
]
