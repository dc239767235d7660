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

template <OptimizerKind K>
using Kind = std::integral_constant<OptimizerKind, K>;

template <typename Fn>
void with_optimizer(OptimizerKind kind, Fn fn) {
  switch (kind) {
    case OptimizerKind::kSgd:
      fn(Kind<OptimizerKind::kSgd>{});
      break;
    case OptimizerKind::kAdam:
      fn(Kind<OptimizerKind::kAdam>{});
      break;
    case OptimizerKind::kAdagrad:
      fn(Kind<OptimizerKind::kAdagrad>{});
      break;
    case OptimizerKind::kRowwiseAdagrad:
      fn(Kind<OptimizerKind::kRowwiseAdagrad>{});
      break;
    case OptimizerKind::kFtrl:
      fn(Kind<OptimizerKind::kFtrl>{});
      break;
  }
}

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
  check_update_lists(values.size(), slots.size(), grads.size(), dims.size(), steps.size());
  const OptimizerParams o{parse_optimizer(std::string_view(optimizer.data(), optimizer.size())),
                          static_cast<float>(learning_rate),
                          static_cast<float>(eps),
                          static_cast<float>(beta1),
                          static_cast<float>(beta2),
                          static_cast<float>(weight_decay),
                          static_cast<float>(learning_rate_power),
                          static_cast<float>(ftrl_beta),
                          static_cast<float>(l1_reg),
                          static_cast<float>(l2_reg)};
  for (size_t t = 0; t < values.size(); ++t) {
    const at::Tensor& table = values[t];
    const int64_t width =
        check_update_table(o.kind, table, slots[t], grads[t], dims[t], steps[t], t);
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
