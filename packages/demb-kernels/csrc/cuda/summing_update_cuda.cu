// Launches of the unchecked fused update (summing_update.h): optimizer_update's checks, then one
// launch for up to 32 float32 tables. Built with --fmad=false like optimizer_update: the same
// floats as the two-pass update.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <vector>

#include "alignment.h"
#include "cuda/segment_sums.h"
#include "cuda/summing_update.cuh"
#include "cuda/summing_update.h"
#include "optimizer_checks.h"

namespace demb {

bool summing_update_fits(at::TensorList values, at::IntArrayRef dims, const at::Tensor& grads) {
  if (!grads.is_cuda() || grads.scalar_type() != at::kFloat || grads.dim() != 2 ||
      !grads.is_contiguous() || !window_sums(grads) || values.size() != dims.size()) {
    return false;
  }
  for (size_t t = 0; t < values.size(); ++t) {
    const at::Tensor& v = values[t];
    if (v.scalar_type() != at::kFloat || v.dim() != 2 || !v.is_contiguous() ||
        dims[t] != grads.size(1) || v.size(1) % 4 != 0 || !aligned16(v.const_data_ptr())) {
      return false;
    }
  }
  return true;
}

void summing_update_launch(at::TensorList values, at::TensorList slots, at::TensorList sums,
                           at::IntArrayRef dims, at::IntArrayRef steps,
                           c10::string_view optimizer, at::ArrayRef<double> hyper,
                           const at::Tensor& grads, const at::Tensor& order,
                           const at::Tensor& starts) {
  TORCH_CHECK(hyper.size() == 9, "summing_update_launch: expected optimizer_update's nine floats");
  const OptimizerParams o = make_params(optimizer, hyper[0], hyper[1], hyper[2], hyper[3],
                                        hyper[4], hyper[5], hyper[6], hyper[7], hyper[8]);
  const std::vector<int64_t> widths = check_update(o.kind, values, slots, sums, dims, steps);
  TORCH_CHECK(summing_update_fits(values, dims, grads),
              "summing_update_launch: the tables or gradients do not fit the fused update "
              "(summing_update_fits)");
  for (size_t t = 0; t < slots.size(); ++t) {  // before any launch: no table half updated
    TORCH_CHECK(slots[t].is_contiguous() && sums[t].is_contiguous() &&
                    aligned16(sums[t].const_data_ptr()),
                "summing_update_launch: slots[", t, "] and sums[", t,
                "] must be contiguous, sums 16-byte aligned");
  }
  const c10::cuda::CUDAGuard guard(grads.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const bool adam = o.kind == OptimizerKind::kAdam;
  cuda::KeyGradients kg{grads.const_data_ptr<float>(), order.const_data_ptr<int64_t>(),
                        starts.const_data_ptr<int64_t>(), starts.numel(), order.numel(), 0};
  size_t t = 0;
  while (t < values.size()) {  // one launch per run of <= 32 tables
    cuda::UpdateTables<float> tab{};
    tab.begin[0] = 0;
    const int64_t first_key = kg.first_key;
    for (; t < values.size() && tab.count < cuda::kMaxUpdateTables;
         kg.first_key += slots[t].numel(), ++t) {
      if (slots[t].numel() == 0) continue;
      cuda::add_update_table(tab, values[t].data_ptr<float>(), widths[t], values[t].size(0),
                             slots[t].const_data_ptr<int64_t>(), slots[t].numel(),
                             sums[t].const_data_ptr<float>(), nullptr, dims[t],
                             adam ? adam_bias(o.beta1, steps[t]) : 1.0f,
                             adam ? adam_bias(o.beta2, steps[t]) : 1.0f);
    }
    const int64_t n = tab.begin[tab.count];
    if (n == 0) continue;
    cuda::KeyGradients launch_kg = kg;
    launch_kg.first_key = first_key;
    const auto blocks = static_cast<unsigned>(
        (cuda::update_warps(n) * cuda::kUpdateWarp + cuda::kUpdateThreads - 1) /
        cuda::kUpdateThreads);
    with_optimizer(o.kind, [&](auto kind) {
      cuda::summing_update_kernel<decltype(kind)::value>
          <<<blocks, cuda::kUpdateThreads, 0, stream>>>(o, tab, launch_kg);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace demb
