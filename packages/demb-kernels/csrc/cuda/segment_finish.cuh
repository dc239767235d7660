// segment_sum_rows' finish pass on CUDA: each segment of several chunks gets the sum of its
// chunks' partial rows, added in chunk order (lookup_rule.h). Where a segment's chunks are is
// a template policy: consecutive partial rows named by a plan (PlanChunks, the chunk-per-warp
// sums) or rows fixed by where each chunk starts (WindowChunks, the window sums). Plain CUDA;
// include from one .cu file only: it defines kernels.
#pragma once

#include <cstdint>

#include "cuda/lookup_kernels.cuh"
#include "lookup_rule.h"

namespace demb {
namespace cuda {

// Segment u's chunks: c in [from, to), chunk c's partial row at Chunks::row(base, c).
struct ChunkSpan {
  int64_t from;
  int64_t to;
  int64_t base;
};

// A plan's chunks (segment_plan): segment u's are chunk_offsets[u] .. chunk_offsets[u + 1],
// partial row c for chunk c.
struct PlanChunks {
  const int64_t* chunk_offsets;
  __device__ __forceinline__ ChunkSpan span(int64_t u) const {
    return {chunk_offsets[u], chunk_offsets[u + 1], 0};
  }
  __device__ __forceinline__ static int64_t row(int64_t /*base*/, int64_t c) { return c; }
};

// The partial row of the chunk that starts at entry k0 of a segment starting at s, when the
// segment has several chunks (segment_window_sums_kernel): 2 * (k0's window) + 1 for its first
// chunk, + 0 for a later one. A window starts at most one of each: a first chunk is a full
// kSegmentChunk entries, so the next first chunk starts in a later window, and a later chunk
// follows a full one of its segment, so the next later chunk does too.
__device__ __forceinline__ int64_t window_partial_row(int64_t k0, int64_t s) {
  return 2 * (k0 / kSegmentChunk) + (k0 == s ? 1 : 0);
}

// The window sums' chunks: segment u = [starts[u], its end) clamped to [0, n), chunk c at
// entry s + c * kSegmentChunk.
struct WindowChunks {
  const int64_t* starts;
  int64_t unique;
  int64_t n;
  __device__ __forceinline__ ChunkSpan span(int64_t u) const {
    int64_t s = starts[u];
    int64_t e = u + 1 < unique ? starts[u + 1] : n;
    s = s < 0 ? 0 : (s > n ? n : s);
    e = e > n ? n : e;
    return {0, e > s ? segment_chunks(e - s) : 0, s};
  }
  __device__ __forceinline__ static int64_t row(int64_t s, int64_t c) {
    return window_partial_row(s + c * kSegmentChunk, s);
  }
};

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

// The block of segment_finish_kernel folds hot segment u (its chunks `sp`) into out[u]: see
// kHotChunks. Every thread of the block calls it (it synchronizes the block).
template <typename Chunks>
__device__ __forceinline__ void fold_hot_segment(const float* __restrict__ partial, int64_t u,
                                                 ChunkSpan sp, int64_t d,
                                                 float4 (*stage)[kHotRows][kLookupWarp],
                                                 float* __restrict__ out,
                                                 NonFiniteFlag nonfinite) {
  constexpr unsigned kAll = 0xffffffffu;
  constexpr int kWarps = kLookupThreads / kLookupWarp;
  constexpr int kPerWarp = kHotRows / kWarps;
  static_assert(kPerWarp * kWarps == kHotRows, "each warp stages kPerWarp rows of a window");
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int warp = static_cast<int>(threadIdx.x / kLookupWarp);
  const int64_t quads = d / 4;
  const auto* rows = reinterpret_cast<const float4*>(partial);
  const int64_t to = sp.to;
  // Rows [c0, c0 + kHotRows) into stage[buf]: warp w stages rows w, w + kWarps, ...
  const auto load = [&](int64_t c0, int64_t col, float4 (&r)[kPerWarp]) {
#pragma unroll
    for (int k = 0; k < kPerWarp; ++k) {
      const int64_t c = c0 + warp + k * kWarps;
      r[k] = c < to && col < quads ? __ldcs(rows + Chunks::row(sp.base, c) * quads + col)
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
    load(sp.from, col, r);
    put(0, r);
    __syncthreads();
    int buf = 0;
    for (int64_t c0 = sp.from; c0 < to; c0 += kHotRows) {
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
      if (__any_sync(kAll, acc.nonfinite(col, d)) && lane == 0) nonfinite.raise();
    }
  }
}

// Pass 2: out[u] = the chunk sums of segment u, added in chunk order, for the segments pass 1
// did not write (more than one chunk; none: zeros); a NaN or infinity raises `nonfinite`. A
// warp scans 32 segments, one per lane; with float4 rows, the segments of more than kHotChunks
// chunks are left to the whole block, after (fold_hot_segment). With single.out, each lane also
// writes its segment's single row (SingleRows).
template <bool Vec4, typename Chunks>
__global__ void __launch_bounds__(kLookupThreads)
    segment_finish_kernel(const float* __restrict__ partial, Chunks chunks, int64_t unique,
                          int64_t d, float* __restrict__ out, NonFiniteFlag nonfinite,
                          SingleRows single) {
  constexpr unsigned kAll = 0xffffffffu;
  __shared__ float4 stage[Vec4 ? 2 : 1][Vec4 ? kHotRows : 1][kLookupWarp];
  __shared__ int32_t hot[Vec4 ? kLookupThreads : 1];  // the block's hot segments (Vec4 only),
                                                      // as lane + 32 * warp
  __shared__ int hot_count;
  if (threadIdx.x == 0) hot_count = 0;
  __syncthreads();
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t block_first = static_cast<int64_t>(blockIdx.x) * kLookupThreads;
  const int64_t first = warp_index() * kLookupWarp;
  const int64_t u = first + lane;
  ChunkSpan sp{0, 0, 0};
  if (u < unique) sp = chunks.span(u);
  if (single.out != nullptr && u < unique) single.write(u, unique);
  const bool hot_here = Vec4 && u < unique && sp.to - sp.from > kHotChunks;
  if (hot_here) hot[atomicAdd(&hot_count, 1)] = static_cast<int32_t>(u - block_first);
  unsigned todo = __ballot_sync(kAll, u < unique && sp.to - sp.from != 1 && !hot_here);
  const int64_t cols = Vec4 ? d / 4 : d;
  while (todo) {
    const int j = __ffs(todo) - 1;
    todo &= todo - 1;
    const int64_t from = __shfl_sync(kAll, sp.from, j);
    const int64_t to = __shfl_sync(kAll, sp.to, j);
    const int64_t at = __shfl_sync(kAll, sp.base, j);
    // The segment's partial rows asked into L2 at once, each lane some rows: the adds below
    // are in a fixed order, and a key's dozens of rows would otherwise come from DRAM a
    // batch at a time.
    for (int64_t c = from + lane; c < to; c += kLookupWarp) {
      const float* r = partial + Chunks::row(at, c) * d;
      for (int64_t col = 0; col < d; col += kPrefetchFloats) prefetch_l2(r + col);
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
          if (c + k < to) part[k].load(partial + Chunks::row(at, c + k) * d, base + lane, d);
        }
#pragma unroll
        for (int k = 0; k < kFinishBatch<Vec4>; ++k) {
          if (c + k < to) acc.plus(part[k]);
        }
      }
      acc.store(out + (first + j) * d, base + lane, d);
      if (__any_sync(kAll, acc.nonfinite(base + lane, d)) && lane == 0) nonfinite.raise();
    }
  }
  if constexpr (Vec4) {
    __syncthreads();
    const int hots = hot_count;
    for (int h = 0; h < hots; ++h) {
      const int64_t v = block_first + hot[h];
      fold_hot_segment<Chunks>(partial, v, chunks.span(v), d, stage, out, nonfinite);
    }
  }
}

}  // namespace cuda
}  // namespace demb
