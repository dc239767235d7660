// The unchecked fused update of summed_update's CUDA backward (summing_update.cuh) without the
// op's dispatch: autograd runs the backward on its device thread, and each call there before a
// launch can leave the GPU idle.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/string_view.h>

#include <cstdint>

namespace demb {

// Whether summing_update_launch takes an update of these tables from gradient rows `grads`:
// float32 tables, each of the gradients' width, float4 rows (width and dim multiples of 4,
// 16-byte aligned), and gradients the window sums take (window_sums: at most 128 floats).
bool summing_update_fits(at::TensorList values, at::IntArrayRef dims, const at::Tensor& grads);

// optimizer_update(values, slots, sums, dims, steps, optimizer, *hyper), queued on the current
// stream of grads' device, with each unique key's gradient summed in the update when the key
// has at most kSegmentChunk entries (its rows of `sums` are not read; a long key's are: the
// window sums with skip_one_chunk wrote them), after optimizer_update's checks of the tables.
// Unique key u of the whole update (table by table, as `slots` and `sums` are split) has the
// gradient rows order[starts[u]] .. of grads (N, D) float32; order (N,) and starts (U,) int64
// contiguous on grads' device, as the dedup made them (unchecked). hyper: optimizer_update's
// nine floats in its order. Raises before any launch when summing_update_fits is false.
void summing_update_launch(at::TensorList values, at::TensorList slots, at::TensorList sums,
                           at::IntArrayRef dims, at::IntArrayRef steps,
                           c10::string_view optimizer, at::ArrayRef<double> hyper,
                           const at::Tensor& grads, const at::Tensor& order,
                           const at::Tensor& starts);

}  // namespace demb
