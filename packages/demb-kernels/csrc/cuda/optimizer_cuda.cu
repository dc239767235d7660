// CUDA binding of optimizer_update: the checks of optimizer_checks.h, then one launch per table.
// The float arithmetic is the CPU kernel's: nvcc builds with --fmad=false (setup.py), so no
// multiply-add is contracted differently from the CPU build.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <string_view>
#include <type_traits>

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

void optimizer_update_cuda(at::TensorList values, at::TensorList slots, at::TensorList grads,
                           at::IntArrayRef dims, at::IntArrayRef steps, c10::string_view optimizer,
                           double learning_rate, double eps, double beta1, double beta2,
                           double weight_decay, double learning_rate_power, double ftrl_beta,
                           double l1_reg, double l2_reg) {
  const OptimizerParams o = make_params(optimizer, learning_rate, eps, beta1, beta2,
                                        weight_decay, learning_rate_power, ftrl_beta, l1_reg,
                                        l2_reg);
  const std::vector<int64_t> widths = check_update(o.kind, values, slots, grads, dims, steps);
  for (size_t t = 0; t < values.size(); ++t) {
    const at::Tensor& table = values[t];
    const int64_t width = widths[t];
    const int64_t n = slots[t].numel();
    if (n == 0) continue;
    const c10::cuda::CUDAGuard guard(table.device());
    const at::Tensor s = slots[t].contiguous();
    const at::Tensor g = grads[t].contiguous();
    const bool adam = o.kind == OptimizerKind::kAdam;
    const float bias1 = adam ? adam_bias(o.beta1, steps[t]) : 1.0f;
    const float bias2 = adam ? adam_bias(o.beta2, steps[t]) : 1.0f;
    const auto blocks =
        static_cast<unsigned>((n * cuda::kUpdateWarp + cuda::kUpdateThreads - 1) /
                              cuda::kUpdateThreads);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    with_row_type(table.scalar_type(), [&](auto zero) {
      using T = decltype(zero);
      with_optimizer(o.kind, [&](auto kind) {
        cuda::optimizer_update_kernel<decltype(kind)::value, T>
            <<<blocks, cuda::kUpdateThreads, 0, stream>>>(
                o, static_cast<T*>(table.data_ptr()), width, table.size(0),
                s.const_data_ptr<int64_t>(), g.const_data_ptr<float>(), n, dims[t], bias1,
                bias2);
      });
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) { m.impl("optimizer_update", &optimizer_update_cuda); }

}  // namespace demb
