// CUDA kernels of gather_table_rows and segment_sum_rows (lookup_rule.h); plain CUDA, no torch
// headers. One warp per output row; each lane loads its elements of a 128-column block into
// registers before storing or adding them. Include from one .cu file only: it defines kernels.
#pragma once

#include <cstdint>

#include "cuda/gather_rows.cuh"
#include "lookup_rule.h"

namespace demb {
namespace cuda {

// out[i] (dim floats) = row slots[u] of table tables[u], u = inverse[i] (u = i without
// inverse); zeros when the slot is -1 or anything is out of range. With `Vec4` (float32 rows,
// dim, widths and bases multiples of 4 floats) each lane moves 16 bytes at a time, and when
// dim <= 128 (`rows_per_warp` = kGatherRows) a warp gathers kGatherRows rows together.
template <typename T, bool Vec4>
__global__ void __launch_bounds__(kLookupThreads)
    gather_table_rows_kernel(const __grid_constant__ GatherTables g,
                             const int64_t* __restrict__ slots,
                             const int64_t* __restrict__ tables,
                             const int64_t* __restrict__ inverse, int64_t unique, int64_t n,
                             int64_t dim, int rows_per_warp, float* __restrict__ out) {
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  if constexpr (Vec4) {
    if (rows_per_warp == kGatherRows) {  // dim / 4 <= 32: one float4 per lane and row
      const int64_t first = warp_index() * kGatherRows;
      if (first >= n) return;  // the same for the warp's lanes
      int64_t my_slot = -1;
      int64_t my_table = 0;
      if (lane < kGatherRows && first + lane < n) {
        const int64_t u = inverse ? inverse[first + lane] : first + lane;
        if (u >= 0 && u < unique) {
          my_slot = slots[u];
          my_table = tables[u];
        }
      }
      warp_copy_rows4(g, my_slot, my_table, 0, 1, first, n, dim, lane, out);
      return;
    }
  }
  const int64_t i = warp_index();
  if (i >= n) return;
  const int64_t u = inverse ? inverse[i] : i;
  int64_t s = -1;
  int64_t t = 0;
  if (u >= 0 && u < unique) {
    s = slots[u];
    t = tables[u];
  }
  warp_copy_row<T, Vec4>(g, s, t, dim, lane, out + i * dim);
}

// A gradient row's load: evict-first (ld.global.cs) when each row is read once (unscaled: the
// rows of `order`, a permutation, or partial sums), so the sums' own writes keep L2; through the
// read-only cache when rows are pooled bags that several keys read (Scaled).
template <bool Scaled>
__device__ __forceinline__ float4 load_grad4(const float4* p) {
  return Scaled ? __ldg(p) : __ldcs(p);
}
template <bool Scaled>
__device__ __forceinline__ float load_grad(const float* p) {
  return Scaled ? __ldg(p) : __ldcs(p);
}

// Adds (or, first, stores) rows of `d` floats: a lane's part of a pass over the row: columns
// col0 + q * 32 (scalar, kLookupPerLane of them), or the quad col0 (Vec4). A pass covers kStep
// columns (scalar) or quads (Vec4).
template <bool Vec4>
struct RowAcc {
  static constexpr int kParts = Vec4 ? 1 : kLookupPerLane;
  static constexpr int kStep = kLookupWarp * kParts;
  float4 v[kParts];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int q = 0; q < kParts; ++q) v[q] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  }
  // Adds row r (times s when Scaled: the product, then the sum).
  template <bool Scaled>
  __device__ __forceinline__ void add(const float* __restrict__ r, int64_t col0, int64_t d,
                                      float s) {
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      const int64_t col = col0 + q * kLookupWarp;
      if constexpr (Vec4) {
        if (col < d / 4) {
          const float4 x = load_grad4<Scaled>(reinterpret_cast<const float4*>(r) + col);
          v[q].x += Scaled ? x.x * s : x.x;
          v[q].y += Scaled ? x.y * s : x.y;
          v[q].z += Scaled ? x.z * s : x.z;
          v[q].w += Scaled ? x.w * s : x.w;
        }
      } else {
        if (col < d) {
          const float x = load_grad<Scaled>(r + col);
          v[q].x += Scaled ? x * s : x;
        }
      }
    }
  }
  // Loads row r's columns (evict-first: partial rows are read once), as they are.
  __device__ __forceinline__ void load(const float* __restrict__ r, int64_t col0, int64_t d) {
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      const int64_t col = col0 + q * kLookupWarp;
      if constexpr (Vec4) {
        if (col < d / 4) v[q] = __ldcs(reinterpret_cast<const float4*>(r) + col);
      } else {
        if (col < d) v[q].x = __ldcs(r + col);
      }
    }
  }
  // Adds another accumulator's columns (the same columns of this lane).
  __device__ __forceinline__ void plus(const RowAcc& o) {
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      v[q].x += o.v[q].x;
      if constexpr (Vec4) {
        v[q].y += o.v[q].y;
        v[q].z += o.v[q].z;
        v[q].w += o.v[q].w;
      }
    }
  }
  // Whether a stored column (of this lane) is NaN or infinite.
  __device__ __forceinline__ bool nonfinite(int64_t col0, int64_t d) const {
    bool bad = false;
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      const int64_t col = col0 + q * kLookupWarp;
      if constexpr (Vec4) {
        if (col < d / 4) {
          bad = bad || !isfinite(v[q].x) || !isfinite(v[q].y) || !isfinite(v[q].z) ||
                !isfinite(v[q].w);
        }
      } else {
        if (col < d) bad = bad || !isfinite(v[q].x);
      }
    }
    return bad;
  }
  __device__ __forceinline__ void store(float* __restrict__ r, int64_t col0, int64_t d) const {
#pragma unroll
    for (int q = 0; q < kParts; ++q) {
      const int64_t col = col0 + q * kLookupWarp;
      if constexpr (Vec4) {
        if (col < d / 4) reinterpret_cast<float4*>(r)[col] = v[q];
      } else {
        if (col < d) r[col] = v[q].x;
      }
    }
  }
};

