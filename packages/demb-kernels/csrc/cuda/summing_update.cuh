// The fused update of summed_update's unchecked CUDA backward: each unique key's gradient is
// summed by the warp that updates its row, when the key has at most kSegmentChunk entries (the
// window sums' one-chunk segments: added in `order` from zero, as segment_window_sums_kernel
// adds them, so the same floats), and read from the sums the window sums and finish pass wrote
// otherwise. A key of one entry reads its gradient row as it is, as the two-pass update does.
// The sums of the short keys are then neither written nor read back, and their gradient rows
// are read once, not once to sum (or check) and once to update. Float32 rows of at most one
// float4 per lane, 16-byte aligned. Plain CUDA; include from one .cu file only: it defines
// kernels.
#pragma once

#include <cstdint>

#include "cuda/optimizer_kernels.cuh"
#include "lookup_rule.h"

namespace demb {
namespace cuda {

// Where the kernel finds each key's gradient rows: unique key u (of the whole backward) has
// entries order[starts[u]] .. order[end - 1] (end: starts[u + 1], or n for the last key) of
// the (N, dim) `grads`; the launch's entry e is key first_key + e. N < 2^31 (as the sums
// check), so entries and rows fit 32 bits.
struct KeyGradients {
  const float* grads;
  const int64_t* order;
  const int64_t* starts;
  int64_t unique;
  int64_t n;
  int64_t first_key;
};

// Gradient rows a warp loads together before adding them in order.
constexpr int kKeyBatch = 4;

// Lane's float4 of key [s, e)'s gradient (zeros past the row's quads): its one row as it is
// (single: that row), the rows added in order from zero for 2..kSegmentChunk entries, else
// (none, or a long key) the key's row of `sums`.
__device__ __forceinline__ float4 key_gradient(const KeyGradients& kg, const float* sums,
                                               int32_t s, int32_t e, int32_t single,
                                               int64_t quads, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  const auto* rows = reinterpret_cast<const float4*>(kg.grads);
  const int count = e - s;
  if (count == 1) {
    return lane < quads ? __ldcs(rows + static_cast<int64_t>(single) * quads + lane) : zero;
  }
  if (count < 2 || count > kSegmentChunk) {
    return lane < quads ? __ldcs(reinterpret_cast<const float4*>(sums) + lane) : zero;
  }
  const auto mine = static_cast<int32_t>(lane < count ? kg.order[s + lane] : 0);
  float4 acc = zero;
  for (int g = 0; g < count; g += kKeyBatch) {  // count is the same for the warp's lanes
    float4 x[kKeyBatch];
#pragma unroll
    for (int t = 0; t < kKeyBatch; ++t) {
      const int i = g + t;
      const int64_t row = __shfl_sync(kAll, mine, i % kUpdateWarp);
      x[t] = i < count && lane < quads ? __ldcs(rows + row * quads + lane) : zero;
    }
#pragma unroll
    for (int t = 0; t < kKeyBatch; ++t) {
      if (g + t >= count) break;
      acc.x += x[t].x;
      acc.y += x[t].y;
      acc.z += x[t].z;
      acc.w += x[t].w;
    }
  }
  return acc;
}

// Row-wise Adagrad's rate (rowwise_rate_from) from a gradient held a float4 per lane: lane l adds
// elements l, l + 32, ... as rowwise_rate does, each taken from the lane that holds it.
__device__ __forceinline__ float rowwise_rate4(const OptimizerParams& o, float* row, float4 g,
                                               int64_t dim, int lane) {
  constexpr unsigned kAll = 0xffffffffu;
  float sum_sq = 0.0f;
#pragma unroll
  for (int m = 0; m < 4; ++m) {  // dim <= 4 * kUpdateWarp
    const int holder = lane / 4 + 8 * m;
    const float x = __shfl_sync(kAll, g.x, holder);
    const float y = __shfl_sync(kAll, g.y, holder);
    const float z = __shfl_sync(kAll, g.z, holder);
    const float w = __shfl_sync(kAll, g.w, holder);
    const int part = lane % 4;
    const float v = part == 0 ? x : (part == 1 ? y : (part == 2 ? z : w));
    if (lane + kUpdateWarp * m < dim) sum_sq += v * v;
  }
  return rowwise_rate_from(o, row, sum_sq, dim, lane);
}

// Entries of the launch (unique keys) updated with their summed gradients (key_gradient), a
// warp per kUpdateRows consecutive keys; out-of-range slots are skipped (the caller checks
// them beforehand). The update is update_row4's, element by element: the same floats.
template <OptimizerKind K>
__global__ void __launch_bounds__(kUpdateThreads)
    summing_update_kernel(OptimizerParams o, const __grid_constant__ UpdateTables<float> tab,
                          KeyGradients kg) {
  constexpr unsigned kAll = 0xffffffffu;
  const WarpEntries warp = warp_entries(tab);
  if (warp.first >= warp.total) return;  // whole warps leave together: first is the warp's
  const int lane = warp.lane;
  // Lane k < kUpdateRows: entry first + k's key's entries [s, e) and single row too.
  int32_t s = 0;
  int32_t e = 0;
  int32_t single = 0;
  if (warp.holds) {
    const int64_t u = kg.first_key + warp.first + lane;
    int64_t from = kg.starts[u];
    int64_t to = u + 1 < kg.unique ? kg.starts[u + 1] : kg.n;
    from = from < 0 ? 0 : (from > kg.n ? kg.n : from);
    to = to < from ? from : (to > kg.n ? kg.n : to);
    s = static_cast<int32_t>(from);
    e = static_cast<int32_t>(to);
    if (e - s == 1) single = static_cast<int32_t>(kg.order[s]);
  }
  for (int k = 0; k < kUpdateRows && warp.first + k < warp.total; ++k) {  // alike for all lanes
    const int tk = __shfl_sync(kAll, warp.t, k);
    const int64_t slot_k = __shfl_sync(kAll, warp.slot, k);
    const int32_t s_k = __shfl_sync(kAll, s, k);
    const int32_t e_k = __shfl_sync(kAll, e, k);
    const int32_t single_k = __shfl_sync(kAll, single, k);
    if (slot_k < 0 || slot_k >= tab.rows[tk]) continue;
    const int64_t dim = tab.dim[tk];
    const int64_t quads = dim / 4;
    float* row = tab.values[tk] + slot_k * tab.width[tk];
    float4* w4 = reinterpret_cast<float4*>(row);
    float4* s04 = reinterpret_cast<float4*>(row + dim);
    float4* s14 = reinterpret_cast<float4*>(row + 2 * dim);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // The row's words asked for before the gradient's, so both are in flight together.
    float4 w = zero;
    float4 s0 = zero;
    float4 s1 = zero;
    if (lane < quads) {
      w = w4[lane];
      if (element_state(K)) s0 = s04[lane];
      if (two_state_words(K)) s1 = s14[lane];
    }
    const float* sums = tab.grads[tk] + (warp.first + k - tab.begin[tk]) * dim;
    const float4 g = key_gradient(kg, sums, s_k, e_k, single_k, quads, lane);
    float rate = 0.0f;
    if constexpr (K == OptimizerKind::kRowwiseAdagrad) rate = rowwise_rate4(o, row, g, dim, lane);
    const float bias1 = tab.bias1[tk];
    const float bias2 = tab.bias2[tk];
    if (lane < quads) {
      update_element<K>(o, w.x, s0.x, s1.x, g.x, bias1, bias2, rate);
      update_element<K>(o, w.y, s0.y, s1.y, g.y, bias1, bias2, rate);
      update_element<K>(o, w.z, s0.z, s1.z, g.z, bias1, bias2, rate);
      update_element<K>(o, w.w, s0.w, s1.w, g.w, bias1, bias2, rate);
      w4[lane] = w;
      if (element_state(K)) s04[lane] = s0;
      if (two_state_words(K)) s14[lane] = s1;
    }
  }
}

}  // namespace cuda
}  // namespace demb
