// Argument checks of the table ops, shared by the CPU and CUDA bindings: everything that needs
// no look at the data (dtypes, shapes, devices). The CPU binding also checks the data (free
// there); on CUDA the kernels skip invalid entries safely and the Python wrappers check the
// data with one synchronizing reduction (demb_kernels.table).
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "table_rule.h"

namespace demb {

// The index tensors of docs/hash_table.md, checked against each other. `scores` is (W, S).
struct IndexTensors {
  at::Tensor keys;           // int64 (S,)
  at::Tensor digests;        // uint8 (S,)
  at::Tensor scores;         // int64 (W, S)
  at::Tensor slot_offsets;   // int64 (T + 1,)
  at::Tensor bucket_widths;  // int64 (T,)
  at::Tensor policies;       // int64 (T,)
  // Victim ranks of the inserting ops (checked_index with ranks), both undefined when no table
  // ranks its victims: int64 (S,) per-slot ranks and int64 (T,) per-table flags.
  at::Tensor victim_rank;
  at::Tensor ranked;

  int64_t num_slots() const { return keys.numel(); }
  int64_t num_tables() const { return bucket_widths.numel(); }
  int64_t score_words() const { return scores.size(0); }
};

inline void check_index_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype,
                               const at::Tensor& like) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "index tensor ", name, " must be ", dtype,
                   ", got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.is_contiguous(), "index tensor ", name, " must be contiguous");
  TORCH_CHECK_VALUE(t.device() == like.device(), "index tensor ", name, " is on ", t.device(),
                    ", the index keys on ", like.device());
}

inline void check_index(const IndexTensors& ix) {
  check_index_tensor(ix.keys, "keys", at::kLong, ix.keys);
  check_index_tensor(ix.digests, "digests", at::kByte, ix.keys);
  check_index_tensor(ix.scores, "scores", at::kLong, ix.keys);
  check_index_tensor(ix.slot_offsets, "slot_offsets", at::kLong, ix.keys);
  check_index_tensor(ix.bucket_widths, "bucket_widths", at::kLong, ix.keys);
  check_index_tensor(ix.policies, "policies", at::kLong, ix.keys);
  const int64_t s = ix.keys.numel();
  TORCH_CHECK_VALUE(ix.keys.dim() == 1 && ix.digests.dim() == 1 && ix.digests.numel() == s,
                    "index keys and digests must be 1-D of the same length");
  TORCH_CHECK_VALUE(ix.scores.dim() == 2 && ix.scores.size(1) == s &&
                        (ix.scores.size(0) == 1 || ix.scores.size(0) == 2),
                    "index scores must be (W, S) with W = 1 or 2, got ", ix.scores.sizes());
  const int64_t t = ix.bucket_widths.numel();
  TORCH_CHECK_VALUE(t >= 1 && ix.policies.numel() == t && ix.slot_offsets.numel() == t + 1,
                    "index needs T >= 1 tables: bucket_widths (T,), policies (T,), "
                    "slot_offsets (T + 1,)");
}

// The index tensors of an op's arguments, checked.
inline IndexTensors checked_index(const at::Tensor& keys, const at::Tensor& digests,
                                  const at::Tensor& scores, const at::Tensor& slot_offsets,
                                  const at::Tensor& bucket_widths, const at::Tensor& policies) {
  IndexTensors ix{keys, digests, scores, slot_offsets, bucket_widths, policies, {}, {}};
  check_index(ix);
  return ix;
}

// The index of an inserting op (find_or_insert, insert_or_assign) with its optional victim
// ranks: `victim_rank` int64 (S,) per-slot ranks and `ranked` int64 (T,) per-table flags
// (nonzero: table t picks victims by the ranks), each absent or empty when no table ranks its
// victims. Ranks of (0,) with some table flagged is an error the CPU kernels raise; on CUDA
// (where the flags are on the device) such a table compares its score words instead, never
// reading past the ranks (the Python wrappers check the flags on the host).
inline IndexTensors checked_index(const at::Tensor& keys, const at::Tensor& digests,
                                  const at::Tensor& scores, const at::Tensor& slot_offsets,
                                  const at::Tensor& bucket_widths, const at::Tensor& policies,
                                  const std::optional<at::Tensor>& victim_rank,
                                  const std::optional<at::Tensor>& ranked) {
  IndexTensors ix = checked_index(keys, digests, scores, slot_offsets, bucket_widths, policies);
  const bool has_rank = victim_rank.has_value() && victim_rank->numel() > 0;
  const bool has_flags = ranked.has_value() && ranked->numel() > 0;
  if (victim_rank.has_value()) {
    check_index_tensor(*victim_rank, "victim_rank", at::kLong, ix.keys);
    const bool sized = !has_rank || victim_rank->numel() == ix.num_slots();
    TORCH_CHECK_VALUE(victim_rank->dim() == 1 && sized, "victim_rank must be (S,) = (",
                      ix.num_slots(),
                      ",) int64, or (0,) when no table ranks its victims; got ",
                      victim_rank->sizes());
  }
  if (ranked.has_value()) {
    check_index_tensor(*ranked, "ranked", at::kLong, ix.keys);
    TORCH_CHECK_VALUE(ranked->dim() == 1 && (!has_flags || ranked->numel() == ix.num_tables()),
                      "ranked must be (T,) = (", ix.num_tables(),
                      ",) int64, or (0,) when no table ranks its victims; got ", ranked->sizes());
  }
  if (has_flags && ranked->device().is_cpu()) {
    const int64_t* flags = ranked->const_data_ptr<int64_t>();
    for (int64_t t = 0; t < ix.num_tables(); ++t) {
      TORCH_CHECK_VALUE(flags[t] == 0 || has_rank, "table ", t,
                        " ranks its victims (ranked[", t, "] != 0) but victim_rank is empty: ",
                        "it must be (S,) = (", ix.num_slots(), ",)");
    }
  }
  if (has_rank && has_flags) {
    ix.victim_rank = *victim_rank;
    ix.ranked = *ranked;
  }
  return ix;
}

