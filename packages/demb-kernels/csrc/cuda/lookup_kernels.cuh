// CUDA kernels of gather_table_rows and segment_sum_rows (lookup_rule.h); plain CUDA, no torch
// headers. One warp per output row; each lane loads its elements of a 128-column block into
// registers before storing or adding them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "lookup_rule.h"

namespace demb {
namespace cuda {

constexpr int kLookupWarp = 32;
constexpr int kLookupThreads = 256;
constexpr int kLookupPerLane = 4;  // a 128-column block per warp pass
constexpr int kLookupBlock = kLookupWarp * kLookupPerLane;

__device__ __forceinline__ float lookup_float(float x) { return x; }
__device__ __forceinline__ float lookup_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float lookup_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ int64_t warp_index() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLookupWarp;
}

// out[i] (dim floats) = row slots[u] of table tables[u], u = inverse[i]; zeros when the slot is
// -1 or anything is out of range.
template <typename T>
__global__ void __launch_bounds__(kLookupThreads)
    gather_table_rows_kernel(const __grid_constant__ GatherTables g,
                             const int64_t* __restrict__ slots,
                             const int64_t* __restrict__ tables,
                             const int64_t* __restrict__ inverse, int64_t unique, int64_t n,
                             int64_t dim, float* __restrict__ out) {
  const int64_t i = warp_index();
  if (i >= n) return;
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t u = inverse[i];
  int64_t s = -1;
  int64_t t = 0;
  if (u >= 0 && u < unique) {
    s = slots[u];
    t = tables[u];
  }
  float* row = out + i * dim;
  const bool none = s < 0 || t < 0 || t >= g.count || s >= g.rows[t];
  const T* src = none ? nullptr : static_cast<const T*>(g.base[t]) + s * g.width[t];
  for (int64_t base = lane; base < dim; base += kLookupBlock) {
    float v[kLookupPerLane];
#pragma unroll
    for (int q = 0; q < kLookupPerLane; ++q) {
      const int64_t j = base + q * kLookupWarp;
      v[q] = (none || j >= dim) ? 0.0f : lookup_float(src[j]);
    }
#pragma unroll
    for (int q = 0; q < kLookupPerLane; ++q) {
      const int64_t j = base + q * kLookupWarp;
      if (j < dim) row[j] = v[q];
    }
  }
}

// Pass 1: chunk c of the segments (chunk_offsets (U + 1) counts them per segment) summed in k
// order into partial[c].
__global__ void __launch_bounds__(kLookupThreads)
    segment_chunk_sums_kernel(const float* __restrict__ grads, const int64_t* __restrict__ order,
                              const int64_t* __restrict__ starts,
                              const int64_t* __restrict__ chunk_offsets, int64_t unique,
                              int64_t n, int64_t d, int64_t max_chunks,
                              float* __restrict__ partial) {
  const int64_t c = warp_index();
  if (c >= max_chunks || c >= chunk_offsets[unique]) return;
  int64_t lo = 0;
  int64_t hi = unique;  // the segment u with chunk_offsets[u] <= c < chunk_offsets[u + 1]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (chunk_offsets[mid] <= c) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const int64_t u = lo;
  const int64_t seg_end = u + 1 < unique ? starts[u + 1] : n;
  const int64_t begin = starts[u] + (c - chunk_offsets[u]) * kSegmentChunk;
  const int64_t end = begin + kSegmentChunk < seg_end ? begin + kSegmentChunk : seg_end;
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  for (int64_t col0 = lane; col0 < d; col0 += kLookupBlock) {
    float acc[kLookupPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t k = begin; k < end; ++k) {
      const float* r = grads + order[k] * d;
#pragma unroll
      for (int q = 0; q < kLookupPerLane; ++q) {
        const int64_t col = col0 + q * kLookupWarp;
        if (col < d) acc[q] += r[col];
      }
    }
#pragma unroll
    for (int q = 0; q < kLookupPerLane; ++q) {
      const int64_t col = col0 + q * kLookupWarp;
      if (col < d) partial[c * d + col] = acc[q];
    }
  }
}

// Pass 2: out[u] = the chunk sums of segment u, added in chunk order.
__global__ void __launch_bounds__(kLookupThreads)
    segment_finish_kernel(const float* __restrict__ partial,
                          const int64_t* __restrict__ chunk_offsets, int64_t unique, int64_t d,
                          float* __restrict__ out) {
  const int64_t u = warp_index();
  if (u >= unique) return;
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  for (int64_t col0 = lane; col0 < d; col0 += kLookupBlock) {
    float acc[kLookupPerLane] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t c = chunk_offsets[u]; c < chunk_offsets[u + 1]; ++c) {
#pragma unroll
      for (int q = 0; q < kLookupPerLane; ++q) {
        const int64_t col = col0 + q * kLookupWarp;
        if (col < d) acc[q] += partial[c * d + col];
      }
    }
#pragma unroll
    for (int q = 0; q < kLookupPerLane; ++q) {
      const int64_t col = col0 + q * kLookupWarp;
      if (col < d) out[u * d + col] = acc[q];
    }
  }
}

}  // namespace cuda
}  // namespace demb
