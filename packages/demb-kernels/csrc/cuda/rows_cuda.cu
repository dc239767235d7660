// CUDA bindings of the value-row ops: the copy unit is the widest of 16/8/4/2/1 bytes that
// divides a row and the buffers' alignment.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/rows_kernels.cuh"
#include "rows_checks.h"

namespace demb {
namespace {

// Calls fn(U{}) with the unsigned type of `unit` bytes.
template <typename Fn>
void with_unit(int64_t unit, Fn fn) {
  switch (unit) {
    case 16: fn(uint4{}); break;
    case 8: fn(uint2{}); break;
    case 4: fn(uint32_t{}); break;
    case 2: fn(uint16_t{}); break;
    default: fn(uint8_t{}); break;
  }
}

at::Tensor gather_rows_cuda(const at::Tensor& values, const at::Tensor& slots_in) {
  check_rows_args(values, slots_in);
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor slots = slots_in.contiguous();
  const int64_t n = slots.numel();
  at::Tensor out = at::empty({n, values.size(1)}, values.options());
  const int64_t row_bytes = values.size(1) * values.element_size();
  if (n == 0 || row_bytes == 0) return out;
  const int64_t unit = copy_unit(row_bytes, values.const_data_ptr(), out.const_data_ptr());
  const cuda::RowGrid grid = cuda::row_grid(n, row_bytes / unit);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  with_unit(unit, [&](auto zero) {
    using U = decltype(zero);
    const auto blocks = static_cast<unsigned>(grid.blocks);
    cuda::gather_rows_kernel<U><<<blocks, cuda::kRowThreads, 0, stream>>>(
        static_cast<const U*>(values.const_data_ptr()), values.size(0),
        slots.const_data_ptr<int64_t>(), n, row_bytes / unit, grid.rows_per_block,
        static_cast<U*>(out.data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

void scatter_rows_cuda(at::Tensor values, const at::Tensor& slots_in, const at::Tensor& rows_in) {
  check_scatter_rows(values, slots_in, rows_in);
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor rows = rows_in.contiguous();
  const int64_t n = slots.numel();
  const int64_t row_bytes = values.size(1) * values.element_size();
  if (n == 0 || row_bytes == 0) return;
  const int64_t unit = copy_unit(row_bytes, values.const_data_ptr(), rows.const_data_ptr());
  const cuda::RowGrid grid = cuda::row_grid(n, row_bytes / unit);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  with_unit(unit, [&](auto zero) {
    using U = decltype(zero);
    const auto blocks = static_cast<unsigned>(grid.blocks);
    cuda::scatter_rows_kernel<U><<<blocks, cuda::kRowThreads, 0, stream>>>(
        static_cast<U*>(values.data_ptr()), values.size(0), slots.const_data_ptr<int64_t>(), n,
        row_bytes / unit, grid.rows_per_block, static_cast<const U*>(rows.const_data_ptr()));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) {
  m.impl("gather_rows", &gather_rows_cuda);
  m.impl("scatter_rows", &scatter_rows_cuda);
}

}  // namespace demb