// The raw view of a checked index; `sizes` (T,) int64 when the op changes them.
inline TableView make_view(const IndexTensors& ix, at::Tensor* sizes) {
  const bool ranks = ix.victim_rank.defined() && ix.ranked.defined();
  return TableView{ix.keys.data_ptr<int64_t>(),
                   ix.digests.data_ptr<uint8_t>(),
                   ix.scores.data_ptr<int64_t>(),
                   ix.num_slots(),
                   ix.score_words(),
                   ix.slot_offsets.const_data_ptr<int64_t>(),
                   ix.bucket_widths.const_data_ptr<int64_t>(),
                   ix.policies.const_data_ptr<int64_t>(),
                   ix.num_tables(),
                   sizes ? sizes->data_ptr<int64_t>() : nullptr,
                   ranks ? ix.victim_rank.const_data_ptr<int64_t>() : nullptr,
                   ranks ? ix.ranked.const_data_ptr<int64_t>() : nullptr};
}

// Checks of a batch: keys (N,) int64 and table_ids (N,) int64 on the index's device, plus the
// optional per-table score_args (T,) and per-key counts (N,).
inline void check_batch(const IndexTensors& ix, const at::Tensor& keys,
                        const at::Tensor& table_ids, const std::optional<at::Tensor>& score_args,
                        const std::optional<at::Tensor>& counts) {
  TORCH_CHECK_TYPE(keys.scalar_type() == at::kLong, "keys must be int64, got ",
                   keys.scalar_type());
  TORCH_CHECK_TYPE(table_ids.scalar_type() == at::kLong, "table_ids must be int64, got ",
                   table_ids.scalar_type());
  TORCH_CHECK_VALUE(keys.dim() == 1 && table_ids.dim() == 1 && keys.numel() == table_ids.numel(),
                    "keys and table_ids must be 1-D of the same length, got ", keys.sizes(),
                    " and ", table_ids.sizes());
  TORCH_CHECK_VALUE(keys.numel() < INT32_MAX,
                    "batches of 2**31 - 1 keys or more are not supported");
  TORCH_CHECK_VALUE(keys.device() == ix.keys.device() && table_ids.device() == ix.keys.device(),
                    "keys and table_ids must be on the index's device ", ix.keys.device());
  if (score_args.has_value()) {
    TORCH_CHECK_TYPE(score_args->scalar_type() == at::kLong, "score_args must be int64");
    TORCH_CHECK_VALUE(score_args->dim() == 1 && score_args->numel() == ix.num_tables(),
                      "score_args must be (T,) = (", ix.num_tables(), ",), got ",
                      score_args->sizes());
    TORCH_CHECK_VALUE(score_args->device() == ix.keys.device(),
                      "score_args must be on the index's device");
  }
  if (counts.has_value()) {
    TORCH_CHECK_TYPE(counts->scalar_type() == at::kLong, "counts must be int64");
    TORCH_CHECK_VALUE(counts->dim() == 1 && counts->numel() == keys.numel(),
                      "counts must be (N,) like keys, got ", counts->sizes());
    TORCH_CHECK_VALUE(counts->device() == ix.keys.device(),
                      "counts must be on the index's device");
  }
}

inline void check_assign_scores(const IndexTensors& ix, const at::Tensor& scores,
                                const at::Tensor& keys) {
  TORCH_CHECK_TYPE(scores.scalar_type() == at::kLong, "scores must be int64, got ",
                   scores.scalar_type());
  TORCH_CHECK_VALUE(scores.dim() == 2 && scores.size(0) == ix.score_words() &&
                        scores.size(1) == keys.numel(),
                    "scores must be (W, N) = (", ix.score_words(), ", ", keys.numel(),
                    "), got ", scores.sizes());
  TORCH_CHECK_VALUE(scores.device() == ix.keys.device(), "scores must be on the index's device");
}

}  // namespace demb
