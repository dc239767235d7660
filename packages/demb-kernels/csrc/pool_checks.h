// Argument checks of pool_table_rows (a pooled lookup's bags summed straight from the tables'
// rows by slot), shared by the CPU and CUDA bindings, and the rule both kernels follow.
//
// out[b, f * dim + c] = sum over i in [offsets[f * B + b], offsets[f * B + b + 1]), in order of
// i, of values[feature_tables[f]][slots[i], c] (times weights[i] when given: the product, then
// the sum); a slot of -1 adds nothing. With `mean`, that sum divided by the bag's length
// (missing keys included); an empty bag is zeros. Sums start at 0.0f and add one row at a time.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "lookup_checks.h"

namespace demb {

// The bags' layout (F features of B bags each, over N slots) and the tables' pointers.
struct PoolShape {
  GatherTables tables;
  int64_t features;
  int64_t batch_size;
  int64_t n;
};

// values: T <= 64 contiguous float32 (R_t, W_t >= dim); slots (N,) int64; offsets (F * B + 1,)
// int64; feature_tables (F,) int64; weights, if given, (N,) float32; all on one device. Values
// (slot ranges, offsets' order, feature tables' range) are the kernels' to check.
inline PoolShape check_pool_args(at::TensorList values, const at::Tensor& slots,
                                 const at::Tensor& offsets, const at::Tensor& feature_tables,
                                 int64_t batch_size, int64_t dim,
                                 const std::optional<at::Tensor>& weights) {
  const GatherTables g = check_gather_values(values, dim);
  TORCH_CHECK_TYPE(values[0].scalar_type() == at::kFloat, "values must be float32, got ",
                   values[0].scalar_type(), " (pool_table_rows pools float32 rows only)");
  for (const auto& [name, x] : {std::pair<const char*, const at::Tensor&>{"slots", slots},
                                {"offsets", offsets},
                                {"feature_tables", feature_tables}}) {
    TORCH_CHECK_TYPE(x.scalar_type() == at::kLong, name, " must be int64, got ", x.scalar_type());
    TORCH_CHECK_VALUE(x.dim() == 1, name, " must be 1-D, got shape ", x.sizes());
    TORCH_CHECK_VALUE(x.device() == values[0].device(), name, " is on ", x.device(),
                      ", values on ", values[0].device());
  }
  TORCH_CHECK_VALUE(batch_size >= 1, "batch_size=", batch_size, ": must be >= 1");
  const int64_t features = feature_tables.numel();
  TORCH_CHECK_VALUE(offsets.numel() == features * batch_size + 1, "offsets: ", offsets.numel(),
                    " entries for ", features, " features (feature_tables) of ", batch_size,
                    " bags; expected ", features * batch_size + 1);
  if (weights) {
    TORCH_CHECK_TYPE(weights->scalar_type() == at::kFloat, "weights must be float32, got ",
                     weights->scalar_type());
    TORCH_CHECK_VALUE(weights->dim() == 1 && weights->numel() == slots.numel(),
                      "weights must be (", slots.numel(), ",): one per slot; got ",
                      weights->sizes());
    TORCH_CHECK_VALUE(weights->device() == values[0].device(), "weights is on ",
                      weights->device(), ", values on ", values[0].device());
  }
  return PoolShape{g, features, batch_size, slots.numel()};
}

}  // namespace demb
