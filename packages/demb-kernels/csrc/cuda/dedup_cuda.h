// The batch checks of index_tables on CUDA (cuda/dedup_cuda.cu), for ops that check a
// TBE-layout batch themselves, and dedup_launch for ops that start from it.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace demb {

// (kDedupFlags + F + 1,) int64 words on the batch's device (dedup_checks.h's flags, then
// offsets[::B]), queued on the current stream: no sync. Checks the arguments first
// (check_dedup_args).
at::Tensor batch_checks_cuda(const at::Tensor& indices, const at::Tensor& offsets,
                             const at::Tensor& feature_tables, int64_t num_tables,
                             int64_t batch_size);

using LaunchOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                             at::Tensor>;

// dedup_launch (ops.cpp): dedup_batch's outputs at full size and its info words on the device,
// queued on the current stream with no sync.
LaunchOut dedup_launch_cuda(const at::Tensor& indices, const at::Tensor& offsets,
                            const at::Tensor& feature_tables, int64_t num_tables,
                            int64_t batch_size, const std::optional<at::Tensor>& counters,
                            int64_t key_bits);

}  // namespace demb
