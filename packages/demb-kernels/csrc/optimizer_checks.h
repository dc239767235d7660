// Argument checks of optimizer_update, shared by the CPU and CUDA bindings.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#include "named_choice.h"
#include "optimizer_rule.h"

namespace demb {

inline constexpr NamedChoice<OptimizerKind> kOptimizers[] = {
    {"sgd", OptimizerKind::kSgd}, {"adam", OptimizerKind::kAdam},
    {"adagrad", OptimizerKind::kAdagrad}, {"rowwise_adagrad", OptimizerKind::kRowwiseAdagrad},
    {"ftrl", OptimizerKind::kFtrl}};

// The hyper-parameters of an optimizer_update call, in float32 as the kernels use them.
inline OptimizerParams make_params(c10::string_view optimizer, double learning_rate, double eps,
                                   double beta1, double beta2, double weight_decay,
                                   double learning_rate_power, double ftrl_beta, double l1_reg,
                                   double l2_reg) {
  OptimizerKind kind = parse_choice(std::string_view(optimizer.data(), optimizer.size()),
                                    kOptimizers, "optimizer",
                                    "expected sgd, adam, adagrad, rowwise_adagrad or ftrl");
  if (kind == OptimizerKind::kFtrl && learning_rate_power == -0.5) kind = OptimizerKind::kFtrlSqrt;
  return OptimizerParams{kind,
                         static_cast<float>(learning_rate),
                         static_cast<float>(eps),
                         static_cast<float>(beta1),
                         static_cast<float>(beta2),
                         static_cast<float>(weight_decay),
                         static_cast<float>(learning_rate_power),
                         static_cast<float>(ftrl_beta),
                         static_cast<float>(l1_reg),
                         static_cast<float>(l2_reg)};
}

template <OptimizerKind K>
using Kind = std::integral_constant<OptimizerKind, K>;

// Calls fn(Kind<K>{}) with the runtime `kind` as a compile-time constant.
template <typename Fn>
void with_optimizer(OptimizerKind kind, Fn fn) {
  switch (kind) {
    case OptimizerKind::kSgd: return fn(Kind<OptimizerKind::kSgd>{});
    case OptimizerKind::kAdam: return fn(Kind<OptimizerKind::kAdam>{});
    case OptimizerKind::kAdagrad: return fn(Kind<OptimizerKind::kAdagrad>{});
    case OptimizerKind::kRowwiseAdagrad: return fn(Kind<OptimizerKind::kRowwiseAdagrad>{});
    case OptimizerKind::kFtrl: return fn(Kind<OptimizerKind::kFtrl>{});
    case OptimizerKind::kFtrlSqrt: return fn(Kind<OptimizerKind::kFtrlSqrt>{});
  }
}

// skip: none, or a one-element bool tensor on the values' device.
inline void check_skip(const std::optional<at::Tensor>& skip, at::TensorList values) {
  if (!skip) return;
  TORCH_CHECK_TYPE(skip->scalar_type() == at::kBool, "skip must be bool, got ",
                   skip->scalar_type());
  TORCH_CHECK_VALUE(skip->numel() == 1, "skip must hold one flag, got ", skip->sizes());
  TORCH_CHECK_VALUE(values.empty() || skip->device() == values[0].device(), "skip is on ",
                    skip->device(), ", the values on ", values[0].device());
}

// Bytes row-wise Adagrad reserves per row (demb_optim.ROWWISE_ADAGRAD_STATE_BYTES).
constexpr int64_t kRowwiseStateBytes = 16;

// Checks table `t` of an update: values (R, dim + state) in float32/16/bf16, slots (n,) int64,
// grads (n, dim) float32, all on one device. Returns the row width.
inline int64_t check_update_table(OptimizerKind kind, const at::Tensor& values,
                                  const at::Tensor& slots, const at::Tensor& grads, int64_t dim,
                                  int64_t step, size_t t) {
  const auto dtype = values.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "values[", t, "] must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(values.dim() == 2 && values.is_contiguous(), "values[", t,
                    "] must be a contiguous (rows, width) tensor");
  TORCH_CHECK_VALUE(dim >= 1, "dims[", t, "]=", dim, ": must be >= 1");
  const int64_t state = optimizer_state_dim(kind, dim, kRowwiseStateBytes / values.element_size());
  TORCH_CHECK_VALUE(values.size(1) == dim + state, "values[", t, "] rows have ", values.size(1),
                    " columns; dims[", t, "]=", dim, " needs ", dim + state,
                    " (embedding + optimizer state)");
  TORCH_CHECK_TYPE(slots.scalar_type() == at::kLong, "slots[", t, "] must be int64");
  TORCH_CHECK_VALUE(slots.dim() == 1, "slots[", t, "] must be 1-D");
  TORCH_CHECK_TYPE(grads.scalar_type() == at::kFloat, "grads[", t, "] must be float32, got ",
                   grads.scalar_type());
  TORCH_CHECK_VALUE(grads.dim() == 2 && grads.size(0) == slots.numel() && grads.size(1) == dim,
                    "grads[", t, "] must be (", slots.numel(), ", ", dim, "), got ",
                    grads.sizes());
  TORCH_CHECK_VALUE(slots.device() == values.device() && grads.device() == values.device(),
                    "values, slots and grads of table ", t, " must be on one device");
  TORCH_CHECK_VALUE(kind != OptimizerKind::kAdam || step >= 1, "steps[", t, "]=", step,
                    ": Adam's step count must be >= 1");
  return values.size(1);
}

// Checks every table of an update before any row changes (a bad table t > 0 must not leave
// tables 0..t-1 updated). Returns each table's row width.
inline std::vector<int64_t> check_update(OptimizerKind kind, at::TensorList values,
                                         at::TensorList slots, at::TensorList grads,
                                         at::IntArrayRef dims, at::IntArrayRef steps) {
  TORCH_CHECK_VALUE(values.size() == slots.size() && values.size() == grads.size() &&
                        values.size() == dims.size() && values.size() == steps.size(),
                    "values, slots, grads, dims and steps need one entry per table, got ",
                    values.size(), ", ", slots.size(), ", ", grads.size(), ", ", dims.size(),
                    ", ", steps.size());
  std::vector<int64_t> widths;
  widths.reserve(values.size());
  for (size_t t = 0; t < values.size(); ++t) {
    widths.push_back(
        check_update_table(kind, values[t], slots[t], grads[t], dims[t], steps[t], t));
  }
  return widths;
}

// grad_rows and grad_source: neither, or both: grad_rows (sum of n_t,) int64 over the tables'
// entries in order, grad_source (R, dim) float32 with every table's dim (an entry whose row r is
// not -1 reads grad_source[r]), on the values' device.
inline void check_grad_rows(const std::optional<at::Tensor>& grad_rows,
                            const std::optional<at::Tensor>& grad_source, at::TensorList values,
                            at::TensorList slots, at::IntArrayRef dims) {
  TORCH_CHECK_VALUE(grad_rows.has_value() == grad_source.has_value(),
                    "grad_rows and grad_source: give both or neither");
  if (!grad_rows) return;
  int64_t entries = 0;
  for (const at::Tensor& s : slots) entries += s.numel();
  TORCH_CHECK_TYPE(grad_rows->scalar_type() == at::kLong, "grad_rows must be int64, got ",
                   grad_rows->scalar_type());
  TORCH_CHECK_VALUE(grad_rows->dim() == 1 && grad_rows->numel() == entries,
                    "grad_rows must be (", entries, ",): one row per entry of every table, got ",
                    grad_rows->sizes());
  TORCH_CHECK_TYPE(grad_source->scalar_type() == at::kFloat, "grad_source must be float32, got ",
                   grad_source->scalar_type());
  TORCH_CHECK_VALUE(grad_source->dim() == 2, "grad_source must be (R, dim), got ",
                    grad_source->sizes());
  for (size_t t = 0; t < values.size(); ++t) {
    TORCH_CHECK_VALUE(slots[t].numel() == 0 || grad_source->size(1) == dims[t],
                      "grad_source has rows of ", grad_source->size(1), " floats; dims[", t,
                      "]=", dims[t]);
  }
  for (const auto& [name, x] :
       {std::pair<const char*, const at::Tensor&>{"grad_rows", *grad_rows},
        {"grad_source", *grad_source}}) {
    TORCH_CHECK_VALUE(values.empty() || x.device() == values[0].device(), name, " is on ",
                      x.device(), ", the values on ", values[0].device());
  }
}

// The op optimizer_update, for every device: the checks above, then `Update`, the device's
// kernel, given the parameters, each table's row width, and grad_rows and grad_source
// contiguous (undefined when not given).
template <auto Update>
void optimizer_update_op(at::TensorList values, at::TensorList slots, at::TensorList grads,
                         at::IntArrayRef dims, at::IntArrayRef steps, c10::string_view optimizer,
                         double learning_rate, double eps, double beta1, double beta2,
                         double weight_decay, double learning_rate_power, double ftrl_beta,
                         double l1_reg, double l2_reg, const std::optional<at::Tensor>& skip,
                         const std::optional<at::Tensor>& grad_rows,
                         const std::optional<at::Tensor>& grad_source) {
  const OptimizerParams o = make_params(optimizer, learning_rate, eps, beta1, beta2,
                                        weight_decay, learning_rate_power, ftrl_beta, l1_reg,
                                        l2_reg);
  const std::vector<int64_t> widths = check_update(o.kind, values, slots, grads, dims, steps);
  check_skip(skip, values);
  check_grad_rows(grad_rows, grad_source, values, slots, dims);
  const at::Tensor rows = grad_rows ? grad_rows->contiguous() : at::Tensor();
  const at::Tensor source = grad_source ? grad_source->contiguous() : at::Tensor();
  Update(o, widths, values, slots, grads, dims, steps, skip, rows, source);
}

}  // namespace demb
