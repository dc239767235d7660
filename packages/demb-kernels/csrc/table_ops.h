// The table ops that the CPU and CUDA bindings share above their own kernels: the argument
// checks, then the device's part, a template argument.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <optional>
#include <tuple>

#include "gather_call.h"
#include "lookup_checks.h"
#include "table_checks.h"

namespace demb {

using InsertOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// find_or_insert's: InsertOutputs and a CPU bool, whether every key was found (all HIT).
using FoundOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// find_or_insert_rows': FoundOutputs and the rows of the N occurrences (else (0, dim)).
using RowsOutputs =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// Work queued on the lookup phase's slots, kept only when every key was found.
using Speculate = std::function<void(const at::Tensor&)>;

// table_lookup for every device: the checks, then `Lookup`, the device's kernel, given (ix, keys,
// table_ids, score_args, counts).
template <auto Lookup>
at::Tensor table_lookup_op(const at::Tensor& index_keys, const at::Tensor& digests,
                           const at::Tensor& scores, const at::Tensor& slot_offsets,
                           const at::Tensor& bucket_widths, const at::Tensor& policies,
                           const at::Tensor& keys, const at::Tensor& table_ids,
                           const std::optional<at::Tensor>& score_args,
                           const std::optional<at::Tensor>& counts) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  check_batch(ix, keys, table_ids, score_args, counts);
  return Lookup(ix, keys, table_ids, score_args, counts);
}

// find_or_insert, find_or_insert_rows and insert_or_assign, over `Bucket`, the device's
// find_or_insert (kInsert) / insert_or_assign (kAssign):
//   InsertOutputs Bucket(const IndexTensors& ix, at::Tensor& sizes, BucketOp op,
//                        const at::Tensor& keys, const at::Tensor& table_ids,
//                        const std::optional<at::Tensor>& score_args,
//                        const std::optional<at::Tensor>& counts,
//                        const std::optional<at::Tensor>& assign, bool* all_hit,
//                        const Speculate& speculate)
// The index's victim ranks (checked_index with ranks) are in `ix`; the views the kernels make of
// it (make_view) rank the victims of the tables flagged.
// For kInsert, *all_hit tells whether the lookup phase found every key, and `speculate`
// (given its slots) is called at most once: on the CPU when every key was found, on CUDA
// before the host knows (then all_hit tells whether its work is right). A null all_hit
// (find_or_insert's wait=false): on CUDA the host does not wait for the flag and phase B always
// runs (all_hit reads false).
template <auto Bucket>
struct TableOps {
  static FoundOutputs find_or_insert(const at::Tensor& index_keys, const at::Tensor& digests,
                                     const at::Tensor& scores, const at::Tensor& slot_offsets,
                                     const at::Tensor& bucket_widths, const at::Tensor& policies,
                                     at::Tensor sizes, const at::Tensor& keys,
                                     const at::Tensor& table_ids, const at::Tensor& score_args,
                                     const std::optional<at::Tensor>& counts,
                                     const std::optional<at::Tensor>& victim_rank,
                                     const std::optional<at::Tensor>& ranked, bool wait) {
    const IndexTensors ix = checked_index(index_keys, digests, scores, slot_offsets,
                                          bucket_widths, policies, victim_rank, ranked);
    bool all_hit = false;
    const auto [slots, status, victim_keys, victim_scores] =
        Bucket(ix, sizes, BucketOp::kInsert, keys, table_ids, score_args, counts, std::nullopt,
               wait ? &all_hit : nullptr, Speculate());
    return {slots, status, victim_keys, victim_scores, at::scalar_tensor(all_hit, at::kBool)};
  }

  // The gather's request is checked before the table changes.
  static RowsOutputs find_or_insert_rows(
      const at::Tensor& index_keys, const at::Tensor& digests, const at::Tensor& scores,
      const at::Tensor& slot_offsets, const at::Tensor& bucket_widths, const at::Tensor& policies,
      at::Tensor sizes, const at::Tensor& keys, const at::Tensor& table_ids,
      const at::Tensor& score_args, const std::optional<at::Tensor>& counts,
      at::TensorList values, const at::Tensor& inverse, int64_t dim,
      const std::optional<at::Tensor>& victim_rank, const std::optional<at::Tensor>& ranked) {
    const IndexTensors ix = checked_index(index_keys, digests, scores, slot_offsets,
                                          bucket_widths, policies, victim_rank, ranked);
    check_rows_request(ix, values, keys, table_ids, inverse, dim);
    bool all_hit = false;
    at::Tensor rows;
    const Speculate gather = [&](const at::Tensor& slots) {
      rows = call_gather_table_rows(values, slots, table_ids, inverse, dim);
    };
    const auto [slots, status, victim_keys, victim_scores] =
        Bucket(ix, sizes, BucketOp::kInsert, keys, table_ids, score_args, counts, std::nullopt,
               &all_hit, gather);
    if (!all_hit || !rows.defined()) rows = at::empty({0, dim}, keys.options().dtype(at::kFloat));
    return {slots, status, victim_keys, victim_scores, at::scalar_tensor(all_hit, at::kBool), rows};
  }

  static InsertOutputs insert_or_assign(const at::Tensor& index_keys, const at::Tensor& digests,
                                        const at::Tensor& scores, const at::Tensor& slot_offsets,
                                        const at::Tensor& bucket_widths,
                                        const at::Tensor& policies, at::Tensor sizes,
                                        const at::Tensor& keys, const at::Tensor& table_ids,
                                        const at::Tensor& assign_scores,
                                        const std::optional<at::Tensor>& victim_rank,
                                        const std::optional<at::Tensor>& ranked) {
    const IndexTensors ix = checked_index(index_keys, digests, scores, slot_offsets,
                                          bucket_widths, policies, victim_rank, ranked);
    check_assign_scores(ix, assign_scores, keys);
    return Bucket(ix, sizes, BucketOp::kAssign, keys, table_ids, std::nullopt, std::nullopt,
                  assign_scores, nullptr, Speculate());
  }
};

// table_find_rows for every device: the checks, then `Find`, the device's lookup (no score
// touched) and gather of the rows:
//   std::tuple<at::Tensor, at::Tensor> Find(const IndexTensors& ix, const GatherTables& g,
//                                           at::TensorList values, const at::Tensor& keys,
//                                           const at::Tensor& table_ids, int64_t dim)
template <auto Find>
std::tuple<at::Tensor, at::Tensor> table_find_rows_op(
    const at::Tensor& index_keys, const at::Tensor& digests, const at::Tensor& scores,
    const at::Tensor& slot_offsets, const at::Tensor& bucket_widths, const at::Tensor& policies,
    at::TensorList values, const at::Tensor& keys, const at::Tensor& table_ids, int64_t dim) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  const GatherTables g = check_find_rows(ix, values, keys, table_ids, dim);
  return Find(ix, g, values, keys, table_ids, dim);
}

}  // namespace demb
