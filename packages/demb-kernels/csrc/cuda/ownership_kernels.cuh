// CUDA kernels of the ownership ops (plain CUDA, no torch headers). The bindings in
// ownership_cuda.cu allocate, order the steps and launch these on the caller's stream.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "ownership.h"

namespace demb {
namespace cuda {

constexpr int kThreads = 256;

inline unsigned int grid_for(int64_t n) {
  return static_cast<unsigned int>((n + kThreads - 1) / kThreads);
}

__device__ __forceinline__ void atomic_increment(int32_t* p) { atomicAdd(p, 1); }
__device__ __forceinline__ void atomic_increment(int64_t* p) {
  atomicAdd(reinterpret_cast<unsigned long long*>(p), 1ULL);
}

// out[i] = fmix64(u(keys[i])) for i < n.
template <typename Key>
__global__ void hash64_kernel(const Key* __restrict__ keys, int64_t n, int64_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = static_cast<int64_t>(fmix64(key_bits(keys[i])));
  }
}

// owner[i], local[i] = route_key(u(keys[i])) for i < n.
template <typename Key>
__global__ void route_keys_kernel(const Key* __restrict__ keys, int64_t n, DistType dist,
                                  uint64_t world, uint64_t block, int64_t* __restrict__ owner,
                                  int64_t* __restrict__ local) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const Route r = route_key(key_bits(keys[i]), dist, world, block);
    owner[i] = r.owner;
    local[i] = static_cast<int64_t>(r.local);
  }
}

// Segment of value j: the s with offsets[s] <= j < offsets[s + 1] (offsets has segments + 1).
__device__ __forceinline__ int64_t segment_of(const int64_t* __restrict__ offsets,
                                              int64_t segments, int64_t j) {
  int64_t lo = 0;
  int64_t hi = segments;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (offsets[mid + 1] <= j) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Step 1 of bucketize: the owner rank of every value, and the per-(rank, segment) counts
// new_lengths[owner * segments + segment] (zeroed by the caller). block_sizes (one per feature,
// a feature being `batch` consecutive segments) is read only for continuous.
template <typename Len, typename Key>
__global__ void bucketize_count_kernel(const int64_t* __restrict__ offsets, int64_t segments,
                                       int64_t batch, const Key* __restrict__ values, int64_t n,
                                       const int64_t* __restrict__ block_sizes, DistType dist,
                                       uint64_t world, int32_t* __restrict__ owners,
                                       Len* __restrict__ new_lengths) {
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < n;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t seg = segment_of(offsets, segments, j);
    const uint64_t block =
        dist == DistType::kContinuous ? static_cast<uint64_t>(block_sizes[seg / batch]) : 0;
    const int64_t owner = route_key(key_bits(values[j]), dist, world, block).owner;
    owners[j] = static_cast<int32_t>(owner);
    atomic_increment(new_lengths + owner * segments + seg);
  }
}

// Step 3 of bucketize, after a stable sort of the owners gave `order`: output position k takes
// input position order[k]. Weight is an unsigned word of the weights' element size.
template <typename Key, typename Weight>
__global__ void bucketize_scatter_kernel(const int64_t* __restrict__ order, int64_t n,
                                         const Key* __restrict__ values,
                                         const Weight* __restrict__ weights,
                                         Key* __restrict__ new_values,
                                         Weight* __restrict__ new_weights,
                                         int64_t* __restrict__ unbucketize) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = order[k];
    new_values[k] = values[i];
    unbucketize[i] = k;
    if (weights != nullptr) new_weights[k] = weights[i];
  }
}

}  // namespace cuda
}  // namespace demb
