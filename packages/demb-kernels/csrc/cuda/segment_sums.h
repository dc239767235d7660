// segment_sum_rows' launches on CUDA without the op's dispatch, checks and flag reset
// (cuda/lookup_cuda.cu), for summed_update's backward: autograd runs it on its device thread,
// whose core is often cold, and every call before the first launch there delays the GPU.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace demb {

// The unscaled sums of segment_sum_rows(grads, order, starts, plan, skip_single=...) into a
// new (U, D) float32 tensor, queued on the current stream of grads' device, a NaN/inf setting
// *nonfinite (zeroed by the caller: zeroed_flag). The caller has checked what the op checks:
// grads (N, D) float32 contiguous on CUDA, order (N,) and starts (U,) int64 contiguous on its
// device, plan (when given) segment_plan(starts, N), contiguous there. Rows of D <= 128 floats
// (16-byte aligned) are summed by windows and need no plan; others are made one when none is
// given.
at::Tensor segment_sums_launch(const at::Tensor& grads, const at::Tensor& order,
                               const at::Tensor& starts, const std::optional<at::Tensor>& plan,
                               bool skip_single, bool* nonfinite);

// segment_single_rows(order, starts) queued on the current stream of starts' device, without
// the op's dispatch and checks (the caller has made the same checks: order (N,) and starts
// (U,) int64 contiguous on one device).
at::Tensor single_rows_launch(const at::Tensor& order, const at::Tensor& starts);

// A bool scalar on like's device, zeroed on its current stream (no dispatch: a memset).
at::Tensor zeroed_flag(const at::Tensor& like);

}  // namespace demb
