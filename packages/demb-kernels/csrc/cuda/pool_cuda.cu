// CUDA kernel and binding of pool_table_rows (pool_checks.h's rule): one warp per bag, each
// lane a column (or a float4 of columns) of the bag's output row, its rows added in index
// order, kPoolRows of them loaded before they are added. Unchecked values read as missing: a
// table id out of range, a slot out of [0, rows) and a decreasing bag (empty) add nothing.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "cuda/gather_rows.cuh"
#include "pool_checks.h"

namespace demb {
namespace cuda {

constexpr int kPoolRows = 8;  // rows a warp loads before adding them

// Bag q = f * B + b of `offsets` into out[b, f * dim : (f + 1) * dim]. Vec4: float32 rows whose
// dim, widths and bases are multiples of 4 floats, one float4 per lane and column block.
template <bool Vec4>
__global__ void __launch_bounds__(kLookupThreads)
    pool_rows_kernel(const __grid_constant__ GatherTables g, const int64_t* __restrict__ slots,
                     const int64_t* __restrict__ offsets,
                     const int64_t* __restrict__ feature_tables,
                     const float* __restrict__ weights, int64_t features, int64_t batch_size,
                     int64_t dim, bool mean, float* __restrict__ out) {
  constexpr unsigned kAll = 0xffffffffu;
  const int64_t q = warp_index();
  if (q >= features * batch_size) return;  // the same for the warp's lanes
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t f = q / batch_size;
  const int64_t begin = offsets[q];
  const int64_t end = offsets[q + 1] > begin ? offsets[q + 1] : begin;
  const int64_t t = feature_tables[f];
  const bool table_ok = t >= 0 && t < g.count;
  const float* base = table_ok ? static_cast<const float*>(g.base[t]) : nullptr;
  const int64_t width = table_ok ? g.width[t] : 0;
  const int64_t rows = table_ok ? g.rows[t] : 0;
  float* row_out = out + ((q % batch_size) * features + f) * dim;
  const int64_t cols = Vec4 ? dim / 4 : dim;
  for (int64_t c0 = 0; c0 < cols; c0 += kLookupWarp) {
    const int64_t col = c0 + lane;
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int64_t i0 = begin; i0 < end; i0 += kLookupWarp) {
      int64_t my_slot = -1;
      float my_weight = 1.0f;
      if (i0 + lane < end) {
        my_slot = slots[i0 + lane];
        if (weights != nullptr) my_weight = weights[i0 + lane];
      }
      const int here = static_cast<int>(end - i0 < kLookupWarp ? end - i0 : kLookupWarp);
      for (int r0 = 0; r0 < here; r0 += kPoolRows) {
        float4 x[kPoolRows];
        float w[kPoolRows];
        bool has[kPoolRows];
#pragma unroll
        for (int r = 0; r < kPoolRows; ++r) {
          const int64_t s = __shfl_sync(kAll, my_slot, r0 + r);
          w[r] = __shfl_sync(kAll, my_weight, r0 + r);
          has[r] = r0 + r < here && s >= 0 && s < rows;
          x[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          if (has[r] && col < cols) {
            const float* src = base + s * width;
            if constexpr (Vec4) {
              x[r] = __ldg(reinterpret_cast<const float4*>(src) + col);
            } else {
              x[r].x = __ldg(src + col);
            }
          }
        }
#pragma unroll
        for (int r = 0; r < kPoolRows; ++r) {
          if (!has[r]) continue;
          if (weights != nullptr) {  // the product, then the sum (--fmad=false), as the CPU
            acc.x += x[r].x * w[r];
            acc.y += x[r].y * w[r];
            acc.z += x[r].z * w[r];
            acc.w += x[r].w * w[r];
          } else {
            acc.x += x[r].x;
            acc.y += x[r].y;
            acc.z += x[r].z;
            acc.w += x[r].w;
          }
        }
      }
    }
    if (col >= cols) continue;
    if (mean && end > begin) {
      const auto len = static_cast<float>(end - begin);
      acc = make_float4(acc.x / len, acc.y / len, acc.z / len, acc.w / len);
    }
    if constexpr (Vec4) {
      reinterpret_cast<float4*>(row_out)[col] = acc;
    } else {
      row_out[col] = acc.x;
    }
  }
}

}  // namespace cuda

namespace {

at::Tensor pool_table_rows_cuda(at::TensorList values, const at::Tensor& slots_in,
                                const at::Tensor& offsets_in,
                                const at::Tensor& feature_tables_in, int64_t batch_size,
                                int64_t dim, bool mean,
                                const std::optional<at::Tensor>& weights_in) {
  const PoolShape p = check_pool_args(values, slots_in, offsets_in, feature_tables_in,
                                      batch_size, dim, weights_in);
  const c10::cuda::CUDAGuard guard(slots_in.device());
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const at::Tensor feature_tables = feature_tables_in.contiguous();
  const at::Tensor weights = weights_in ? weights_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty({batch_size, p.features * dim}, slots.options().dtype(at::kFloat));
  const int64_t bags = p.features * batch_size;
  if (bags == 0) return out;
  bool vec4 = dim % 4 == 0;
  for (int64_t t = 0; t < p.tables.count; ++t) {
    vec4 = vec4 && p.tables.width[t] % 4 == 0 &&
           reinterpret_cast<uintptr_t>(p.tables.base[t]) % 16 == 0;
  }
  const auto blocks = static_cast<unsigned>((bags * cuda::kLookupWarp + cuda::kLookupThreads - 1) /
                                            cuda::kLookupThreads);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* w = weights.defined() && p.n ? weights.const_data_ptr<float>() : nullptr;
  const auto launch = [&](auto kernel) {
    kernel<<<blocks, cuda::kLookupThreads, 0, stream>>>(
        p.tables, slots.const_data_ptr<int64_t>(), offsets.const_data_ptr<int64_t>(),
        feature_tables.const_data_ptr<int64_t>(), w, p.features, batch_size, dim, mean,
        out.data_ptr<float>());
  };
  if (vec4) {
    launch(cuda::pool_rows_kernel<true>);
  } else {
    launch(cuda::pool_rows_kernel<false>);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) { m.impl("pool_table_rows", &pool_table_rows_cuda); }

}  // namespace demb
