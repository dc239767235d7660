// CUDA bindings of the table ops: allocation, validation and launch order. The algorithm is the
// CPU one (cpu/table_cpu.cpp): phase A per key, a stable sort of the batch by bucket, phase B
// per bucket in batch order; identical results.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>

#include "cuda/cub_call.cuh"
#include "cuda/table_bucket.cuh"
#include "cuda/table_kernels.cuh"
#include "table_checks.h"

namespace demb {
namespace {

using cuda::cub_call;

constexpr int kThreads = cuda::kWarp * cuda::kWarpsPerBlock;

unsigned blocks_for(int64_t n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

const int64_t* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<int64_t>() : nullptr;
}

at::Tensor contiguous_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

// Number of bits of the largest sort key (`skip`): the radix sort's end bit.
int end_bit_for(uint64_t skip) {
  int bits = 1;
  while (bits < 64 && (skip >> bits) != 0) ++bits;
  return bits;
}

// The phase-B schedule: entries stably sorted by sort key (bucket order, batch order within a
// bucket), cut into runs of equal keys. The tensors back the pointers of `runs`.
struct Schedule {
  at::Tensor positions, run_keys, run_offsets, run_lengths, run_count;
  cuda::Runs runs() const {
    return cuda::Runs{reinterpret_cast<const uint64_t*>(run_keys.const_data_ptr<int64_t>()),
                      run_offsets.const_data_ptr<int32_t>(), run_lengths.const_data_ptr<int32_t>(),
                      run_count.const_data_ptr<int32_t>(), positions.const_data_ptr<int32_t>()};
  }
};

Schedule schedule(const at::Tensor& sort_keys, uint64_t skip, cudaStream_t stream) {
  const int64_t n = sort_keys.numel();
  const auto n32 = static_cast<int>(n);
  const at::Tensor order = at::arange(n, sort_keys.options().dtype(at::kInt));
  Schedule out;
  out.positions = at::empty_like(order);
  at::Tensor sorted = at::empty_like(sort_keys);
  const auto* k_in = reinterpret_cast<const uint64_t*>(sort_keys.const_data_ptr<int64_t>());
  auto* k_out = reinterpret_cast<uint64_t*>(sorted.data_ptr<int64_t>());
  const int end_bit = end_bit_for(skip);
  cub_call(sort_keys, [&](void* temp, size_t& bytes) {
    return cub::DeviceRadixSort::SortPairs(temp, bytes, k_in, k_out,
                                           order.const_data_ptr<int32_t>(),
                                           out.positions.data_ptr<int32_t>(), n32, 0, end_bit,
                                           stream);
  });
  out.run_keys = at::empty_like(sort_keys);
  out.run_lengths = at::zeros({n}, order.options());
  out.run_count = at::empty({1}, order.options());
  auto* unique = reinterpret_cast<uint64_t*>(out.run_keys.data_ptr<int64_t>());
  cub_call(sort_keys, [&](void* temp, size_t& bytes) {
    return cub::DeviceRunLengthEncode::Encode(temp, bytes, k_out, unique,
                                              out.run_lengths.data_ptr<int32_t>(),
                                              out.run_count.data_ptr<int32_t>(), n32, stream);
  });
  out.run_offsets = at::empty_like(out.run_lengths);
  cub_call(sort_keys, [&](void* temp, size_t& bytes) {
    return cub::DeviceScan::ExclusiveSum(temp, bytes, out.run_lengths.const_data_ptr<int32_t>(),
                                         out.run_offsets.data_ptr<int32_t>(), n32, stream);
  });
  return out;
}

at::Tensor table_lookup_cuda(const at::Tensor& index_keys, const at::Tensor& digests,
                             const at::Tensor& scores, const at::Tensor& slot_offsets,
                             const at::Tensor& bucket_widths, const at::Tensor& policies,
                             const at::Tensor& keys_in, const at::Tensor& table_ids_in,
                             const std::optional<at::Tensor>& score_args,
                             const std::optional<at::Tensor>& counts_in) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  check_batch(ix, keys_in, table_ids_in, score_args, counts_in);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor table_ids = table_ids_in.contiguous();
  const at::Tensor counts = contiguous_or_undefined(counts_in);
  const at::Tensor args = contiguous_or_undefined(score_args);
  const int64_t n = keys.numel();
  at::Tensor slots = at::empty({n}, keys.options());
  if (n == 0) return slots;
  const cuda::BatchIn in{keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(),
                         ptr_or_null(args), ptr_or_null(counts), nullptr, n};
  const cuda::BatchOut out{slots.data_ptr<int64_t>(), nullptr, nullptr, nullptr};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  cuda::lookup_kernel<<<cuda::blocks_for_tiles(n), kThreads, 0, stream>>>(
      make_view(ix, nullptr), in, out, nullptr, 0);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return slots;
}

using InsertOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// find_or_insert (kInsert), insert_or_assign (kAssign) and erase (kErase).
InsertOutputs bucket_op_cuda(const IndexTensors& ix, at::Tensor& sizes, BucketOp op,
                             const at::Tensor& keys_in, const at::Tensor& table_ids_in,
                             const std::optional<at::Tensor>& score_args,
                             const std::optional<at::Tensor>& counts_in,
                             const std::optional<at::Tensor>& assign_in) {
  check_batch(ix, keys_in, table_ids_in, score_args, counts_in);
  check_index_tensor(sizes, "sizes", at::kLong, ix.keys);
  TORCH_CHECK_VALUE(sizes.numel() == ix.num_tables(), "index sizes must be (T,)");
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor table_ids = table_ids_in.contiguous();
  const at::Tensor counts = contiguous_or_undefined(counts_in);
  const at::Tensor args = contiguous_or_undefined(score_args);
  const at::Tensor assign = contiguous_or_undefined(assign_in);
  const int64_t n = keys.numel();
  const bool inserts = op != BucketOp::kErase;
  at::Tensor slots = at::empty({n}, keys.options());
  at::Tensor status = inserts ? at::empty({n}, keys.options()) : at::Tensor();
  at::Tensor victim_keys = inserts ? at::full({n}, kEmptyKey, keys.options()) : at::Tensor();
  at::Tensor victim_scores =
      inserts ? at::zeros({ix.score_words(), n}, keys.options()) : at::Tensor();
  if (n == 0) return {slots, status, victim_keys, victim_scores};

  const TableView v = make_view(ix, &sizes);
  const cuda::BatchIn in{keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(),
                         ptr_or_null(args), ptr_or_null(counts), ptr_or_null(assign), n};
  const cuda::BatchOut out{slots.data_ptr<int64_t>(),
                           inserts ? status.data_ptr<int64_t>() : nullptr,
                           inserts ? victim_keys.data_ptr<int64_t>() : nullptr,
                           inserts ? victim_scores.data_ptr<int64_t>() : nullptr};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const uint64_t skip = static_cast<uint64_t>(ix.num_slots()) << 1;  // above every sort key
  at::Tensor sort_keys = at::empty({n}, keys.options());
  auto* sort_ptr = reinterpret_cast<uint64_t*>(sort_keys.data_ptr<int64_t>());
  if (op == BucketOp::kInsert) {
    cuda::lookup_kernel<<<cuda::blocks_for_tiles(n), kThreads, 0, stream>>>(v, in, out, sort_ptr,
                                                                             skip);
  } else {
    cuda::bucket_keys_kernel<<<blocks_for(n), kThreads, 0, stream>>>(v, in, out, sort_ptr, skip);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const Schedule plan = schedule(sort_keys, skip, stream);
  cuda::bucket_kernel<<<blocks_for(n), kThreads, 0, stream>>>(v, op, in, out, plan.runs(),
                                                              skip);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {slots, status, victim_keys, victim_scores};
}

InsertOutputs table_find_or_insert_cuda(const at::Tensor& index_keys, const at::Tensor& digests,
                                        const at::Tensor& scores, const at::Tensor& slot_offsets,
                                        const at::Tensor& bucket_widths,
                                        const at::Tensor& policies, at::Tensor sizes,
                                        const at::Tensor& keys, const at::Tensor& table_ids,
                                        const at::Tensor& score_args,
                                        const std::optional<at::Tensor>& counts) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  return bucket_op_cuda(ix, sizes, BucketOp::kInsert, keys, table_ids, score_args, counts,
                        std::nullopt);
}

InsertOutputs table_insert_or_assign_cuda(const at::Tensor& index_keys, const at::Tensor& digests,
                                          const at::Tensor& scores,
                                          const at::Tensor& slot_offsets,
                                          const at::Tensor& bucket_widths,
                                          const at::Tensor& policies, at::Tensor sizes,
                                          const at::Tensor& keys, const at::Tensor& table_ids,
                                          const at::Tensor& assign_scores) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  check_assign_scores(ix, assign_scores, keys);
  return bucket_op_cuda(ix, sizes, BucketOp::kAssign, keys, table_ids, std::nullopt, std::nullopt,
                        assign_scores);
}

at::Tensor table_erase_cuda(const at::Tensor& index_keys, const at::Tensor& digests,
                            const at::Tensor& scores, const at::Tensor& slot_offsets,
                            const at::Tensor& bucket_widths, const at::Tensor& policies,
                            at::Tensor sizes, const at::Tensor& keys,
                            const at::Tensor& table_ids) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  return std::get<0>(bucket_op_cuda(ix, sizes, BucketOp::kErase, keys, table_ids, std::nullopt,
                                    std::nullopt, std::nullopt));
}

at::Tensor table_timestamp_cuda(const at::Tensor& like) {
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor out = at::empty({1}, like.options().dtype(at::kLong));
  cuda::timestamp_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(out.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) {
  m.impl("table_lookup", &table_lookup_cuda);
  m.impl("table_find_or_insert", &table_find_or_insert_cuda);
  m.impl("table_insert_or_assign", &table_insert_or_assign_cuda);
  m.impl("table_erase", &table_erase_cuda);
  m.impl("table_timestamp", &table_timestamp_cuda);
}

}  // namespace demb
