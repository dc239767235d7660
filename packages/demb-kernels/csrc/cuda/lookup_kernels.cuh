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

// out[i] (dim floats) = row slots[u] of table tables[u], u = inverse[i] (u = i without
// inverse); zeros when the slot is -1 or anything is out of range. With `Vec4` (float32 rows,
// dim, widths and bases multiples of 4 floats) each lane moves 16 bytes at a time.
template <typename T, bool Vec4>
__global__ void __launch_bounds__(kLookupThreads)
    gather_table_rows_kernel(const __grid_constant__ GatherTables g,
                             const int64_t* __restrict__ slots,
                             const int64_t* __restrict__ tables,
                             const int64_t* __restrict__ inverse, int64_t unique, int64_t n,
                             int64_t dim, float* __restrict__ out) {
  const int64_t i = warp_index();
  if (i >= n) return;
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t u = inverse ? inverse[i] : i;
  int64_t s = -1;
  int64_t t = 0;
  if (u >= 0 && u < unique) {
    s = slots[u];
    t = tables[u];
  }
  float* row = out + i * dim;
  const bool none = s < 0 || t < 0 || t >= g.count || s >= g.rows[t];
  const T* src = none ? nullptr : static_cast<const T*>(g.base[t]) + s * g.width[t];
  if constexpr (Vec4) {
    const int64_t quads = dim / 4;
    for (int64_t base = lane; base < quads; base += kLookupBlock) {
      float4 v[kLookupPerLane];
#pragma unroll
      for (int q = 0; q < kLookupPerLane; ++q) {
        const int64_t j = base + q * kLookupWarp;
        v[q] = (none || j >= quads) ? make_float4(0.0f, 0.0f, 0.0f, 0.0f)
                                    : __ldg(reinterpret_cast<const float4*>(src) + j);
      }
#pragma unroll
      for (int q = 0; q < kLookupPerLane; ++q) {
        const int64_t j = base + q * kLookupWarp;
        if (j < quads) reinterpret_cast<float4*>(row)[j] = v[q];
      }
    }
  } else {
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
}

// Adds (or, first, stores) rows of `d` floats: acc[q] covers columns col0 + q * 32 (scalar) or
// quads col0 + q * 32 (Vec4).
template <bool Vec4>
struct RowAcc {
  float4 v[kLookupPerLane];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int q = 0; q < kLookupPerLane; ++q) v[q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  __device__ __forceinline__ void add(const float* __restrict__ r, int64_t col0, int64_t d) {
#pragma unroll
    for (int q = 0; q < kLookupPerLane; ++q) {
      const int64_t col = col0 + q * kLookupWarp;
      if constexpr (Vec4) {
        if (col < d / 4) {
          const float4 x = __ldg(reinterpret_cast<const float4*>(r) + col);
          v[q].x += x.x;
          v[q].y += x.y;
          v[q].z += x.z;
          v[q].w += x.w;
        }
      } else {
        if (col < d) v[q].x += __ldg(r + col);
      }
    }
  }
  __device__ __forceinline__ void store(float* __restrict__ r, int64_t col0, int64_t d) const {
#pragma unroll
    for (int q = 0; q < kLookupPerLane; ++q) {
      const int64_t col = col0 + q * kLookupWarp;
      if constexpr (Vec4) {
        if (col < d / 4) reinterpret_cast<float4*>(r)[col] = v[q];
      } else {
        if (col < d) r[col] = v[q].x;
      }
    }
  }
};

// The segment of every chunk: chunk_segment[c] = u for c in [chunk_offsets[u],
// chunk_offsets[u + 1]) (one thread per segment; a hot segment's thread writes its many chunks).
__global__ void __launch_bounds__(kLookupThreads)
    segment_of_chunk_kernel(const int64_t* __restrict__ chunk_offsets, int64_t unique,
                            int64_t* __restrict__ chunk_segment) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= unique) return;
  for (int64_t c = chunk_offsets[u]; c < chunk_offsets[u + 1]; ++c) chunk_segment[c] = u;
}

// Pass 1: chunk c of the segments (chunk_offsets (U + 1) counts them per segment) summed in k
// order into partial[c], or straight into out[u] when segment u is one chunk.
template <bool Vec4>
__global__ void __launch_bounds__(kLookupThreads)
    segment_chunk_sums_kernel(const float* __restrict__ grads, const int64_t* __restrict__ order,
                              const int64_t* __restrict__ starts,
                              const int64_t* __restrict__ chunk_offsets,
                              const int64_t* __restrict__ chunk_segment, int64_t unique,
                              int64_t n, int64_t d, int64_t max_chunks,
                              float* __restrict__ partial, float* __restrict__ out) {
  const int64_t c = warp_index();
  if (c >= max_chunks || c >= chunk_offsets[unique]) return;
  const int64_t u = chunk_segment[c];
  const bool alone = chunk_offsets[u + 1] - chunk_offsets[u] == 1;
  const int64_t seg_end = u + 1 < unique ? starts[u + 1] : n;
  const int64_t begin = starts[u] + (c - chunk_offsets[u]) * kSegmentChunk;
  const int64_t end = begin + kSegmentChunk < seg_end ? begin + kSegmentChunk : seg_end;
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t cols = Vec4 ? d / 4 : d;
  float* dest = alone ? out + u * d : partial + c * d;
  for (int64_t col0 = lane; col0 < cols; col0 += kLookupBlock) {
    RowAcc<Vec4> acc;
    acc.zero();
    for (int64_t k = begin; k < end; ++k) acc.add(grads + order[k] * d, col0, d);
    acc.store(dest, col0, d);
  }
}

// Pass 2: out[u] = the chunk sums of segment u, added in chunk order (segments of one chunk
// were written by pass 1).
template <bool Vec4>
__global__ void __launch_bounds__(kLookupThreads)
    segment_finish_kernel(const float* __restrict__ partial,
                          const int64_t* __restrict__ chunk_offsets, int64_t unique, int64_t d,
                          float* __restrict__ out) {
  const int64_t u = warp_index();
  if (u >= unique || chunk_offsets[u + 1] - chunk_offsets[u] == 1) return;
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t cols = Vec4 ? d / 4 : d;
  for (int64_t col0 = lane; col0 < cols; col0 += kLookupBlock) {
    RowAcc<Vec4> acc;
    acc.zero();
    for (int64_t c = chunk_offsets[u]; c < chunk_offsets[u + 1]; ++c) {
      acc.add(partial + c * d, col0, d);
    }
    acc.store(out + u * d, col0, d);
  }
}

}  // namespace cuda
}  // namespace demb
