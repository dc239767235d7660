// A warp copying value rows to float32 output rows (lookup_rule.h's gather): device functions
// only, shared by gather_table_rows and table_find_rows (kernels defined in a header would be
// defined twice when two .cu files include it). The output rows are stored evict-first
// (st.global.cs): a batch's output (537 MB for the reference workload) is written once and read
// by the next layer, and streaming it through L2 at normal priority would evict the hot table
// rows and buckets that repeated keys read again.
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

// Rows a warp gathers at once when a row is at most one float4 per lane (dim <= 128 float32):
// their loads are all in flight together, so the gather is not bound by one row's latency.
constexpr int kGatherRows = 4;

__device__ __forceinline__ bool no_row(const GatherTables& g, int64_t s, int64_t t) {
  return s < 0 || t < 0 || t >= g.count || s >= g.rows[t];
}

// Copies Rows rows of one float4 per lane (float32, dim <= 128, Vec4-aligned) into out rows
// first.. (those below n): row r's slot and table are those of lane lane0 + r * stride. Their
// loads are all in flight together before any store.
template <int Rows = kGatherRows>
__device__ __forceinline__ void warp_copy_rows4(const GatherTables& g, int64_t my_slot,
                                                int64_t my_table, int lane0, int stride,
                                                int64_t first, int64_t n, int64_t dim, int lane,
                                                float* __restrict__ out) {
  constexpr unsigned kAll = 0xffffffffu;
  const int64_t quads = dim / 4;
  float4 v[Rows];
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    const int64_t s = __shfl_sync(kAll, my_slot, lane0 + r * stride);
    const int64_t t = __shfl_sync(kAll, my_table, lane0 + r * stride);
    v[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (lane < quads && !no_row(g, s, t)) {
      const float* src = static_cast<const float*>(g.base[t]) + s * g.width[t];
      v[r] = __ldg(reinterpret_cast<const float4*>(src) + lane);
    }
  }
#pragma unroll
  for (int r = 0; r < Rows; ++r) {
    if (lane < quads && first + r < n) {
      __stcs(reinterpret_cast<float4*>(out + (first + r) * dim) + lane, v[r]);
    }
  }
}

// One warp copies row `s` of table `t` (dim floats; zeros when there is no such row) into
// `row`, loading each lane's elements of a 128-column block before storing them.
template <typename T, bool Vec4>
__device__ __forceinline__ void warp_copy_row(const GatherTables& g, int64_t s, int64_t t,
                                              int64_t dim, int lane, float* __restrict__ row) {
  const bool none = no_row(g, s, t);
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
        if (j < quads) __stcs(reinterpret_cast<float4*>(row) + j, v[q]);
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
        if (j < dim) __stcs(row + j, v[q]);
      }
    }
  }
}

}  // namespace cuda
}  // namespace demb
