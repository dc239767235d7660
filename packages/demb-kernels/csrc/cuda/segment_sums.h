// segment_sum_rows' launches on CUDA without the op's dispatch, checks and flag reset
// (cuda/lookup_cuda.cu), for summed_update's backward: autograd runs it on its device thread,
// whose core is often cold, and every call before the first launch there delays the GPU.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace demb {

// segment_sums_launch's outputs: the (U, D) float32 sums, and with skip_single the (U,) int64
// single rows (segment_single_rows(order, starts), written by the sums' finish pass; undefined
// without skip_single).
struct DirectSums {
  at::Tensor sums;
  at::Tensor single;
};

// Whether segment_sum_rows sums grads (N, D) float32 by windows (segment_window_sums_kernel:
// float4 rows of at most one float4 per lane, 16-byte aligned), which needs no plan.
bool window_sums(const at::Tensor& grads);

// The unscaled sums of segment_sum_rows(grads, order, starts, plan, skip_single=...) into a
// new (U, D) float32 tensor, queued on the current stream of grads' device, a NaN/inf setting
// *nonfinite (zeroed by the caller: zeroed_flag) and, when host_nonfinite is not null, that
// pinned host byte too (zeroed by the caller, mapped into the device's address space: a host
// that synchronizes with an event recorded after this call reads the flag there). The caller
// has checked what the op checks: grads (N, D) float32 contiguous on CUDA, order (N,) and
// starts (U,) int64 contiguous on its device, plan (when given) segment_plan(starts, N),
// contiguous there. Rows of D <= 128 floats (16-byte aligned) are summed by windows and need
// no plan; others are made one when none is given. With skip_one_chunk (window sums only:
// window_sums(grads)) the keys of at most kSegmentChunk entries are neither summed nor checked,
// their rows of `sums` left unwritten, and no single rows are made (the unchecked fused update
// sums those keys itself: summing_update_launch).
DirectSums segment_sums_launch(const at::Tensor& grads, const at::Tensor& order,
                               const at::Tensor& starts, const std::optional<at::Tensor>& plan,
                               bool skip_single, bool skip_one_chunk, bool* nonfinite,
                               bool* host_nonfinite);

// A bool scalar on like's device, zeroed on its current stream (no dispatch: a memset).
at::Tensor zeroed_flag(const at::Tensor& like);

}  // namespace demb
