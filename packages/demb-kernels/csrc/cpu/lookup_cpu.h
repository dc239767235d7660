// CPU parts shared across files: the gather of a table module step (also the second half of the
// CPU table_find_rows), and the table of each index of a batch and its checks (dedup.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace demb {

// gather_table_rows on the CPU (lookup_rule.h): checks every slot, table and inverse entry.
at::Tensor gather_table_rows_cpu(at::TensorList values, const at::Tensor& slots,
                                 const at::Tensor& tables,
                                 const std::optional<at::Tensor>& inverse, int64_t dim);

// (N,) int64 table of each index of a TBE-layout batch: feature f owns [offsets[f * B],
// offsets[(f + 1) * B]) (the last feature whose first bag starts at or before the index;
// feature 0 if none).
at::Tensor table_of_index(const at::Tensor& offsets, const at::Tensor& feature_tables,
                          int64_t batch_size, int64_t n);

// The checks of a TBE-layout batch (dedup.cpp): (kDedupFlags + F + 1,) int64, the flags of
// dedup_checks.h, then offsets[::B]. Its arguments are checked by check_dedup_args first.
at::Tensor batch_checks_cpu(const at::Tensor& indices, const at::Tensor& offsets,
                            const at::Tensor& feature_tables, int64_t num_tables,
                            int64_t batch_size, const std::optional<at::Tensor>& counters);

}  // namespace demb
