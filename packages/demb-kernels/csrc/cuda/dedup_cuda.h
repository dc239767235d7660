// The batch checks of index_tables on CUDA (cuda/dedup_cuda.cu), for ops that check a
// TBE-layout batch themselves.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace demb {

// (kDedupFlags + F + 1,) int64 words on the batch's device (dedup_checks.h's flags, then
// offsets[::B]), queued on the current stream: no sync. Checks the arguments first
// (check_dedup_args).
at::Tensor batch_checks_cuda(const at::Tensor& indices, const at::Tensor& offsets,
                             const at::Tensor& feature_tables, int64_t num_tables,
                             int64_t batch_size);

}  // namespace demb
