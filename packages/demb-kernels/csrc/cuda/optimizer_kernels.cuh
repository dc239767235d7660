// CUDA kernel of optimizer_update; plain CUDA, no torch headers. One warp per updated row, its
// lanes striding over the row's elements; the element rule is optimizer_rule.h, as on the CPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "optimizer_rule.h"

namespace demb {
namespace cuda {

constexpr int kUpdateWarp = 32;
constexpr int kUpdateThreads = 256;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Rows `slots[i]` of `values` (rows x width, [embedding (dim) | state]) updated with grads[i].
template <OptimizerKind K, typename T>
__global__ void optimizer_update_kernel(OptimizerParams o, T* values, int64_t width, int64_t rows,
                                        const int64_t* slots, const float* grads, int64_t n,
                                        int64_t dim, float bias1, float bias2) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kUpdateWarp;
  if (i >= n) return;
  const int lane = static_cast<int>(threadIdx.x % kUpdateWarp);
  const int64_t slot = slots[i];
  if (slot < 0 || slot >= rows) return;
  T* row = values + slot * width;
  const float* g = grads + i * dim;
  float rowwise_rate = 0.0f;
  if constexpr (K == OptimizerKind::kRowwiseAdagrad) {
    float sum_sq = 0.0f;
    for (int64_t j = lane; j < dim; j += kUpdateWarp) sum_sq += g[j] * g[j];
    for (int offset = kUpdateWarp / 2; offset > 0; offset /= 2) {
      sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    }
    const float acc = to_float(row[dim]) + sum_sq / static_cast<float>(dim);
    rowwise_rate = o.learning_rate / (sqrtf(acc) + o.eps);
    if (lane == 0) row[dim] = from_float<T>(acc);
  }
  for (int64_t j = lane; j < dim; j += kUpdateWarp) {
    float w = to_float(row[j]);
    float s0 = element_state(K) ? to_float(row[dim + j]) : 0.0f;
    float s1 = two_state_words(K) ? to_float(row[2 * dim + j]) : 0.0f;
    update_element<K>(o, w, s0, s1, g[j], bias1, bias2, rowwise_rate);
    row[j] = from_float<T>(w);
    if (element_state(K)) row[dim + j] = from_float<T>(s0);
    if (two_state_words(K)) row[2 * dim + j] = from_float<T>(s1);
  }
}

}  // namespace cuda
}  // namespace demb
