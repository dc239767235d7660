// CUDA kernels of init_rows and init_new_rows; plain CUDA, no torch headers. init_rows: one
// thread per element of the n targeted rows (a grid-stride loop over n * cols): columns
// [0, dim) from init_rule.h, columns [dim, cols) copied from the state vector. init_new_rows: a
// warp per 32 entries. The element rule is the CPU kernel's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/float_convert.cuh"
#include "init_rule.h"

namespace demb {
namespace cuda {

constexpr int kInitThreads = 256;

// Rows slots[i] of `values` (rows x width) set from keys[i]: `cols` is dim, or width when
// `state` (width - dim floats) is given. Slots out of [0, rows) are skipped (-1: no row).
template <typename T>
__global__ void __launch_bounds__(kInitThreads)
    init_rows_kernel(InitParams o, T* __restrict__ values, int64_t rows, int64_t width,
                     const int64_t* __restrict__ slots, const int64_t* __restrict__ keys,
                     int64_t n, int64_t dim, int64_t cols, const float* __restrict__ state) {
  const int64_t total = n * cols;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += stride) {
    const int64_t i = e / cols;
    const int64_t j = e - i * cols;
    const int64_t slot = slots[i];
    if (slot < 0 || slot >= rows) continue;
    const float x = j < dim ? static_cast<float>(init_element(o, static_cast<uint64_t>(keys[i]), j))
                            : state[j - dim];
    values[slot * width + j] = from_float<T>(x);
  }
}

// init_new_rows' tables, up to kMaxNewRowsTables a launch (tables first .. first + count - 1):
// each one's parameters, buffer (rows x width of dtype 0 float32, 1 float16, 2 bfloat16), dim,
// cols (dim, or width with a state) and state (width - dim floats, or null). 3.6 KB: a kernel
// parameter.
constexpr int kMaxNewRowsTables = 32;
struct NewRowsTables {
  InitParams o[kMaxNewRowsTables];
  void* base[kMaxNewRowsTables];
  const float* state[kMaxNewRowsTables];
  int64_t rows[kMaxNewRowsTables];
  int32_t width[kMaxNewRowsTables];
  int32_t dim[kMaxNewRowsTables];
  int32_t cols[kMaxNewRowsTables];
  int32_t dtype[kMaxNewRowsTables];
  int64_t first;
  int64_t count;
};

__device__ __forceinline__ void store_new(void* base, int32_t dtype, int64_t at, float x) {
  if (dtype == 0) {
    static_cast<float*>(base)[at] = x;
  } else if (dtype == 1) {
    static_cast<__half*>(base)[at] = from_float<__half>(x);
  } else {
    static_cast<__nv_bfloat16*>(base)[at] = from_float<__nv_bfloat16>(x);
  }
}

// A warp per 32 entries (grid-stride): its lanes read their entries' status, then the warp
// writes, one after another, the rows of those with a new row (new_row_status) of one of g's
// tables, at their slots; slots out of [0, rows) are skipped. (Most entries of a step are hits,
// so the scan of the statuses is most of the launch: a warp reads 32 of them at once. A warp
// per entry took 45 us on the H200's reference batch of 350k entries, none new.)
__global__ void __launch_bounds__(kInitThreads)
    init_new_rows_kernel(const __grid_constant__ NewRowsTables g,
                         const int64_t* __restrict__ slots, const int64_t* __restrict__ keys,
                         const int64_t* __restrict__ tables, const int64_t* __restrict__ status,
                         int64_t n) {
  constexpr int kWarp = 32;
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
       w * kWarp < n; w += warps) {
    const int64_t mine = w * kWarp + lane;
    unsigned todo = __ballot_sync(kAll, mine < n && new_row_status(status[mine]));
    while (todo != 0) {
      const int64_t i = w * kWarp + __ffs(todo) - 1;
      todo &= todo - 1;
      const int64_t t = tables[i] - g.first;
      if (t < 0 || t >= g.count) continue;
      const int64_t slot = slots[i];
      if (slot < 0 || slot >= g.rows[t]) continue;
      const auto key = static_cast<uint64_t>(keys[i]);
      const int64_t row = slot * g.width[t];
      for (int64_t j = lane; j < g.cols[t]; j += kWarp) {
        const float x = j < g.dim[t] ? static_cast<float>(init_element(g.o[t], key, j))
                                     : g.state[t][j - g.dim[t]];
        store_new(g.base[t], g.dtype[t], row + j, x);
      }
    }
  }
}

}  // namespace cuda
}  // namespace demb
