// Argument checks of gather_table_rows, table_find_rows and segment_sum_rows, shared by the CPU
// and CUDA bindings.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "alignment.h"
#include "lookup_rule.h"
#include "table_checks.h"

namespace demb {

// values: T tensors (R_t, W_t >= dim), one float dtype, contiguous, on one device. Returns the
// tables' pointers.
inline GatherTables check_gather_values(at::TensorList values, int64_t dim) {
  const auto t_count = static_cast<int64_t>(values.size());
  TORCH_CHECK_VALUE(t_count >= 1 && t_count <= kMaxGatherTables, "values: ", t_count,
                    " tables; gather_table_rows takes 1 to ", kMaxGatherTables);
  TORCH_CHECK_VALUE(dim >= 1, "dim=", dim, ": must be >= 1");
  const auto dtype = values[0].scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
                   "values must be float32, float16 or bfloat16, got ", dtype);
  GatherTables g{};
  g.count = t_count;
  for (int64_t t = 0; t < t_count; ++t) {
    const at::Tensor& v = values[t];
    TORCH_CHECK_TYPE(v.scalar_type() == dtype, "values[", t, "] is ", v.scalar_type(),
                     ", values[0] ", dtype, ": one dtype for all tables");
    TORCH_CHECK_VALUE(v.dim() == 2 && v.is_contiguous() && v.size(1) >= dim, "values[", t,
                      "] must be a contiguous (rows, width >= ", dim, ") tensor, got ",
                      v.sizes());
    TORCH_CHECK_VALUE(v.device() == values[0].device(), "values[", t, "] is on ", v.device(),
                      ", values[0] on ", values[0].device());
    g.base[t] = v.const_data_ptr();
    g.rows[t] = v.size(0);
    g.width[t] = v.size(1);
  }
  return g;
}

// Whether rows of `dim` columns move as float4 (the kernels' Vec4 paths): float32, and dim,
// every table's width and every table's base a multiple of 4 floats / 16 bytes.
inline bool float4_rows(const GatherTables& g, at::ScalarType dtype, int64_t dim) {
  bool ok = dtype == at::kFloat && dim % 4 == 0;
  for (int64_t t = 0; t < g.count; ++t) {
    ok = ok && g.width[t] % 4 == 0 && aligned16(g.base[t]);
  }
  return ok;
}

// values as check_gather_values; slots and tables (U,) int64; inverse (N,) int64 or none (N = U,
// row i is key i). Returns the tables' pointers.
inline GatherTables check_gather_tables(at::TensorList values, const at::Tensor& slots,
                                        const at::Tensor& tables,
                                        const std::optional<at::Tensor>& inverse, int64_t dim) {
  const GatherTables g = check_gather_values(values, dim);
  const at::Tensor& every = inverse ? *inverse : slots;  // no inverse: row i is key i
  for (const auto& [name, x] : {std::pair<const char*, const at::Tensor&>{"slots", slots},
                                {"tables", tables},
                                {"inverse", every}}) {
    TORCH_CHECK_TYPE(x.scalar_type() == at::kLong, name, " must be int64, got ", x.scalar_type());
    TORCH_CHECK_VALUE(x.dim() == 1, name, " must be 1-D, got ", x.sizes());
    TORCH_CHECK_VALUE(x.device() == values[0].device(), name, " is on ", x.device(),
                      ", values on ", values[0].device());
  }
  TORCH_CHECK_VALUE(tables.numel() == slots.numel(), "tables and slots must have one entry per "
                    "unique key, got ", tables.numel(), " and ", slots.numel());
  return g;
}

// table_find_rows: the index's T tables each have a values buffer (as check_gather_values) on
// the index's device; keys and table_ids as the table ops take them.
inline GatherTables check_find_rows(const IndexTensors& ix, at::TensorList values,
                                    const at::Tensor& keys, const at::Tensor& table_ids,
                                    int64_t dim) {
  check_batch(ix, keys, table_ids, std::nullopt, std::nullopt);
  const GatherTables g = check_gather_values(values, dim);
  TORCH_CHECK_VALUE(g.count == ix.num_tables(), "values: ", g.count, " buffers for an index of ",
                    ix.num_tables(), " tables");
  TORCH_CHECK_VALUE(values[0].device() == ix.keys.device(), "values are on ",
                    values[0].device(), ", the index on ", ix.keys.device());
  return g;
}

// table_find_or_insert_rows' gather request: values as check_find_rows takes them (one buffer
// per table, on the index's device) and inverse (N,) int64, checked before the table changes.
inline void check_rows_request(const IndexTensors& ix, at::TensorList values,
                               const at::Tensor& keys, const at::Tensor& table_ids,
                               const at::Tensor& inverse, int64_t dim) {
  check_find_rows(ix, values, keys, table_ids, dim);
  TORCH_CHECK_TYPE(inverse.scalar_type() == at::kLong, "inverse must be int64, got ",
                   inverse.scalar_type());
  TORCH_CHECK_VALUE(inverse.dim() == 1, "inverse must be 1-D, got ", inverse.sizes());
  TORCH_CHECK_VALUE(inverse.device() == ix.keys.device(), "inverse is on ", inverse.device(),
                    ", the index on ", ix.keys.device());
}