// chunk_offsets[u + 1] = the chunks of segment u (ceil(length / kSegmentChunk)); a scan then
// makes them offsets (chunk_offsets[0] = 0).
__global__ void __launch_bounds__(kLookupThreads)
    segment_chunk_counts_kernel(const int64_t* __restrict__ starts, int64_t unique, int64_t n,
                                int64_t* __restrict__ chunk_offsets) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= unique) return;
  const int64_t end = u + 1 < unique ? starts[u + 1] : n;
  chunk_offsets[u + 1] = segment_chunks(end - starts[u]);
}

// Per chunk c of segment u (one thread per segment; a hot segment's thread writes its many
// chunks): where its rows start in `order`, how many (<= kSegmentChunk), and where its sum goes:
// out row u when the segment is one chunk, else partial row c (written as ~c).
__global__ void __launch_bounds__(kLookupThreads)
    segment_chunks_kernel(const int64_t* __restrict__ starts,
                          const int64_t* __restrict__ chunk_offsets, int64_t unique, int64_t n,
                          int64_t max_chunks, int64_t* __restrict__ chunk_begin,
                          int64_t* __restrict__ chunk_len, int64_t* __restrict__ chunk_dest) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= unique) return;
  const int64_t first = chunk_offsets[u];
  const int64_t last = chunk_offsets[u + 1] < max_chunks ? chunk_offsets[u + 1] : max_chunks;
  const int64_t seg_end = u + 1 < unique ? starts[u + 1] : n;
  const bool alone = chunk_offsets[u + 1] - first == 1;
  for (int64_t c = first; c < last; ++c) {
    const int64_t begin = starts[u] + (c - first) * kSegmentChunk;
    chunk_begin[c] = begin;
    chunk_len[c] = (begin + kSegmentChunk < seg_end ? begin + kSegmentChunk : seg_end) - begin;
    chunk_dest[c] = alone ? u : ~c;
  }
}

// Where entry p of `order` takes its grads row and factor: row rows[p] (rows null: row p) times
// scale[p] (scale null: 1). Kernels templated on Scaled = false ignore it (row p, no product).
struct RowSource {
  const int64_t* rows;
  const float* scale;
  __device__ __forceinline__ int64_t row(int64_t p) const { return rows ? rows[p] : p; }
  __device__ __forceinline__ float factor(int64_t p) const { return scale ? scale[p] : 1.0f; }
};

