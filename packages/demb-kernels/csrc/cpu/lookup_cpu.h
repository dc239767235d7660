// CPU parts shared across files: the gather of a table module step (also the second half of the
// CPU table_find_rows), its gradient sums (also summed_update's CPU backward), and the table of
// each index of a batch and its checks (dedup.cpp).
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

// segment_sum_rows' sums on the CPU into `out`, a float32 CPU tensor resized to (U, d) (its
// storage reused when large enough: a table module's backward keeps one, so that a step does
// not fault in fresh pages for its sums), after the op's checks; `zero_singles`: a one-entry
// segment's row (skip_single) is zeros, else it is left as it was. Returns whether any sum (or
// a skipped one-entry row) is NaN or infinite.
bool sum_segments_into(at::Tensor& out, const at::Tensor& grads, const at::Tensor& order,
                       const at::Tensor& starts, const std::optional<at::Tensor>& plan,
                       const std::optional<at::Tensor>& rows,
                       const std::optional<at::Tensor>& scale, bool skip_single,
                       bool zero_singles);

}  // namespace demb