// starts (U,) int64 1-D; n >= 0 rows.
inline void check_segment_plan(const at::Tensor& starts, int64_t n) {
  TORCH_CHECK_TYPE(starts.scalar_type() == at::kLong, "starts must be int64, got ",
                   starts.scalar_type());
  TORCH_CHECK_VALUE(starts.dim() == 1, "starts must be 1-D, got ", starts.sizes());
  TORCH_CHECK_VALUE(n >= 0, "n: ", n, " rows; must be >= 0");
}

// An optional (N,) tensor `name` of `dtype` on grads' device: `what` per entry of order.
inline void check_per_entry(const std::optional<at::Tensor>& x, const char* name,
                            at::ScalarType dtype, const char* dtype_name, int64_t n,
                            const char* what, const at::Tensor& grads) {
  if (!x) return;
  TORCH_CHECK_TYPE(x->scalar_type() == dtype, name, " must be ", dtype_name, ", got ",
                   x->scalar_type());
  TORCH_CHECK_VALUE(x->dim() == 1 && x->numel() == n, name, " must be (", n, ",), ", what,
                    " per entry of order; got ", x->sizes());
  TORCH_CHECK_VALUE(x->device() == grads.device(), name, " is on ", x->device(), ", grads on ",
                    grads.device());
}

// Whether `plan` is segment_plan's array for `unique` starts and `n` rows: int64, 1-D, of
// PlanLayout's size, on `device` (check_segment_sum names what is not).
inline bool plan_matches(const at::Tensor& plan, int64_t unique, int64_t n, at::Device device) {
  return plan.scalar_type() == at::kLong && plan.device() == device && plan.dim() == 1 &&
         plan.numel() == PlanLayout{unique, n}.size();
}

// grads (R, D) float32; order (N,) int64; starts (U,) int64; plan, if given, segment_plan's
// int64 array for (U, N); rows, if given, (N,) int64 (else R = N); scale, if given, (N,)
// float32; all on one device.
inline void check_segment_sum(const at::Tensor& grads, const at::Tensor& order,
                              const at::Tensor& starts, const std::optional<at::Tensor>& plan,
                              const std::optional<at::Tensor>& rows,
                              const std::optional<at::Tensor>& scale, bool skip_single) {
  TORCH_CHECK_VALUE(!skip_single || (!rows && !scale),
                    "skip_single: only for unscaled sums (no rows or scale): an update reads a "
                    "skipped key's gradient straight from its grads row");
  TORCH_CHECK_TYPE(grads.scalar_type() == at::kFloat, "grads must be float32, got ",
                   grads.scalar_type());
  TORCH_CHECK_VALUE(grads.dim() == 2, "grads must be (N, D), got ", grads.sizes());
  for (const auto& [name, x] : {std::pair<const char*, const at::Tensor&>{"order", order},
                                {"starts", starts}}) {
    TORCH_CHECK_TYPE(x.scalar_type() == at::kLong, name, " must be int64, got ", x.scalar_type());
    TORCH_CHECK_VALUE(x.dim() == 1, name, " must be 1-D, got ", x.sizes());
    TORCH_CHECK_VALUE(x.device() == grads.device(), name, " is on ", x.device(), ", grads on ",
                      grads.device());
  }
  const int64_t n = order.numel();
  check_per_entry(rows, "rows", at::kLong, "int64", n, "one grads row", grads);
  check_per_entry(scale, "scale", at::kFloat, "float32", n, "one factor", grads);
  TORCH_CHECK_VALUE(rows || n == grads.size(0), "order must have one entry per grads row, got ",
                    n, " for ", grads.size(0));
  if (!plan || plan_matches(*plan, starts.numel(), n, grads.device())) return;
  const PlanLayout lay{starts.numel(), n};
  TORCH_CHECK_TYPE(plan->scalar_type() == at::kLong, "plan must be int64, got ",
                   plan->scalar_type());
  TORCH_CHECK_VALUE(plan->device() == grads.device(), "plan is on ", plan->device(),
                    ", grads on ", grads.device());
  TORCH_CHECK_VALUE(plan->dim() == 1 && plan->numel() == lay.size(), "plan must be (",
                    lay.size(), ",): segment_plan(starts, N) of these ", starts.numel(),
                    " starts and N = ", n, " rows; got ", plan->sizes());
}

// segment_single_rows: order (N,) and starts (U,) int64, 1-D, on one device.
inline void check_single_rows(const at::Tensor& order, const at::Tensor& starts) {
  for (const auto& [name, x] : {std::pair<const char*, const at::Tensor&>{"order", order},
                                {"starts", starts}}) {
    TORCH_CHECK_TYPE(x.scalar_type() == at::kLong, name, " must be int64, got ", x.scalar_type());
    TORCH_CHECK_VALUE(x.dim() == 1, name, " must be 1-D, got ", x.sizes());
  }
  TORCH_CHECK_VALUE(order.device() == starts.device(), "order is on ", order.device(),
                    ", starts on ", starts.device());
}

}  // namespace demb
