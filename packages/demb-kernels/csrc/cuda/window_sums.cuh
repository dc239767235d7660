// segment_sum_rows' chunk sums by windows of the sorted entries, for float4 rows of at most one
// float4 per lane (D <= 128, 16-byte aligned): no plan. Warp w owns the chunks (lookup_rule.h:
// kSegmentChunk entries of a segment from its start) that start at entries [32w, 32w + 32) of
// `order`, and sums each in k order, so every warp reads about 32 gradient rows however long
// the segments are (a warp per chunk reads one row for each key of one entry, most keys of a
// power-law batch, behind two dependent reads of the plan and `order`). Plain CUDA; include
// from one .cu file only: it defines kernels.
#pragma once

#include <cstdint>

#include "cuda/lookup_kernels.cuh"
#include "cuda/segment_finish.cuh"
#include "lookup_rule.h"

namespace demb {
namespace cuda {

static_assert(kSegmentChunk == kLookupWarp, "a window is one entry per lane");

// Gradient rows a warp of segment_window_sums_kernel loads together before adding them in order.
constexpr int kWindowBatch = 8;

// The last u < unique with starts[u] <= key (-1: none), by the whole warp: 32 probes per step.
// Sorted starts (the op's contract) make each step's hits a prefix of the lanes; any others
// still give some u in [0, unique).
__device__ __forceinline__ int64_t last_start_at_or_before(const int64_t* __restrict__ starts,
                                                           int64_t unique, int64_t key,
                                                           int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  int64_t lo = 0;
  int64_t hi = unique;  // the answer, if any, is in [lo, hi)
  while (hi - lo > kLookupWarp) {
    const int64_t step = (hi - lo + kLookupWarp - 1) / kLookupWarp;
    const int64_t probe = lo + lane * step;
    const unsigned hits = __ballot_sync(kAll, probe < hi && starts[probe] <= key);
    if (hits == 0) return -1;
    lo += (31 - __clz(hits)) * step;
    hi = lo + step < hi ? lo + step : hi;
  }
  const unsigned hits = __ballot_sync(kAll, lo + lane < hi && starts[lo + lane] <= key);
  return hits == 0 ? -1 : lo + 31 - __clz(hits);
}

// The segment of entry k: u (-1: none), its start s and its end e (<= n).
struct EntrySegment {
  int64_t u;
  int64_t s;
  int64_t e;
};

// Each lane's entry base + lane: from the 33 starts from the window's first segment on (one
// read each), when they cover the window (starts rising: a key per segment); else each lane
// searches the starts itself (empty segments, or starts[0] > base).
__device__ __forceinline__ EntrySegment window_segments(const int64_t* __restrict__ starts,
                                                        int64_t unique, int64_t n, int64_t base,
                                                        int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const int64_t k = base + lane;
  const int64_t u0 = last_start_at_or_before(starts, unique, base, lane);
  if (u0 >= 0) {
    const int64_t j = u0 + lane;
    const int64_t sj = j < unique ? starts[j] : n;  // lane 0: the first segment's start
    const int64_t s32 = u0 + kLookupWarp < unique ? starts[u0 + kLookupWarp] : n;
    const int64_t rel = sj - base;
    const bool marks = lane >= 1 && j < unique && rel >= 1 && rel < kLookupWarp;
    const unsigned begins = __reduce_or_sync(kAll, marks ? 1u << rel : 0u);
    const int marked = __popc(__ballot_sync(kAll, marks));
    const bool covered = s32 >= base + kLookupWarp || u0 + kLookupWarp >= unique;
    if (marked == __popc(begins) && covered) {  // the same for the warp's lanes
      const unsigned upto = lane == 31 ? kAll : (2u << lane) - 1u;
      const int c = __popc(begins & upto & ~1u);  // segments begun in (base, k]
      const int64_t s = __shfl_sync(kAll, sj, c);
      const int64_t next = __shfl_sync(kAll, sj, c + 1 < kLookupWarp ? c + 1 : 0);
      const int64_t e = c + 1 < kLookupWarp ? next : s32;
      return {u0 + c, s, e < n ? e : n};
    }
  }
  int64_t lo = 0;
  int64_t hi = unique;  // the first u with starts[u] > k is in [lo, hi]
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (starts[mid] <= k) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  const int64_t u = lo - 1;
  if (u < 0) return {-1, 0, 0};
  const int64_t e = u + 1 < unique ? starts[u + 1] : n;
  return {u, starts[u], e < n ? e : n};
}

// Pass 1 by windows: warp w sums the chunks that start at entries [32w, 32w + 32) (each up to
// kSegmentChunk entries, so it reads entries up to 32w + 62), in k order, kWindowBatch rows in
// flight. A segment of one chunk goes to out[u] (with skip_single, one of one entry is checked
// but not stored), a chunk of a longer one to partial row window_partial_row (the finish pass
// adds them: WindowChunks). A NaN or infinity in a one-chunk segment raises `nonfinite`.
// With skip_one_chunk, the one-chunk segments are left alone (not read, stored or checked: the
// unchecked fused update sums them itself, summing_update.cuh); only the longer ones' chunks
// are summed.
template <bool Scaled>
__global__ void __launch_bounds__(kLookupThreads)
    segment_window_sums_kernel(const float* __restrict__ grads,
                               const int64_t* __restrict__ order, RowSource src,
                               const int64_t* __restrict__ starts, int64_t unique, int64_t n,
                               int64_t d, bool skip_single, bool skip_one_chunk,
                               float* __restrict__ partial, float* __restrict__ out,
                               NonFiniteFlag nonfinite) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t base = warp_index() * kLookupWarp;
  if (base >= n || unique == 0) return;  // the same for the warp's lanes
  const int64_t k = base + lane;
  const EntrySegment seg = window_segments(starts, unique, n, base, lane);
  // This lane's entry starts a chunk: its length and where its sum goes (~row: partial).
  const bool one_chunk = seg.e - seg.s <= kSegmentChunk;
  const bool starts_chunk = k < n && seg.u >= 0 && k >= seg.s && k < seg.e &&
                            (k - seg.s) % kSegmentChunk == 0 && !(skip_one_chunk && one_chunk);
  const int len = starts_chunk ? static_cast<int>(seg.e - k < kSegmentChunk ? seg.e - k
                                                                             : kSegmentChunk)
                               : 0;
  const int64_t dest = k == seg.s && seg.e - seg.s <= kSegmentChunk
                           ? seg.u
                           : ~window_partial_row(k, seg.s);
  const unsigned chunk_starts = __ballot_sync(kAll, starts_chunk);
  if (chunk_starts == 0) return;
  // Bit i of ends (64 bits in two words): entry base + i ends a chunk.
  const int last = lane + len - 1;
  const unsigned ends_lo = __reduce_or_sync(kAll, starts_chunk && last < 32 ? 1u << last : 0u);
  const unsigned ends_hi =
      __reduce_or_sync(kAll, starts_chunk && last >= 32 ? 1u << (last - 32) : 0u);
  // Bit i of kept (two words): entry base + i is in a chunk summed here. Without
  // skip_one_chunk every entry in [first, stop) is; with it, a skipped segment's entries
  // between two such chunks are neither loaded nor added (the sum is zero there: the chunk
  // before ended and stored it).
  const uint64_t span = starts_chunk ? ((uint64_t{1} << len) - 1u) << lane : 0u;
  const unsigned kept_lo =
      skip_one_chunk ? __reduce_or_sync(kAll, static_cast<unsigned>(span)) : kAll;
  const unsigned kept_hi =
      skip_one_chunk ? __reduce_or_sync(kAll, static_cast<unsigned>(span >> 32)) : kAll;
  const auto kept = [&](int i) {
    return ((i < 32 ? kept_lo >> i : kept_hi >> (i - 32)) & 1u) != 0u;
  };
  const int first = __ffs(chunk_starts) - 1;
  const int stop = __shfl_sync(kAll, lane + len, 31 - __clz(chunk_starts));
  // The rows (and factors) of entries base + lane and base + 32 + lane.
  const auto row_of = [&](int64_t entry, int32_t& row, float& factor) {
    row = 0;
    factor = 1.0f;
    if (entry < n) {
      const int64_t p = order[entry];
      row = static_cast<int32_t>(Scaled ? src.row(p) : p);
      if (Scaled) factor = src.factor(p);
    }
  };
  int32_t row_a = 0;
  int32_t row_b = 0;
  float scale_a = 1.0f;
  float scale_b = 1.0f;
  row_of(k, row_a, scale_a);
  if (stop > kLookupWarp) row_of(k + kLookupWarp, row_b, scale_b);
  const int quads = static_cast<int>(d / 4);
  const auto* rows = reinterpret_cast<const float4*>(grads);
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float4 acc = zero;
  for (int g = first; g < stop; g += kWindowBatch) {
    float4 x[kWindowBatch];
    float s[kWindowBatch];
#pragma unroll
    for (int t = 0; t < kWindowBatch; ++t) {
      const int i = g + t;  // the same for the warp's lanes
      const int32_t row = __shfl_sync(kAll, i < kLookupWarp ? row_a : row_b, i % kLookupWarp);
      s[t] = Scaled ? __shfl_sync(kAll, i < kLookupWarp ? scale_a : scale_b, i % kLookupWarp)
                    : 1.0f;
      x[t] = i < stop && lane < quads && kept(i)
                 ? load_grad4<Scaled>(rows + static_cast<int64_t>(row) * quads + lane)
                 : zero;
    }
#pragma unroll
    for (int t = 0; t < kWindowBatch; ++t) {
      const int i = g + t;
      if (i >= stop) break;  // the same for the warp's lanes
      if (!kept(i)) continue;
      acc.x += Scaled ? x[t].x * s[t] : x[t].x;
      acc.y += Scaled ? x[t].y * s[t] : x[t].y;
      acc.z += Scaled ? x[t].z * s[t] : x[t].z;
      acc.w += Scaled ? x[t].w * s[t] : x[t].w;
      const bool ends = i < 32 ? (ends_lo >> i) & 1u : (ends_hi >> (i - 32)) & 1u;
      if (!ends) continue;
      // The chunk ending here began at the last chunk start at or before entry i.
      const unsigned upto = i >= 31 ? kAll : (2u << i) - 1u;
      const int at = 31 - __clz(chunk_starts & upto);
      const int64_t to = __shfl_sync(kAll, dest, at);
      const int size = __shfl_sync(kAll, len, at);
      float* dst = to >= 0 ? out + to * d : partial + (~to) * d;
      const bool store = !(skip_single && to >= 0 && size == 1);
      if (store && lane < quads) reinterpret_cast<float4*>(dst)[lane] = acc;
      const bool bad = to >= 0 && lane < quads &&
                       (!isfinite(acc.x) || !isfinite(acc.y) || !isfinite(acc.z) ||
                        !isfinite(acc.w));
      if (__any_sync(kAll, bad) && lane == 0) nonfinite.raise();
      acc = zero;
    }
  }
}

}  // namespace cuda
}  // namespace demb
