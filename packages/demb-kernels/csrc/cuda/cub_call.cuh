// Running cub device algorithms with their scratch memory from torch's caching allocator.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>

#include <cstddef>

namespace demb {
namespace cuda {

// Calls `call(temp, bytes)` twice: once to size its scratch memory, once to do the work.
template <typename Call>
void cub_call(const at::Tensor& like, Call call) {
  size_t bytes = 0;
  C10_CUDA_CHECK(call(nullptr, bytes));
  at::Tensor temp = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  C10_CUDA_CHECK(call(temp.data_ptr(), bytes));
}

// Runs `calls` (each as cub_call's) in order with one scratch buffer, sized for the largest:
// for a chain of cub algorithms whose sizes are known before the first runs.
template <typename... Calls>
void cub_sequence(const at::Tensor& like, Calls... calls) {
  size_t most = 0;
  const auto size = [&](auto& call) {
    size_t bytes = 0;
    C10_CUDA_CHECK(call(nullptr, bytes));
    most = bytes > most ? bytes : most;
  };
  (size(calls), ...);
  at::Tensor temp = at::empty({static_cast<int64_t>(most)}, like.options().dtype(at::kByte));
  const auto run = [&](auto& call) {
    size_t bytes = most;
    C10_CUDA_CHECK(call(temp.data_ptr(), bytes));
  };
  (run(calls), ...);
}

}  // namespace cuda
}  // namespace demb
