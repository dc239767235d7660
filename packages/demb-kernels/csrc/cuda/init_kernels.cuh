// CUDA kernel of init_rows; plain CUDA, no torch headers. One thread per element of the n
// targeted rows (a grid-stride loop over n * cols): columns [0, dim) from init_rule.h, columns
// [dim, cols) copied from the state vector. The element rule is the CPU kernel's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "init_rule.h"

namespace demb {
namespace cuda {

constexpr int kInitThreads = 256;

// float -> row dtype, round to nearest even.
template <typename T>
__device__ __forceinline__ T init_store(float x);
template <>
__device__ __forceinline__ float init_store<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half init_store<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 init_store<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

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
    values[slot * width + j] = init_store<T>(x);
  }
}

}  // namespace cuda
}  // namespace demb
