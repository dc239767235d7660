// Running a cub device algorithm with its scratch memory from torch's caching allocator.
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

}  // namespace cuda
}  // namespace demb