// Where the sums flag a NaN or infinity: the device byte the update reads (its skip), and, when
// `host` is not null, a pinned host byte mapped into the device's address space, stored over the
// bus: a host that waits for an event after the sums reads it there, with no copy queued behind
// them. Every writer stores the same value.
struct NonFiniteFlag {
  bool* device;
  bool* host;
  __device__ __forceinline__ void raise() const {
    *device = true;
    if (host != nullptr) {
      *reinterpret_cast<volatile bool*>(host) = true;
      __threadfence_system();
    }
  }
};

// Where the finish pass writes each segment's single row when `out` is not null:
// out[u] = order[starts[u]] when segment u has one entry, else -1 (or when starts[u] is out of
// [0, n): unchecked, read safely). What segment_single_rows_kernel writes, for summed_update's
// backward without that kernel's launch.
struct SingleRows {
  const int64_t* order;
  const int64_t* starts;
  int64_t n;
  int64_t* out;
  __device__ __forceinline__ void write(int64_t u, int64_t unique) const {
    const int64_t b = starts[u];
    const int64_t end = u + 1 < unique ? starts[u + 1] : n;
    out[u] = b >= 0 && b < n && end - b == 1 ? order[b] : -1;
  }
};

// Pass 1: chunk c summed in k order into partial[c], or straight into out[u] when its segment
// is one chunk (then a NaN or infinity in it raises `nonfinite`); with skip_single, a segment of
// one entry is checked but not stored. One warp per chunk: its row numbers read by the lanes
// at once, then its rows added in order (passed round by shuffles).
template <bool Vec4, bool Scaled>
__global__ void __launch_bounds__(kLookupThreads)
    segment_chunk_sums_kernel(const float* __restrict__ grads, const int64_t* __restrict__ order,
                              RowSource src,
                              const int64_t* __restrict__ chunk_begin,
                              const int64_t* __restrict__ chunk_len,
                              const int64_t* __restrict__ chunk_dest,
                              const int64_t* __restrict__ total_chunks, int64_t d,
                              int64_t max_chunks, bool skip_single, float* __restrict__ partial,
                              float* __restrict__ out, NonFiniteFlag nonfinite) {
  constexpr unsigned kAll = 0xffffffffu;
  const int64_t c = warp_index();
  if (c >= max_chunks || c >= *total_chunks) return;  // the same for the warp's lanes
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t b = chunk_begin[c];
  const int len = static_cast<int>(chunk_len[c]);
  const int64_t dest = chunk_dest[c];
  float* dst = dest >= 0 ? out + dest * d : partial + (~dest) * d;
  const int64_t my_entry = lane < len ? order[b + lane] : 0;
  const int64_t my_row = Scaled && lane < len ? src.row(my_entry) : my_entry;
  const float my_scale = Scaled && lane < len ? src.factor(my_entry) : 1.0f;
  const int64_t cols = Vec4 ? d / 4 : d;
  for (int64_t base = 0; base < cols; base += RowAcc<Vec4>::kStep) {
    RowAcc<Vec4> acc;
    acc.zero();
#pragma unroll 4
    for (int r = 0; r < len; ++r) {
      const int64_t row = __shfl_sync(kAll, my_row, r);
      const float s = Scaled ? __shfl_sync(kAll, my_scale, r) : 1.0f;
      acc.template add<Scaled>(grads + row * d, base + lane, d, s);
    }
    if (!(skip_single && dest >= 0 && len == 1)) acc.store(dst, base + lane, d);
    if (__any_sync(kAll, dest >= 0 && acc.nonfinite(base + lane, d)) && lane == 0) {
      nonfinite.raise();
    }
  }
}

// single.out[u] for every segment u (see SingleRows).
__global__ void __launch_bounds__(kLookupThreads)
    segment_single_rows_kernel(SingleRows single, int64_t unique) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u < unique) single.write(u, unique);
}

}  // namespace cuda
}  // namespace demb
