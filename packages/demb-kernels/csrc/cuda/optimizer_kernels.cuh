// CUDA kernel of optimizer_update; plain CUDA, no torch headers. One warp updates kUpdateRows
// rows in turn; for each, every lane loads kUpdateChunk of its elements (weights, state words,
// gradients), or kUpdateQuads float4 of them for aligned float32 rows, before updating and
// storing any of them, so a row's loads are all in flight at once. The element rule is
// optimizer_rule.h, as on the CPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/float_convert.cuh"
#include "optimizer_rule.h"

namespace demb {
namespace cuda {

constexpr int kUpdateWarp = kRowwiseLanes;
constexpr int kUpdateThreads = 256;
// Elements per lane loaded together: D=128 is one chunk.
constexpr int kUpdateChunk = 4;

// Row-wise Adagrad, from each lane's partial sum of squares (elements lane, lane + 32, ...):
// adds mean(g^2) to the row's accumulator row[dim] and returns the row's rate
// lr / (sqrt(acc) + eps). Every lane reads the accumulator before lane 0 writes it.
template <typename T>
__device__ __forceinline__ float rowwise_rate_from(const OptimizerParams& o, T* row,
                                                   float sum_sq, int64_t dim, int lane) {
  const float acc_old = to_float(row[dim]);
  for (int offset = kUpdateWarp / 2; offset > 0; offset /= 2) {
    sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
  }
  const float acc = acc_old + sum_sq / static_cast<float>(dim);
  __syncwarp();
  if (lane == 0) row[dim] = from_float<T>(acc);
  return o.learning_rate / (sqrtf(acc) + o.eps);
}

// Row-wise Adagrad's rate (rowwise_rate_from) from the gradient row g.
template <typename T>
__device__ float rowwise_rate(const OptimizerParams& o, T* row, const float* g, int64_t dim,
                              int lane) {
  float sum_sq = 0.0f;
  for (int64_t j = lane; j < dim; j += kUpdateWarp) sum_sq += g[j] * g[j];
  return rowwise_rate_from(o, row, sum_sq, dim, lane);
}

// The most tables one launch updates (their pointers travel by value).
constexpr int kMaxUpdateTables = 32;

// The tables of one launch: table t's rows are entries [begin[t], begin[t + 1]) of the launch.
template <typename T>
struct UpdateTables {
  T* values[kMaxUpdateTables];  // (rows, width): [embedding (dim) | state]
  int64_t width[kMaxUpdateTables];
  int64_t rows[kMaxUpdateTables];
  const int64_t* slots[kMaxUpdateTables];
  const float* grads[kMaxUpdateTables];  // (n_t, dim)
  // (n_t,) or null: an entry whose row r is in [0, source_rows) reads source[r] instead (-1:
  // grads; any other r skips the entry: the caller checks them beforehand).
  const int64_t* grad_rows[kMaxUpdateTables];
  int64_t dim[kMaxUpdateTables];
  float bias1[kMaxUpdateTables];
  float bias2[kMaxUpdateTables];
  int64_t begin[kMaxUpdateTables + 1];
  int count;
  const float* source;  // (source_rows, dim) rows grad_rows name
  int64_t source_rows;
};

// Adds a table of n > 0 entries to a launch (tab.count < kMaxUpdateTables): its rows `values`
// (rows, width), `slots` (n,), the gradient rows `grads` (n, dim) and, or null, `grad_rows`
// (n,) into tab.source; bias1 / bias2 Adam's corrections for its step (1 otherwise).
template <typename T>
inline void add_update_table(UpdateTables<T>& tab, T* values, int64_t width, int64_t rows,
                             const int64_t* slots, int64_t n, const float* grads,
                             const int64_t* grad_rows, int64_t dim, float bias1, float bias2) {
  const int c = tab.count++;
  tab.values[c] = values;
  tab.width[c] = width;
  tab.rows[c] = rows;
  tab.slots[c] = slots;
  tab.grads[c] = grads;
  tab.grad_rows[c] = grad_rows;
  tab.dim[c] = dim;
  tab.bias1[c] = bias1;
  tab.bias2[c] = bias2;
  tab.begin[c + 1] = tab.begin[c] + n;
}

// Quads (4 floats) per lane loaded together on the float4 path: D=128 is one pass. (Two per
// pass took 80 registers for Adam against 56, fewer warps in flight.)
constexpr int kUpdateQuads = 1;

// A lane's part of a float32 row with 16-byte aligned rows, state and gradients (dim a multiple
// of 4): quads lane, lane + 32, ... of the embedding, each state word and the gradient, loaded
// as float4 (one instruction per 4 elements instead of 4), then updated element by element with
// the same rule as the scalar path, so the same floats.
template <OptimizerKind K>
__device__ __forceinline__ void update_row4(const OptimizerParams& o, float* row, const float* g,
                                            int64_t dim, int lane, float bias1, float bias2,
                                            float rate) {
  const int64_t quads = dim / 4;
  float4* w4 = reinterpret_cast<float4*>(row);
  float4* s04 = reinterpret_cast<float4*>(row + dim);
  float4* s14 = reinterpret_cast<float4*>(row + 2 * dim);
  const float4* g4 = reinterpret_cast<const float4*>(g);
  for (int64_t base = lane; base < quads; base += kUpdateWarp * kUpdateQuads) {
    float4 w[kUpdateQuads], s0[kUpdateQuads], s1[kUpdateQuads], gq[kUpdateQuads];
#pragma unroll
    for (int u = 0; u < kUpdateQuads; ++u) {
      const int64_t q = base + u * kUpdateWarp;
      if (q >= quads) break;
      w[u] = w4[q];
      gq[u] = __ldcs(g4 + q);  // read once: evict-first, the rows keep L2
      s0[u] = element_state(K) ? s04[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      s1[u] = two_state_words(K) ? s14[q] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
#pragma unroll
    for (int u = 0; u < kUpdateQuads; ++u) {
      const int64_t q = base + u * kUpdateWarp;
      if (q >= quads) break;
      update_element<K>(o, w[u].x, s0[u].x, s1[u].x, gq[u].x, bias1, bias2, rate);
      update_element<K>(o, w[u].y, s0[u].y, s1[u].y, gq[u].y, bias1, bias2, rate);
      update_element<K>(o, w[u].z, s0[u].z, s1[u].z, gq[u].z, bias1, bias2, rate);
      update_element<K>(o, w[u].w, s0[u].w, s1[u].w, gq[u].w, bias1, bias2, rate);
      w4[q] = w[u];
      if (element_state(K)) s04[q] = s0[u];
      if (two_state_words(K)) s14[q] = s1[u];
    }
  }
}

// Entries one warp of optimizer_update_kernel updates, one after the other: their slots and
// gradient rows are loaded together first (one load latency for kUpdateRows rows, where a warp
// per row waited for its index loads before its row's loads could start). Adam on the
// reference batch: 325 us against 334 us for a warp per row; 8 rows took 330 us, and asking L2
// for the next row's lines while updating one did not change the 4 rows' time.
constexpr int kUpdateRows = 4;

// Entry i of table t (row `slot`, gradient row `r`: source[r] when r >= 0, else grads[i])
// updated by one warp; out-of-range slots and rows are skipped (the Python caller checks them
// beforehand). With Vec4 (float32 tables whose rows, state and gradients are 16-byte aligned)
// the elements move as float4 (update_row4).
template <OptimizerKind K, typename T, bool Vec4>
__device__ __forceinline__ void update_entry(const OptimizerParams& o, const UpdateTables<T>& tab,
                                             int t, int64_t i, int64_t slot, int64_t r,
                                             int lane) {
  if (slot < 0 || slot >= tab.rows[t]) return;
  if (r < -1 || r >= tab.source_rows) return;
  const int64_t dim = tab.dim[t];
  T* row = tab.values[t] + slot * tab.width[t];
  const float* g = r >= 0 ? tab.source + r * dim : tab.grads[t] + i * dim;
  const float bias1 = tab.bias1[t];
  const float bias2 = tab.bias2[t];
  float rate = 0.0f;
  if constexpr (K == OptimizerKind::kRowwiseAdagrad) rate = rowwise_rate(o, row, g, dim, lane);
  if constexpr (Vec4) {
    update_row4<K>(o, row, g, dim, lane, bias1, bias2, rate);
  } else {
    for (int64_t base = lane; base < dim; base += kUpdateWarp * kUpdateChunk) {
      float w[kUpdateChunk], s0[kUpdateChunk], s1[kUpdateChunk], gj[kUpdateChunk];
#pragma unroll
      for (int u = 0; u < kUpdateChunk; ++u) {
        const int64_t j = base + u * kUpdateWarp;
        if (j >= dim) break;
        w[u] = to_float(row[j]);
        gj[u] = __ldcs(g + j);  // read once: evict-first, the rows keep L2
        s0[u] = element_state(K) ? to_float(row[dim + j]) : 0.0f;
        s1[u] = two_state_words(K) ? to_float(row[2 * dim + j]) : 0.0f;
      }
#pragma unroll
      for (int u = 0; u < kUpdateChunk; ++u) {
        const int64_t j = base + u * kUpdateWarp;
        if (j >= dim) break;
        update_element<K>(o, w[u], s0[u], s1[u], gj[u], bias1, bias2, rate);
        row[j] = from_float<T>(w[u]);
        if (element_state(K)) row[dim + j] = from_float<T>(s0[u]);
        if (two_state_words(K)) row[2 * dim + j] = from_float<T>(s1[u]);
      }
    }
  }
}

// Warps of optimizer_update_kernel for n entries.
inline int64_t update_warps(int64_t n) { return (n + kUpdateRows - 1) / kUpdateRows; }

// The first of the kUpdateRows consecutive launch entries the calling thread's warp updates.
__device__ __forceinline__ int64_t warp_first_entry() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kUpdateWarp * kUpdateRows;
}

// The table of launch entry `entry` (< tab.begin[tab.count]): a linear scan of the launch's
// at most kMaxUpdateTables table starts.
template <typename T>
__device__ __forceinline__ int entry_table(const UpdateTables<T>& tab, int64_t entry) {
  int t = 0;
  while (t + 1 < tab.count && tab.begin[t + 1] <= entry) ++t;
  return t;
}

// The calling thread's share of a launch: its warp updates entries first .. first +
// kUpdateRows - 1 (those below total), and lane k < kUpdateRows holds entry first + k (`holds`):
// its table t, index i in it and slot (else 0, 0 and -1).
struct WarpEntries {
  int64_t first;
  int64_t total;
  int lane;
  bool holds;
  int t;
  int64_t i;
  int64_t slot;
};

template <typename T>
__device__ __forceinline__ WarpEntries warp_entries(const UpdateTables<T>& tab) {
  WarpEntries warp{warp_first_entry(), tab.begin[tab.count],
                   static_cast<int>(threadIdx.x % kUpdateWarp), false, 0, 0, -1};
  warp.holds = warp.lane < kUpdateRows && warp.first + warp.lane < warp.total;
  if (warp.holds) {
    warp.t = entry_table(tab, warp.first + warp.lane);
    warp.i = warp.first + warp.lane - tab.begin[warp.t];
    warp.slot = tab.slots[warp.t][warp.i];
  }
  return warp;
}

// Row slots[i] of each table updated with grads[i] (or source[grad_rows[i]]) (update_entry);
// nothing changes when *skip is set. One warp per kUpdateRows consecutive entries, all tables
// in one launch.
template <OptimizerKind K, typename T, bool Vec4 = false>
__global__ void __launch_bounds__(kUpdateThreads)
    optimizer_update_kernel(OptimizerParams o, const __grid_constant__ UpdateTables<T> tab,
                            const bool* __restrict__ skip) {
  constexpr unsigned kAll = 0xffffffffu;
  if (skip && *skip) return;  // the caller found the gradients unusable: no row changes
  const WarpEntries warp = warp_entries(tab);
  if (warp.first >= warp.total) return;  // whole warps leave together: first is the warp's
  // Lane k < kUpdateRows: entry first + k's gradient row too.
  const int64_t r = warp.holds && tab.grad_rows[warp.t] ? tab.grad_rows[warp.t][warp.i] : -1;
  for (int k = 0; k < kUpdateRows && warp.first + k < warp.total; ++k) {  // alike for all lanes
    const int tk = __shfl_sync(kAll, warp.t, k);
    const int64_t slot_k = __shfl_sync(kAll, warp.slot, k);
    const int64_t r_k = __shfl_sync(kAll, r, k);
    update_entry<K, T, Vec4>(o, tab, tk, warp.first + k - tab.begin[tk], slot_k, r_k,
                             warp.lane);
  }
}

}  // namespace cuda
}  // namespace demb
