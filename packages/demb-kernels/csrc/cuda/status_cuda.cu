// status_counts on CUDA: per table, a batch's new rows and FAILED keys (one block per table),
// the counts left on the device.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cub/block/block_reduce.cuh>

#include "dedup_checks.h"
#include "table_rule.h"

namespace demb {
namespace {

constexpr int kStatusTables = 64;  // tables one status_counts launch takes
constexpr int kStatusThreads = 1024;

struct StatusBounds {
  int64_t at[kStatusTables + 1];
};

// Block t counts its table's new rows (low 32 bits) and FAILED keys (high 32 bits) into
// out[first + t] and out[tables + first + t].
__global__ void __launch_bounds__(kStatusThreads)
    status_counts_kernel(const int64_t* __restrict__ status, StatusBounds b, int64_t first,
                         int64_t tables, int64_t* __restrict__ out) {
  const int64_t t = blockIdx.x;
  int64_t packed = 0;
  for (int64_t i = b.at[t] + threadIdx.x; i < b.at[t + 1]; i += kStatusThreads) {
    const auto code = static_cast<InsertStatus>(status[i]);
    packed += (code == InsertStatus::kInserted || code == InsertStatus::kEvicted) ? 1 : 0;
    packed += code == InsertStatus::kFailed ? (int64_t{1} << 32) : 0;
  }
  using Reduce = cub::BlockReduce<int64_t, kStatusThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const int64_t total = Reduce(temp).Sum(packed);
  if (threadIdx.x == 0) {
    out[first + t] = total & 0xFFFFFFFFll;
    out[tables + first + t] = total >> 32;
  }
}

// status_counts: one block per table (kStatusTables tables a launch); the counts stay on the
// device (the caller reads them back when it needs them on the host).
at::Tensor status_counts_cuda(const at::Tensor& status_in, at::IntArrayRef bounds) {
  check_status_counts(status_in, bounds);
  const c10::cuda::CUDAGuard guard(status_in.device());
  const at::Tensor status = status_in.contiguous();
  const auto tables = static_cast<int64_t>(bounds.size()) - 1;
  at::Tensor counts = at::empty({2, tables}, status.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t first = 0; first < tables; first += kStatusTables) {
    const int64_t count = std::min<int64_t>(kStatusTables, tables - first);
    StatusBounds b{};
    for (int64_t t = 0; t <= count; ++t) b.at[t] = bounds[first + t];
    status_counts_kernel<<<static_cast<unsigned>(count), kStatusThreads, 0, stream>>>(
        status.const_data_ptr<int64_t>(), b, first, tables, counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) { m.impl("status_counts", &status_counts_cuda); }

}  // namespace demb
