// CUDA bindings of gather_table_rows, segment_plan, segment_sum_rows and segment_single_rows:
// the checks of lookup_checks.h, then one launch (gather, single rows), three (the plan: each
// segment's chunk count, their scan, each chunk's rows) or two (the chunk sums, then each long
// segment's chunks in order).
// No sync: the chunk buffers are sized by the bound U + N / kSegmentChunk + 1 on the number of
// chunks.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/EmptyTensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>

#include <cub/device/device_scan.cuh>

#include "cuda/cub_call.cuh"
#include "cuda/lookup_kernels.cuh"
#include "cuda/row_dispatch.cuh"
#include "cuda/segment_finish.cuh"
#include "cuda/segment_sums.h"
#include "cuda/window_sums.cuh"
#include "lookup_checks.h"

namespace demb {
namespace {

unsigned warp_blocks(int64_t warps) {
  return static_cast<unsigned>((warps * cuda::kLookupWarp + cuda::kLookupThreads - 1) /
                               cuda::kLookupThreads);
}

// Warps that take `items` 32 at a time.
int64_t groups(int64_t items) { return (items + cuda::kLookupWarp - 1) / cuda::kLookupWarp; }

void check_sum_sizes(int64_t grad_rows, int64_t n) {
  TORCH_CHECK_VALUE(n < std::numeric_limits<int32_t>::max() &&
                        grad_rows < std::numeric_limits<int32_t>::max(),
                    "grads: ", grad_rows, " rows for ", n,
                    " entries; segment_sum_rows on CUDA takes fewer than 2^31 - 1 of each");
}

at::Tensor gather_table_rows_cuda(at::TensorList values, const at::Tensor& slots_in,
                                  const at::Tensor& tables_in,
                                  const std::optional<at::Tensor>& inverse_in, int64_t dim) {
  const GatherTables g = check_gather_tables(values, slots_in, tables_in, inverse_in, dim);
  const c10::cuda::CUDAGuard guard(values[0].device());
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor tables = tables_in.contiguous();
  const std::optional<at::Tensor> inverse =
      inverse_in ? std::optional<at::Tensor>(inverse_in->contiguous()) : std::nullopt;
  const int64_t n = inverse ? inverse->numel() : slots.numel();
  at::Tensor out = at::empty({n, dim}, slots.options().dtype(at::kFloat));
  if (n == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto dtype = values[0].scalar_type();
  const bool vec4 = float4_rows(g, dtype, dim);
  const int64_t* inv = inverse ? inverse->const_data_ptr<int64_t>() : nullptr;
  // Several rows per warp when a row is one float4 per lane (see kGatherRows).
  const int rows_per_warp = vec4 && dim / 4 <= cuda::kLookupWarp ? cuda::kGatherRows : 1;
  const int64_t warps = (n + rows_per_warp - 1) / rows_per_warp;
  const auto launch = [&](auto zero, auto vec) {
    using T = decltype(zero);
    cuda::gather_table_rows_kernel<T, decltype(vec)::value>
        <<<warp_blocks(warps), cuda::kLookupThreads, 0, stream>>>(
            g, slots.const_data_ptr<int64_t>(), tables.const_data_ptr<int64_t>(), inv,
            slots.numel(), n, dim, rows_per_warp, out.data_ptr<float>());
  };
  cuda::dispatch_row_type(vec4, dtype, launch);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// The chunks of every segment (segment_plan): counts, their scan into chunk offsets, then each
// chunk's rows and destination, in `plan` (laid out as PlanLayout).
void fill_plan(const at::Tensor& starts, int64_t n, at::Tensor& plan, cudaStream_t stream) {
  const int64_t unique = starts.numel();
  const PlanLayout lay{unique, n};
  int64_t* co = plan.data_ptr<int64_t>();
  C10_CUDA_CHECK(cudaMemsetAsync(co, 0, sizeof(int64_t), stream));  // the kernel writes the rest
  if (unique == 0) return;
  const unsigned segment_blocks =
      static_cast<unsigned>((unique + cuda::kLookupThreads - 1) / cuda::kLookupThreads);
  cuda::segment_chunk_counts_kernel<<<segment_blocks, cuda::kLookupThreads, 0, stream>>>(
      starts.const_data_ptr<int64_t>(), unique, n, co);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  cuda::cub_call(starts, [&](void* temp, size_t& bytes) {
    return cub::DeviceScan::InclusiveSum(temp, bytes, co + 1, co + 1, unique, stream);
  });
  const int64_t m = lay.max_chunks();
  cuda::segment_chunks_kernel<<<segment_blocks, cuda::kLookupThreads, 0, stream>>>(
      starts.const_data_ptr<int64_t>(), co, unique, n, m, co + lay.begin(), co + lay.len(),
      co + lay.dest());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor segment_plan_cuda(const at::Tensor& starts_in, int64_t n) {
  check_segment_plan(starts_in, n);
  const c10::cuda::CUDAGuard guard(starts_in.device());
  const at::Tensor starts = starts_in.contiguous();
  at::Tensor plan = at::empty({PlanLayout{starts.numel(), n}.size()}, starts.options());
  fill_plan(starts, n, plan, at::cuda::getCurrentCUDAStream());
  return plan;
}

// The chunk sums and finish pass of segment_sum_rows into `out` ((U, d) float32), NaN/inf
// flagged in `bad`, each segment's single row into `single` when its out is not null: the op's
// launches after its checks (and those of segment_sums_launch). With skip_one_chunk (window sums
// only) the segments of one chunk are not summed: their rows of `out` are left as they are.
// grads (N', d) float32, order (N,) int64, starts (U,) int64 and plan (when given) contiguous.
// By windows when window_sums(grads) (a plan is not needed, nor read), else by the plan's
// chunks (made here when none is given).
void launch_sums(const at::Tensor& grads, const at::Tensor& order, const at::Tensor& starts,
                 const std::optional<at::Tensor>& plan_in, const cuda::RowSource& src,
                 bool scaled, bool skip_single, bool skip_one_chunk, at::Tensor& out,
                 cuda::NonFiniteFlag bad, cuda::SingleRows single, cudaStream_t stream) {
  const int64_t n = order.numel();
  const int64_t d = grads.size(1);
  const int64_t unique = starts.numel();
  if (window_sums(grads)) {
    const int64_t windows = groups(n);
    const at::Tensor partial =
        at::detail::empty_cuda({2 * windows, d}, at::kFloat, grads.device(), std::nullopt);
    const auto launch = [&](auto with_scale) {
      cuda::segment_window_sums_kernel<decltype(with_scale)::value>
          <<<warp_blocks(windows), cuda::kLookupThreads, 0, stream>>>(
              grads.const_data_ptr<float>(), order.const_data_ptr<int64_t>(), src,
              starts.const_data_ptr<int64_t>(), unique, n, d, skip_single, skip_one_chunk,
              partial.data_ptr<float>(), out.data_ptr<float>(), bad);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (scaled) {
      launch(std::true_type{});
    } else {
      launch(std::false_type{});
    }
    const cuda::WindowChunks chunks{starts.const_data_ptr<int64_t>(), unique, n};
    cuda::segment_finish_kernel<true, cuda::WindowChunks>
        <<<warp_blocks(groups(unique)), cuda::kLookupThreads, 0, stream>>>(
            partial.const_data_ptr<float>(), chunks, unique, d, out.data_ptr<float>(), bad,
            single);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  TORCH_CHECK(!skip_one_chunk, "segment sums: skip_one_chunk needs rows of at most ",
              4 * cuda::kLookupWarp, " floats, 16-byte aligned (the window sums)");
  at::Tensor plan;
  if (plan_in) {
    plan = plan_in->contiguous();
  } else {
    plan = at::empty({PlanLayout{unique, n}.size()}, starts.options());
    fill_plan(starts, n, plan, stream);
  }
  const PlanLayout lay{unique, n};
  const int64_t* co = plan.const_data_ptr<int64_t>();
  const int64_t max_chunks = lay.max_chunks();
  const at::Tensor partial =
      at::detail::empty_cuda({max_chunks, d}, at::kFloat, grads.device(), std::nullopt);
  const bool vec4 = d % 4 == 0 && aligned16(grads.const_data_ptr());
  const auto launch = [&](auto vec, auto with_scale) {
    constexpr bool kVec = decltype(vec)::value;
    constexpr bool kScaled = decltype(with_scale)::value;
    cuda::segment_chunk_sums_kernel<kVec, kScaled>
        <<<warp_blocks(max_chunks), cuda::kLookupThreads, 0, stream>>>(
            grads.const_data_ptr<float>(), order.const_data_ptr<int64_t>(), src,
            co + lay.begin(), co + lay.len(), co + lay.dest(), co + unique, d, max_chunks,
            skip_single, partial.data_ptr<float>(), out.data_ptr<float>(), bad);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    cuda::segment_finish_kernel<kVec, cuda::PlanChunks>
        <<<warp_blocks(groups(unique)), cuda::kLookupThreads, 0, stream>>>(
            partial.const_data_ptr<float>(), cuda::PlanChunks{co}, unique, d,
            out.data_ptr<float>(), bad, single);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const auto with_vec = [&](auto with_scale) {
    if (vec4) {
      launch(std::true_type{}, with_scale);
    } else {
      launch(std::false_type{}, with_scale);
    }
  };
  if (scaled) {
    with_vec(std::true_type{});
  } else {
    with_vec(std::false_type{});
  }
}

std::tuple<at::Tensor, at::Tensor> segment_sum_rows_cuda(
    const at::Tensor& grads_in, const at::Tensor& order_in, const at::Tensor& starts_in,
    const std::optional<at::Tensor>& plan_in, const std::optional<at::Tensor>& rows_in,
    const std::optional<at::Tensor>& scale_in, bool skip_single) {
  check_segment_sum(grads_in, order_in, starts_in, plan_in, rows_in, scale_in, skip_single);
  const c10::cuda::CUDAGuard guard(grads_in.device());
  const at::Tensor grads = grads_in.contiguous();
  const at::Tensor order = order_in.contiguous();
  const at::Tensor starts = starts_in.contiguous();
  const at::Tensor rows = rows_in ? rows_in->contiguous() : at::Tensor();
  const at::Tensor scale = scale_in ? scale_in->contiguous() : at::Tensor();
  const int64_t n = order.numel();
  const int64_t d = grads.size(1);
  const int64_t unique = starts.numel();
  check_sum_sizes(grads.size(0), n);
  const bool scaled = rows_in.has_value() || scale_in.has_value();
  const cuda::RowSource src{rows_in ? rows.const_data_ptr<int64_t>() : nullptr,
                            scale_in ? scale.const_data_ptr<float>() : nullptr};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor nonfinite = at::empty({}, grads.options().dtype(at::kBool));  // kernels set true
  C10_CUDA_CHECK(cudaMemsetAsync(nonfinite.data_ptr(), 0, sizeof(bool), stream));
  if (unique == 0 || n == 0 || d == 0) {
    return {at::zeros({unique, d}, grads.options()), nonfinite};
  }
  // Pass 1 or 2 writes every row, but those skip_single skips.
  at::Tensor out = at::empty({unique, d}, grads.options());
  launch_sums(grads, order, starts, plan_in, src, scaled, skip_single, false, out,
              cuda::NonFiniteFlag{nonfinite.data_ptr<bool>(), nullptr},
              cuda::SingleRows{nullptr, nullptr, 0, nullptr}, stream);
  return {out, nonfinite};
}

// segment_single_rows(order, starts) queued on the current stream of starts' device, after the
// op's checks (order (N,) and starts (U,) int64 contiguous on one device): the op's launch, and
// segment_sums_launch's when it has nothing to sum.
at::Tensor single_rows_launch(const at::Tensor& order, const at::Tensor& starts) {
  const c10::cuda::CUDAGuard guard(starts.device());
  const int64_t unique = starts.numel();
  at::Tensor out = at::detail::empty_cuda({unique}, at::kLong, starts.device(), std::nullopt);
  if (unique == 0) return out;
  const unsigned blocks =
      static_cast<unsigned>((unique + cuda::kLookupThreads - 1) / cuda::kLookupThreads);
  const cuda::SingleRows single{order.const_data_ptr<int64_t>(), starts.const_data_ptr<int64_t>(),
                                order.numel(), out.data_ptr<int64_t>()};
  cuda::segment_single_rows_kernel<<<blocks, cuda::kLookupThreads, 0,
                                     at::cuda::getCurrentCUDAStream()>>>(single, unique);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor segment_single_rows_cuda(const at::Tensor& order_in, const at::Tensor& starts_in) {
  check_single_rows(order_in, starts_in);
  return single_rows_launch(order_in.contiguous(), starts_in.contiguous());
}

}  // namespace

bool window_sums(const at::Tensor& grads) {
  const int64_t d = grads.size(1);
  return d % 4 == 0 && d / 4 <= cuda::kLookupWarp && aligned16(grads.const_data_ptr());
}

DirectSums segment_sums_launch(const at::Tensor& grads, const at::Tensor& order,
                               const at::Tensor& starts, const std::optional<at::Tensor>& plan,
                               bool skip_single, bool skip_one_chunk, bool* nonfinite,
                               bool* host_nonfinite) {
  check_sum_sizes(grads.size(0), order.numel());
  const c10::cuda::CUDAGuard guard(grads.device());
  const int64_t unique = starts.numel();
  DirectSums result{at::detail::empty_cuda({unique, grads.size(1)}, at::kFloat, grads.device(),
                                           std::nullopt),
                    at::Tensor()};
  if (unique == 0 || order.numel() == 0 || grads.size(1) == 0) {
    result.sums.zero_();
    if (skip_single && !skip_one_chunk) result.single = single_rows_launch(order, starts);
    return result;
  }
  cuda::SingleRows single{nullptr, nullptr, 0, nullptr};
  if (skip_single && !skip_one_chunk) {
    result.single = at::detail::empty_cuda({unique}, at::kLong, starts.device(), std::nullopt);
    single = cuda::SingleRows{order.const_data_ptr<int64_t>(), starts.const_data_ptr<int64_t>(),
                              order.numel(), result.single.data_ptr<int64_t>()};
  }
  launch_sums(grads, order, starts, plan, cuda::RowSource{nullptr, nullptr}, false, skip_single,
              skip_one_chunk, result.sums, cuda::NonFiniteFlag{nonfinite, host_nonfinite}, single,
              at::cuda::getCurrentCUDAStream());
  return result;
}

at::Tensor zeroed_flag(const at::Tensor& like) {
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor flag = at::detail::empty_cuda({}, at::kBool, like.device(), std::nullopt);
  C10_CUDA_CHECK(
      cudaMemsetAsync(flag.data_ptr(), 0, sizeof(bool), at::cuda::getCurrentCUDAStream()));
  return flag;
}

TORCH_LIBRARY_IMPL(demb, CUDA, m) {
  m.impl("gather_table_rows", &gather_table_rows_cuda);
  m.impl("segment_plan", &segment_plan_cuda);
  m.impl("segment_sum_rows", &segment_sum_rows_cuda);
  m.impl("segment_single_rows", &segment_single_rows_cuda);
}

}  // namespace demb
