// Argument checks of init_rows, shared by the CPU and CUDA bindings, and the host-side setup of
// its parameters (InitParams, init_rule.h).
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "init_rule.h"
#include "named_choice.h"

namespace demb {

// The parameters of an init_rows call. truncated_normal's pa / pb are computed here, on the
// host, once for every device.
inline InitParams make_init_params(InitMode kind, int64_t seed, double mean, double std_dev,
                                   double lower, double upper, double value) {
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

inline constexpr NamedChoice<InitMode> kInitModes[] = {
    {"uniform", InitMode::kUniform}, {"normal", InitMode::kNormal},
    {"truncated_normal", InitMode::kTruncatedNormal}, {"constant", InitMode::kConstant},
    {"debug", InitMode::kDebug}};

inline InitParams make_init_params(c10::string_view mode, int64_t seed, double mean,
                                   double std_dev, double lower, double upper, double value) {
  const InitMode kind = parse_choice(std::string_view(mode.data(), mode.size()), kInitModes,
                                     "mode",
                                     "unknown; expected 'uniform', 'normal', 'truncated_normal', "
                                     "'constant' or 'debug'");
  return make_init_params(kind, seed, mean, std_dev, lower, upper, value);
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

// One table of an init_new_rows call: where its rows are and what to write into them.
struct NewRowsTable {
  InitParams o;
  int64_t dim;
  int64_t cols;  // dim, or the row width when a state is written after the embedding
  std::optional<at::Tensor> state;  // contiguous (width - dim,) float32
};

// Parameter words per table in init_new_rows' `params`: mean, std_dev, lower, upper, value.
constexpr int64_t kNewRowsParams = 5;

// init_new_rows' arguments: T value buffers as init_rows takes one; slots, keys, tables and
// status (n,) int64 on their device; T dims, seeds and modes (InitMode codes); 5 T params;
// T states (None or (W_t - dim_t,) float32). Returns each table's parameters.
inline std::vector<NewRowsTable> check_init_new_rows(
    at::TensorList values, const at::Tensor& slots, const at::Tensor& keys,
    const at::Tensor& tables, const at::Tensor& status, at::IntArrayRef dims,
    at::IntArrayRef seeds, at::IntArrayRef modes, at::ArrayRef<double> params,
    const c10::List<std::optional<at::Tensor>>& states) {
  const auto count = static_cast<int64_t>(values.size());
  TORCH_CHECK_VALUE(count >= 1, "values: init_new_rows needs at least one table");
  for (const auto& [name, size] :
       {std::pair<const char*, int64_t>{"dims", static_cast<int64_t>(dims.size())},
        {"seeds", static_cast<int64_t>(seeds.size())},
        {"modes", static_cast<int64_t>(modes.size())},
        {"states", static_cast<int64_t>(states.size())}}) {
    TORCH_CHECK_VALUE(size == count, name, ": ", size, " entries for ", count, " tables");
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(params.size()) == kNewRowsParams * count, "params: ",
                    params.size(), " words; expected ", kNewRowsParams, " per table (",
                    kNewRowsParams * count, ")");
  for (const auto& [name, x] : {std::pair<const char*, const at::Tensor&>{"tables", tables},
                                {"status", status}}) {
    TORCH_CHECK_TYPE(x.scalar_type() == at::kLong, name, " must be int64, got ", x.scalar_type());
    TORCH_CHECK_VALUE(x.dim() == 1 && x.numel() == slots.numel(), name,
                      " must be 1-D with one entry per slot (", slots.numel(), "), got ",
                      x.sizes());
    TORCH_CHECK_VALUE(x.device() == values[0].device(), name, " is on ", x.device(),
                      ", values on ", values[0].device());
  }
  std::vector<NewRowsTable> out;
  out.reserve(count);
  for (int64_t t = 0; t < count; ++t) {
    const std::optional<at::Tensor> state = states.get(t);
    check_init_rows(values[t], slots, keys, dims[t], state);
    TORCH_CHECK_VALUE(values[t].device() == values[0].device(), "values[", t, "] is on ",
                      values[t].device(), ", values[0] on ", values[0].device());
    TORCH_CHECK_VALUE(modes[t] >= 0 && modes[t] <= static_cast<int64_t>(InitMode::kDebug),
                      "modes[", t, "]=", modes[t], ": not an init mode code");
    const double* p = params.data() + kNewRowsParams * t;
    NewRowsTable table{make_init_params(static_cast<InitMode>(modes[t]), seeds[t], p[0], p[1],
                                        p[2], p[3], p[4]),
                       dims[t], state.has_value() ? values[t].size(1) : dims[t], std::nullopt};
    if (state.has_value()) table.state = state->contiguous();
    out.push_back(std::move(table));
  }
  return out;
}

// The op init_new_rows, for every device: check_init_new_rows, then `Init`, the device's
// kernel, given each table's parameters (values, spec, slots, keys, tables, status).
template <auto Init>
void init_new_rows_op(at::TensorList values, const at::Tensor& slots, const at::Tensor& keys,
                      const at::Tensor& tables, const at::Tensor& status, at::IntArrayRef dims,
                      at::IntArrayRef seeds, at::IntArrayRef modes, at::ArrayRef<double> params,
                      const c10::List<std::optional<at::Tensor>>& states) {
  const std::vector<NewRowsTable> spec = check_init_new_rows(
      values, slots, keys, tables, status, dims, seeds, modes, params, states);
  Init(values, spec, slots, keys, tables, status);
}

}  // namespace demb
