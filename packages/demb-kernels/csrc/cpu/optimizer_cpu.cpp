// CPU kernel of optimizer_update: the rows of every table updated in place, in parallel over
// rows, float32 arithmetic whatever the row dtype.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <string_view>
#include <type_traits>
#include <vector>

#include "optimizer_checks.h"

namespace demb {
namespace {

template <OptimizerKind K, typename T>
void update_rows(const OptimizerParams& o, T* values, int64_t width, int64_t rows,
                 const int64_t* slots, const float* grads, int64_t n, int64_t dim, int64_t step) {
  const float bias1 = K == OptimizerKind::kAdam ? 1.0f - std::pow(o.beta1, step) : 1.0f;
  const float bias2 = K == OptimizerKind::kAdam ? 1.0f - std::pow(o.beta2, step) : 1.0f;
  const int64_t state_width = width - dim;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(slots[i] >= -1 && slots[i] < rows, "slots: ", slots[i],
                      " is out of range for ", rows, " rows");
  }
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(dim));
    std::vector<float> s(static_cast<size_t>(state_width));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      T* row = values + slot * width;
      const float* g = grads + i * dim;
      for (int64_t j = 0; j < dim; ++j) w[j] = static_cast<float>(row[j]);
      for (int64_t k = 0; k < state_width; ++k) s[k] = static_cast<float>(row[dim + k]);
      float rowwise_rate = 0.0f;
      if constexpr (K == OptimizerKind::kRowwiseAdagrad) {
        float sum_sq = 0.0f;
        for (int64_t j = 0; j < dim; ++j) sum_sq += g[j] * g[j];
        s[0] += sum_sq / static_cast<float>(dim);
        rowwise_rate = o.learning_rate / (std::sqrt(s[0]) + o.eps);
      }
      for (int64_t j = 0; j < dim; ++j) {
        update_element<K>(o, w[j], s.data(), dim, j, g[j], bias1, bias2, rowwise_rate);
      }
      for (int64_t j = 0; j < dim; ++j) row[j] = static_cast<T>(w[j]);
      for (int64_t k = 0; k < state_width; ++k) row[dim + k] = static_cast<T>(s[k]);
    }
  });
}

template <OptimizerKind K>
using Kind = std::integral_constant<OptimizerKind, K>;

// Calls fn(Kind<K>{}) for the runtime `kind`.
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

void optimizer_update_cpu(at::TensorList values, at::TensorList slots, at::TensorList grads,
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
    const at::Tensor s = slots[t].contiguous();
    const at::Tensor g = grads[t].contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, table.scalar_type(), "demb::optimizer_update", [&] {
          with_optimizer(o.kind, [&](auto kind) {
            update_rows<decltype(kind)::value, scalar_t>(
                o, table.data_ptr<scalar_t>(), width, table.size(0), s.const_data_ptr<int64_t>(),
                g.const_data_ptr<float>(), s.numel(), dims[t], steps[t]);
          });
        });
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) { m.impl("optimizer_update", &optimizer_update_cpu); }

}  // namespace demb
