// Argument checks of init_rows, shared by the CPU and CUDA bindings, and the host-side setup of
// its parameters (InitParams, init_rule.h).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>

#include "init_rule.h"

namespace demb {

inline InitMode parse_init_mode(std::string_view name) {
  if (name == "uniform") return InitMode::kUniform;
  if (name == "normal") return InitMode::kNormal;
  if (name == "truncated_normal") return InitMode::kTruncatedNormal;
  if (name == "constant") return InitMode::kConstant;
  if (name == "debug") return InitMode::kDebug;
  TORCH_CHECK_VALUE(false, "mode='", name,
                    "': unknown; expected 'uniform', 'normal', 'truncated_normal', 'constant' "
                    "or 'debug'");
}

// The parameters of an init_rows call. truncated_normal's pa / pb are computed here, on the
// host, once for every device.
inline InitParams make_init_params(c10::string_view mode, int64_t seed, double mean,
                                   double std_dev, double lower, double upper, double value) {
  const InitMode kind = parse_init_mode(std::string_view(mode.data(), mode.size()));
  double pa = 0.0;
  double pb = 0.0;
  if (kind == InitMode::kTruncatedNormal) {
    TORCH_CHECK_VALUE(std::isfinite(std_dev) && std_dev > 0.0, "std_dev=", std_dev,
                      ": mode='truncated_normal' needs a finite std_dev > 0");
    TORCH_CHECK_VALUE(std::isfinite(lower) && std::isfinite(upper) && lower <= upper,
                      "lower=", lower, ", upper=", upper,
                      ": mode='truncated_normal' needs finite bounds with lower <= upper");
    pa = normal_cdf((lower - mean) / std_dev);
    pb = normal_cdf((upper - mean) / std_dev);
  }
  return InitParams{kind, static_cast<uint64_t>(seed), mean, std_dev, lower, upper, value,
                    pa, pb};
}

// values (R, W) contiguous float32/float16/bfloat16; slots and keys (n,) int64; 1 <= dim <= W;
// state None or (W - dim,) float32; all on values' device.
inline void check_init_rows(const at::Tensor& values, const at::Tensor& slots,
                            const at::Tensor& keys, int64_t dim,
                            const std::optional<at::Tensor>& state) {
  const auto dtype = values.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "values must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK_VALUE(values.dim() == 2, "values must be 2-D (rows, width), got ", values.sizes());
  TORCH_CHECK_VALUE(values.is_contiguous(), "values must be contiguous");
  TORCH_CHECK_TYPE(slots.scalar_type() == at::kLong, "slots must be int64, got ",
                   slots.scalar_type());
  TORCH_CHECK_VALUE(slots.dim() == 1, "slots must be 1-D, got ", slots.sizes());
  TORCH_CHECK_TYPE(keys.scalar_type() == at::kLong, "keys must be int64, got ",
                   keys.scalar_type());
  TORCH_CHECK_VALUE(keys.dim() == 1 && keys.numel() == slots.numel(),
                    "keys must be 1-D with one key per slot (", slots.numel(), "), got ",
                    keys.sizes());
  TORCH_CHECK_VALUE(slots.device() == values.device(), "slots is on ", slots.device(),
                    ", values on ", values.device());
  TORCH_CHECK_VALUE(keys.device() == values.device(), "keys is on ", keys.device(),
                    ", values on ", values.device());
  const int64_t width = values.size(1);
  TORCH_CHECK_VALUE(dim >= 1 && dim <= width, "dim=", dim, ": must be in [1, ", width,
                    "] (the width of values)");
  if (state.has_value()) {
    TORCH_CHECK_TYPE(state->scalar_type() == at::kFloat, "state must be float32, got ",
                     state->scalar_type());
    TORCH_CHECK_VALUE(state->dim() == 1 && state->numel() == width - dim, "state must be (",
                      width - dim, ",) (width - dim), got ", state->sizes());
    TORCH_CHECK_VALUE(state->device() == values.device(), "state is on ", state->device(),
                      ", values on ", values.device());
  }
}

}  // namespace demb
