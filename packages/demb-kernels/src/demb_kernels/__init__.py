"""demb-kernels: the native ops of demb (C++ CPU and CUDA kernels behind the ``demb`` library).

Import this package to load the ops; :mod:`demb_kernels.reference` holds a pure-PyTorch
reference of each op for tests.
"""

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
