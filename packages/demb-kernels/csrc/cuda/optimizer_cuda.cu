// CUDA binding of optimizer_update: the checks of optimizer_checks.h, then one launch for up to
// 32 tables of one dtype (grad_rows' entries out of [-1, R) skipped, unchecked).
// The float arithmetic is the CPU kernel's: nvcc builds with --fmad=false (setup.py), so no
// multiply-add is contracted differently from the CPU build.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#include "alignment.h"
#include "cuda/optimizer_kernels.cuh"
#include "optimizer_checks.h"

namespace demb {
namespace {

// Calls fn(T{}) with the CUDA type of the rows' dtype.
template <typename Fn>
void with_row_type(at::ScalarType dtype, Fn fn) {
  if (dtype == at::kFloat) {
    fn(float{});
  } else if (dtype == at::kHalf) {
    fn(__half{});
  } else {
    fn(__nv_bfloat16{});
  }
}

void optimizer_update_cuda(const OptimizerParams& o, const std::vector<int64_t>& widths,
                           at::TensorList values, at::TensorList slots, at::TensorList grads,
                           at::IntArrayRef dims, at::IntArrayRef steps,
                           const std::optional<at::Tensor>& skip_in, const at::Tensor& grad_rows,
                           const at::Tensor& source) {
  const at::Tensor skip = skip_in ? skip_in->contiguous() : at::Tensor();
  const int64_t* rows_of = grad_rows.defined() ? grad_rows.const_data_ptr<int64_t>() : nullptr;
  const float* source_data = source.defined() ? source.const_data_ptr<float>() : nullptr;
  int64_t first = 0;  // table t's first entry in grad_rows
  const bool* skip_flag = skip.defined() ? skip.const_data_ptr<bool>() : nullptr;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool adam = o.kind == OptimizerKind::kAdam;
  std::vector<at::Tensor> keep;  // the contiguous slots and grads a launch reads
  size_t t = 0;
  while (t < values.size()) {  // one launch per run of <= 32 tables of one dtype
    const auto dtype = values[t].scalar_type();
    const c10::cuda::CUDAGuard guard(values[t].device());
    with_row_type(dtype, [&](auto zero) {
      using T = decltype(zero);
      cuda::UpdateTables<T> tab{};
      tab.begin[0] = 0;
      tab.source = source_data;
      tab.source_rows = source.defined() ? source.size(0) : 0;
      // float4 moves when every table of the launch is float32 with 16-byte aligned rows,
      // state words and gradients.
      bool vec4 = std::is_same_v<T, float> && (!source_data || aligned16(source_data));
      for (; t < values.size() && values[t].scalar_type() == dtype &&
             tab.count < cuda::kMaxUpdateTables;
           first += slots[t].numel(), ++t) {
        if (slots[t].numel() == 0) continue;
        keep.push_back(slots[t].contiguous());
        const int64_t* slots_t = keep.back().const_data_ptr<int64_t>();
        keep.push_back(grads[t].contiguous());
        const float* grads_t = keep.back().const_data_ptr<float>();
        auto* values_t = static_cast<T*>(values[t].data_ptr());
        cuda::add_update_table(tab, values_t, widths[t], values[t].size(0), slots_t,
                               slots[t].numel(), grads_t, rows_of ? rows_of + first : nullptr,
                               dims[t], adam ? adam_bias(o.beta1, steps[t]) : 1.0f,
                               adam ? adam_bias(o.beta2, steps[t]) : 1.0f);
        vec4 = vec4 && dims[t] % 4 == 0 && widths[t] % 4 == 0 && aligned16(values_t) &&
               aligned16(grads_t);
      }
      const int64_t n = tab.begin[tab.count];
      if (n == 0) return;
      const auto blocks = static_cast<unsigned>(
          (cuda::update_warps(n) * cuda::kUpdateWarp + cuda::kUpdateThreads - 1) /
          cuda::kUpdateThreads);
      with_optimizer(o.kind, [&](auto kind) {
        if constexpr (std::is_same_v<T, float>) {
          if (vec4) {
            cuda::optimizer_update_kernel<decltype(kind)::value, T, true>
                <<<blocks, cuda::kUpdateThreads, 0, stream>>>(o, tab, skip_flag);
            return;
          }
        }
        cuda::optimizer_update_kernel<decltype(kind)::value, T>
            <<<blocks, cuda::kUpdateThreads, 0, stream>>>(o, tab, skip_flag);
      });
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) {
  m.impl("optimizer_update", &optimizer_update_op<optimizer_update_cuda>);
}

}  // namespace demb
