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

// Pass 1: chunk c summed in k order into partial[c], or straight into out[u] when its segment
// is one chunk (then a NaN or infinity in it sets *nonfinite); with skip_single, a segment of
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
                              float* __restrict__ out, bool* __restrict__ nonfinite) {
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
      *nonfinite = true;  // every writer stores the same value
    }
  }
}

// Chunks a warp of segment_chunk_sums_packed_kernel sums together. Two, with 8 blocks per SM,
// measured fastest on the H200 for the reference workload's 1M rows of 128 floats (221 us;
// 4 chunks with 6 blocks: 271 us; 1 chunk: 225 us; 8 chunks: 401 us).
constexpr int kSumChunks = 2;

// Pass 1 when a row is one float4 per lane (d <= 128, 16-byte aligned): a warp sums
// kSumChunks consecutive chunks together, one row of each in flight at a time, in the same
// order per chunk as segment_chunk_sums_kernel (so the same floats), and skip_single alike.
template <bool Scaled>
__global__ void __launch_bounds__(kLookupThreads, 8)
    segment_chunk_sums_packed_kernel(const float* __restrict__ grads,
                                     const int64_t* __restrict__ order, RowSource src,
                                     const int64_t* __restrict__ chunk_begin,
                                     const int64_t* __restrict__ chunk_len,
                                     const int64_t* __restrict__ chunk_dest,
                                     const int64_t* __restrict__ total_chunks, int64_t d,
                                     int64_t max_chunks, bool skip_single,
                                     float* __restrict__ partial, float* __restrict__ out,
                                     bool* __restrict__ nonfinite) {
  // Row numbers and lengths as 32-bit words (N < 2^31, checked by the binding) and each
  // chunk's destination read again at the end, to fit 8 blocks per SM.
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t first = warp_index() * kSumChunks;
  const int64_t total = *total_chunks < max_chunks ? *total_chunks : max_chunks;
  if (first >= total) return;  // the same for the warp's lanes
  const int quads = static_cast<int>(d / 4);
  int len[kSumChunks];
  int32_t my_row[kSumChunks];
  float my_scale[kSumChunks];
  int longest = 0;
#pragma unroll
  for (int c = 0; c < kSumChunks; ++c) {
    const int64_t cc = first + c;
    const bool ok = cc < total;
    const int64_t b = ok ? chunk_begin[cc] : 0;
    len[c] = ok ? static_cast<int>(chunk_len[cc]) : 0;
    const int64_t entry = lane < len[c] ? order[b + lane] : 0;
    my_row[c] = static_cast<int32_t>(Scaled && lane < len[c] ? src.row(entry) : entry);
    my_scale[c] = Scaled && lane < len[c] ? src.factor(entry) : 1.0f;
    longest = len[c] > longest ? len[c] : longest;
  }
  float4 acc[kSumChunks];
#pragma unroll
  for (int c = 0; c < kSumChunks; ++c) acc[c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const float4* rows = reinterpret_cast<const float4*>(grads);
  for (int r = 0; r < longest; ++r) {
#pragma unroll
    for (int c = 0; c < kSumChunks; ++c) {
      const int32_t row = __shfl_sync(kAll, my_row[c], r);
      const float s = Scaled ? __shfl_sync(kAll, my_scale[c], r) : 1.0f;
      if (r < len[c] && lane < quads) {
        const float4 x = load_grad4<Scaled>(rows + static_cast<int64_t>(row) * quads + lane);
        acc[c].x += Scaled ? x.x * s : x.x;
        acc[c].y += Scaled ? x.y * s : x.y;
        acc[c].z += Scaled ? x.z * s : x.z;
        acc[c].w += Scaled ? x.w * s : x.w;
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kSumChunks; ++c) {
    if (len[c] == 0) continue;  // the same for the warp's lanes
    const int64_t dest = chunk_dest[first + c];
    float* dst = dest >= 0 ? out + dest * d : partial + (~dest) * d;
    const bool store = !(skip_single && dest >= 0 && len[c] == 1);
    if (store && lane < quads) reinterpret_cast<float4*>(dst)[lane] = acc[c];
    const bool bad = dest >= 0 && lane < quads &&
                     (!isfinite(acc[c].x) || !isfinite(acc[c].y) || !isfinite(acc[c].z) ||
                      !isfinite(acc[c].w));
    if (__any_sync(kAll, bad) && lane == 0) *nonfinite = true;
  }
}

// out[u] = order[starts[u]] when segment u has one entry, else -1 (or when starts[u] is out of
// [0, n): unchecked here, read safely).
__global__ void __launch_bounds__(kLookupThreads)
    segment_single_rows_kernel(const int64_t* __restrict__ order,
                               const int64_t* __restrict__ starts, int64_t unique, int64_t n,
                               int64_t* __restrict__ out) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= unique) return;
  const int64_t b = starts[u];
  const int64_t end = u + 1 < unique ? starts[u + 1] : n;
  out[u] = b >= 0 && b < n && end - b == 1 ? order[b] : -1;
}

// Floats per L2 prefetch (one 128-byte line).
constexpr int64_t kPrefetchFloats = 32;

__device__ __forceinline__ void prefetch_l2(const float* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Partial rows segment_finish_kernel loads at once (8 float4 registers per lane, or 2 blocks
// of kLookupPerLane scalars).
template <bool Vec4>
constexpr int kFinishBatch = Vec4 ? 8 : 2;

// Segments of more chunks than this (a hot key's: kHotChunks * kSegmentChunk entries and more)
// segment_finish_kernel folds with its whole block (float4 rows): the block's warps stage
// kHotRows partial rows at a time in shared memory, the next window loading while the first
// warp adds the last one in chunk order, so a hot key's hundreds of rows are a few dozen L2
// round trips at most, not one per kFinishBatch rows. The same adds in the same order as one
// warp's batches: the same floats.
constexpr int kHotChunks = 32;
constexpr int kHotRows = 16;

// The block of segment_finish_kernel folds hot segment u (chunks [from, to)) into out[u]: see
// kHotChunks. Every thread of the block calls it (it synchronizes the block).
__device__ __forceinline__ void fold_hot_segment(const float* __restrict__ partial, int64_t u,
                                                 int64_t from, int64_t to, int64_t d,
                                                 float4 (*stage)[kHotRows][kLookupWarp],
                                                 float* __restrict__ out,
                                                 bool* __restrict__ nonfinite) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kWarps = kLookupThreads / kLookupWarp;
  constexpr int kPerWarp = kHotRows / kWarps;
  static_assert(kPerWarp * kWarps == kHotRows, "each warp stages kPerWarp rows of a window");
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int warp = static_cast<int>(threadIdx.x / kLookupWarp);
  const int64_t quads = d / 4;
  const auto* rows = reinterpret_cast<const float4*>(partial);
  // Rows [c0, c0 + kHotRows) into stage[buf]: warp w stages rows w, w + kWarps, ...
  const auto load = [&](int64_t c0, int64_t col, float4 (&r)[kPerWarp]) {
#pragma unroll
    for (int k = 0; k < kPerWarp; ++k) {
      const int64_t c = c0 + warp + k * kWarps;
      r[k] = c < to && col < quads ? __ldcs(rows + c * quads + col)
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  };
  const auto put = [&](int buf, const float4 (&r)[kPerWarp]) {
#pragma unroll
    for (int k = 0; k < kPerWarp; ++k) stage[buf][warp + k * kWarps][lane] = r[k];
  };
  for (int64_t base = 0; base < quads; base += kLookupWarp) {
    const int64_t col = base + lane;
    RowAcc<true> acc;
    acc.zero();
    float4 r[kPerWarp];
    load(from, col, r);
    put(0, r);
    __syncthreads();
    int buf = 0;
    for (int64_t c0 = from; c0 < to; c0 += kHotRows) {
      load(c0 + kHotRows, col, r);  // in flight while the first warp adds this window
      if (warp == 0) {
        const int64_t count = to - c0 < kHotRows ? to - c0 : kHotRows;
        for (int64_t i = 0; i < count; ++i) {
          RowAcc<true> part;
          part.v[0] = stage[buf][i][lane];
          acc.plus(part);
        }
      }
      put(buf ^ 1, r);
      __syncthreads();
      buf ^= 1;
    }
    if (warp == 0) {
      acc.store(out + u * d, col, d);
      if (__any_sync(kAll, acc.nonfinite(col, d)) && lane == 0) *nonfinite = true;
    }
  }
}

// Pass 2: out[u] = the chunk sums of segment u, added in chunk order, for the segments pass 1
// did not write (more than one chunk; none: zeros); a NaN or infinity sets *nonfinite. A warp
// scans 32 segments, one per lane; with float4 rows, the segments of more than kHotChunks
// chunks are left to the whole block, after (fold_hot_segment).
template <bool Vec4>
__global__ void __launch_bounds__(kLookupThreads)
    segment_finish_kernel(const float* __restrict__ partial,
                          const int64_t* __restrict__ chunk_offsets, int64_t unique, int64_t d,
                          float* __restrict__ out, bool* __restrict__ nonfinite) {
  constexpr unsigned kAll = 0xffffffffu;
  __shared__ float4 stage[Vec4 ? 2 : 1][Vec4 ? kHotRows : 1][kLookupWarp];
  __shared__ int32_t hot[kLookupThreads];  // the block's hot segments, as lane + 32 * warp
  __shared__ int hot_count;
  if (threadIdx.x == 0) hot_count = 0;
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t block_first = static_cast<int64_t>(blockIdx.x) * kLookupThreads;
  const int64_t first = warp_index() * kLookupWarp;
  const int64_t u = first + lane;
  int64_t c0 = 0;
  int64_t c1 = 0;
  if (u < unique) {
    c0 = chunk_offsets[u];
    c1 = chunk_offsets[u + 1];
  }
  const bool hot_here = Vec4 && u < unique && c1 - c0 > kHotChunks;
  if (hot_here) hot[atomicAdd(&hot_count, 1)] = static_cast<int32_t>(u - block_first);
  unsigned todo = __ballot_sync(kAll, u < unique && c1 - c0 != 1 && !hot_here);
  const int64_t cols = Vec4 ? d / 4 : d;
  while (todo) {
    const int j = __ffs(todo) - 1;
    todo &= todo - 1;
    const int64_t from = __shfl_sync(kAll, c0, j);
    const int64_t to = __shfl_sync(kAll, c1, j);
    // The segment's partial rows asked into L2 at once, each lane some rows: the adds below
    // are in a fixed order, and a key's dozens of rows would otherwise come from DRAM a
    // batch at a time.
    for (int64_t c = from + lane; c < to; c += kLookupWarp) {
      for (int64_t col = 0; col < d; col += kPrefetchFloats) prefetch_l2(partial + c * d + col);
    }
    for (int64_t base = 0; base < cols; base += RowAcc<Vec4>::kStep) {
      RowAcc<Vec4> acc;
      acc.zero();
      // kFinishBatch partial rows loaded together, then added in chunk order: a key's dozens
      // of chunks are not one dependent L2 round trip each.
      for (int64_t c = from; c < to; c += kFinishBatch<Vec4>) {
        RowAcc<Vec4> part[kFinishBatch<Vec4>];
#pragma unroll
        for (int k = 0; k < kFinishBatch<Vec4>; ++k) {
          part[k].zero();
          if (c + k < to) part[k].load(partial + (c + k) * d, base + lane, d);
        }
#pragma unroll
        for (int k = 0; k < kFinishBatch<Vec4>; ++k) {
          if (c + k < to) acc.plus(part[k]);
        }
      }
      acc.store(out + (first + j) * d, base + lane, d);
      if (__any_sync(kAll, acc.nonfinite(base + lane, d)) && lane == 0) *nonfinite = true;
    }
  }
  if constexpr (Vec4) {
    __syncthreads();
    const int hots = hot_count;
    for (int h = 0; h < hots; ++h) {
      const int64_t v = block_first + hot[h];
      fold_hot_segment(partial, v, chunk_offsets[v], chunk_offsets[v + 1], d, stage, out,
                       nonfinite);
    }
  }
}

}  // namespace cuda
}  // namespace demb
