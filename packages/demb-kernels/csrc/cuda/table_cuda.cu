// CUDA bindings of the table ops: allocation, validation and launch order. The algorithm is the
// CPU one (cpu/table_cpu.cpp): phase A per key, a stable sort of the batch by bucket, phase B
// per bucket in batch order; identical results. find_or_insert reads back whether phase A
// missed a key (one sync; none while the stream is captured) and skips phase B when it found
// them all.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_run_length_encode.cuh>
#include <cub/device/device_scan.cuh>
#include <algorithm>
#include <functional>

#include "cuda/cub_call.cuh"
#include "cuda/host_copy.h"
#include "cuda/table_bucket.cuh"
#include "cuda/table_bucket_warp.cuh"
#include "cuda/table_kernels.cuh"
#include "gather_call.h"
#include "lookup_checks.h"
#include "table_checks.h"
#include "table_ops.h"

namespace demb {
namespace {

using cuda::cub_sequence;

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

// `count` elements of `dtype` at device address `src`, read back to the host on `stream`
// (read_back_words: a kernel into the thread's pinned scratch, no copy-engine hand-over before
// the work `between` queues, and no allocation, address query or event of its own); the host
// waits for the copy only (and the work before it), after `between` has queued its work behind
// the copy.
at::Tensor read_back(const void* src, int64_t count, at::ScalarType dtype,
                     const at::cuda::CUDAStream& stream, const std::function<void()>& between) {
  return read_back_words(src, count, dtype, stream.stream(), stream.device_index(), between);
}

// The phase-B schedule: entries stably sorted by sort key (bucket order, batch order within a
// bucket), cut into runs of equal keys. Phase A fills sort_keys, order (the sort's values) and
// zeroed run_lengths (PhaseBPrep), and for find_or_insert the missed flag; build() sorts and
// cuts. Two allocations back every array.
struct Schedule {
  at::Tensor words;  // int64 (3, N): sort keys, sorted keys, run keys
  at::Tensor ints;   // int32 (5N + 3): order, positions, run lengths, run offsets, run count,
                     // missed flag, the wide buckets' runs, their count
  int64_t n;         // entries the arrays hold, all of which build() schedules
  uint64_t skip;

  Schedule(const at::Tensor& like, int64_t n_, uint64_t skip_)
      : words(at::empty({3, n_}, like.options().dtype(at::kLong))),
        ints(at::empty({5 * n_ + 3}, like.options().dtype(at::kInt))),
        n(n_),
        skip(skip_) {}

  uint64_t* word(int64_t k) const {
    return reinterpret_cast<uint64_t*>(words.data_ptr<int64_t>()) + k * n;
  }
  int32_t* int32(int64_t k) const { return ints.data_ptr<int32_t>() + k * n; }

  // With `flag`, phase A sets the missed flag (zeroed here first).
  cuda::PhaseBPrep prep(bool flag, cudaStream_t stream) const {
    int32_t* missed = flag ? int32(4) + 1 : nullptr;
    if (flag) C10_CUDA_CHECK(cudaMemsetAsync(missed, 0, sizeof(int32_t), stream));
    return cuda::PhaseBPrep{word(0), int32(0), int32(2), skip, missed};
  }

  // Whether phase A missed some valid key: the flag read back (read_back).
  bool missed(const at::cuda::CUDAStream& stream, const std::function<void()>& between) const {
    const at::Tensor host = read_back(int32(4) + 1, 1, at::kInt, stream, between);
    return host.const_data_ptr<int32_t>()[0] != 0;
  }

  int32_t* wide() const { return int32(4) + 2; }
  int32_t* wide_count() const { return wide() + n; }

  cuda::Runs runs() const {
    return cuda::Runs{word(2), int32(3), int32(2), int32(4), int32(1), wide(), wide_count()};
  }

  void build(cudaStream_t stream) const {
    const auto n32 = static_cast<int>(n);
    C10_CUDA_CHECK(cudaMemsetAsync(wide_count(), 0, sizeof(int32_t), stream));
    const int end_bit = end_bit_for(skip);
    cub_sequence(
        words,
        [&](void* temp, size_t& bytes) {
          return cub::DeviceRadixSort::SortPairs(temp, bytes, word(0), word(1), int32(0),
                                                 int32(1), n32, 0, end_bit, stream);
        },
        [&](void* temp, size_t& bytes) {
          return cub::DeviceRunLengthEncode::Encode(temp, bytes, word(1), word(2), int32(2),
                                                    int32(4), n32, stream);
        },
        [&](void* temp, size_t& bytes) {
          return cub::DeviceScan::ExclusiveSum(temp, bytes, int32(2), int32(3), n32, stream);
        });
  }

  // Phase B over the built schedule: bucket_kernel (a thread per run), then bucket_warp_kernel
  // for the runs of wide buckets bucket_kernel left (none: its warps find a count of 0).
  void phase_b(const TableView& v, BucketOp op, const cuda::BatchIn& in,
               const cuda::BatchOut& out, cudaStream_t stream) const {
    cuda::bucket_kernel<<<blocks_for(n), kThreads, 0, stream>>>(v, op, in, out, runs(), skip);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    cuda::bucket_warp_kernel<<<cuda::wide_blocks(n, sms), cuda::kWarp * cuda::kWideWarpsPerBlock,
                               0, stream>>>(v, op, in, out, runs());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// table_lookup (table_lookup_op).
at::Tensor lookup_cuda(const IndexTensors& ix, const at::Tensor& keys_in,
                       const at::Tensor& table_ids_in, const std::optional<at::Tensor>& score_args,
                       const std::optional<at::Tensor>& counts_in) {
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
  cuda::lookup_kernel<<<cuda::blocks_for_lanes(n), kThreads, 0, stream>>>(
      make_view(ix, nullptr), in, out, cuda::PhaseBPrep{});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return slots;
}

// find_or_insert (kInsert), insert_or_assign (kAssign) and erase (kErase); TableOps' bucket op.
// For kInsert, *all_hit tells whether phase A found every key (false too while the stream is
// captured; a null all_hit: the host never waits for the flag, phase B always runs), and
// `speculate` (find_or_insert_rows' gather) is queued behind phase A and the
// flag's copy, before the host waits for the flag (never while the stream is captured: phase B
// always runs then).
InsertOutputs bucket_op_cuda(const IndexTensors& ix, at::Tensor& sizes, BucketOp op,
                             const at::Tensor& keys_in, const at::Tensor& table_ids_in,
                             const std::optional<at::Tensor>& score_args,
                             const std::optional<at::Tensor>& counts_in,
                             const std::optional<at::Tensor>& assign_in, bool* all_hit,
                             const Speculate& speculate) {
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
  // Phase A sets the victim outputs of every entry (an empty key, zero scores).
  at::Tensor victim_keys = inserts ? at::empty({n}, keys.options()) : at::Tensor();
  at::Tensor victim_scores = inserts ? at::empty({ix.score_words(), n}, keys.options())
                                     : at::Tensor();
  if (all_hit != nullptr) *all_hit = n == 0;
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
  const Schedule plan(keys, n, skip);
  if (op == BucketOp::kInsert) {
    // Every key found (the steady state of a warm table): phase A did all of it. One sync
    // instead of the schedule's sort, run-length encoding and scan over the whole batch; not
    // while the stream is captured into a CUDA graph (no sync there: phase B always runs).
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool may_skip = capture == cudaStreamCaptureStatusNone && all_hit != nullptr;
    cuda::lookup_kernel<<<cuda::blocks_for_lanes(n), kThreads, 0, stream>>>(
        v, in, out, plan.prep(may_skip, stream));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    // `speculate` (given phase A's slots) is queued behind the flag's copy: work that is
    // right when every key was found runs while the host waits.
    const std::function<void()> between = [&] {
      if (speculate) speculate(slots);
    };
    if (may_skip && !plan.missed(at::cuda::getCurrentCUDAStream(), between)) {
      if (all_hit != nullptr) *all_hit = true;
      return {slots, status, victim_keys, victim_scores};
    }
  } else {
    cuda::bucket_keys_kernel<<<blocks_for(n), kThreads, 0, stream>>>(
        v, in, out, plan.prep(false, stream));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  plan.build(stream);
  plan.phase_b(v, op, in, out, stream);
  return {slots, status, victim_keys, victim_scores};
}

// find_or_insert of a batch from dedup_launch (keys, table_ids and counts of N rows, the first
// U unique; U and the go flag in `info`, on the device): phase A over the first U rows (none
// when the go flag is clear), the gather of the N occurrences' rows (`inverse` given) queued
// behind it, then the one sync of the forward: `info` read back whole (the dedup's words, U,
// the go flag and phase A's missed flag, returned on the CPU). When the go flag is set and a
// key missed, phase B runs on the first U rows. Outputs have N rows, of which the first U are
// meaningful (the victims only when phase B ran: a key missed); rows are right only when the
// go flag is set and no key missed.
RowsOutputs table_find_or_insert_gated_cuda(
    const at::Tensor& index_keys, const at::Tensor& digests, const at::Tensor& scores,
    const at::Tensor& slot_offsets, const at::Tensor& bucket_widths, const at::Tensor& policies,
    at::Tensor sizes, const at::Tensor& keys_in, const at::Tensor& table_ids_in,
    const at::Tensor& score_args_in, const std::optional<at::Tensor>& counts_in,
    at::Tensor info, at::TensorList values, const std::optional<at::Tensor>& inverse,
    int64_t dim, const std::optional<at::Tensor>& victim_rank,
    const std::optional<at::Tensor>& ranked) {
  const IndexTensors ix = checked_index(index_keys, digests, scores, slot_offsets, bucket_widths,
                                        policies, victim_rank, ranked);
  check_batch(ix, keys_in, table_ids_in, score_args_in, counts_in);
  check_index_tensor(sizes, "sizes", at::kLong, ix.keys);
  TORCH_CHECK_VALUE(sizes.numel() == ix.num_tables(), "index sizes must be (T,)");
  check_index_tensor(info, "info", at::kLong, ix.keys);
  TORCH_CHECK_VALUE(info.dim() == 1 && info.numel() >= 5 && info.is_contiguous(),
                    "info: expected dedup_launch's contiguous words (U, go, missed last), got shape ",
                    info.sizes());
  if (inverse) check_rows_request(ix, values, keys_in, table_ids_in, *inverse, dim);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor table_ids = table_ids_in.contiguous();
  const at::Tensor counts = contiguous_or_undefined(counts_in);
  const at::Tensor args = score_args_in.contiguous();
  const int64_t n = keys.numel();
  const int64_t w = info.numel() - 4;  // the last three: [w + 1] = U, [w + 2] = go, [w + 3] missed
  at::Tensor slots = at::empty({n}, keys.options());
  at::Tensor status = at::empty({n}, keys.options());
  at::Tensor victim_keys = at::empty({n}, keys.options());
  at::Tensor victim_scores = at::empty({ix.score_words(), n}, keys.options());
  const at::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  at::Tensor rows;
  const uint64_t skip = static_cast<uint64_t>(ix.num_slots()) << 1;  // above every sort key
  const TableView v = make_view(ix, &sizes);
  const cuda::BatchIn in{keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(),
                         args.const_data_ptr<int64_t>(), ptr_or_null(counts), nullptr, n,
                         info.data_ptr<int64_t>() + w + 1};
  const cuda::BatchOut out{slots.data_ptr<int64_t>(), status.data_ptr<int64_t>(),
                           victim_keys.data_ptr<int64_t>(), victim_scores.data_ptr<int64_t>()};
  auto* missed = reinterpret_cast<int32_t*>(info.data_ptr<int64_t>() + w + 3);  // zeroed
  if (n > 0) {
    // A lean phase A: slots, statuses, touches and the missed flag only. Phase B's schedule
    // and the victim outputs are prepared only when a key missed (prepare_found_kernel): a
    // warm table's batch finds every key (the reference batch's lookup on the H200: 44.8-46.2
    // us against 47.7 us when phase A wrote them).
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const unsigned blocks = std::min(cuda::blocks_for_lanes(n), cuda::resident_lookup_blocks(sms));
    const cuda::BatchOut lean{out.slots, out.status, nullptr, nullptr};
    const cuda::PhaseBPrep notes{nullptr, nullptr, nullptr, skip, missed};
    cuda::lookup_gated_kernel<<<blocks, kThreads, 0, stream>>>(v, in, lean, notes);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const at::Tensor host = read_back(info.const_data_ptr(), info.numel(), at::kLong, stream, [&] {
    if (inverse && n > 0) rows = call_gather_table_rows(values, slots, table_ids, *inverse, dim);
  });
  const int64_t* h = host.const_data_ptr<int64_t>();
  const bool go = h[w + 2] != 0;
  const bool hit = h[w + 3] == 0;
  if (go && !hit && h[w + 1] > 0) {  // phase B on the first U rows, scheduled only now
    const Schedule plan(keys, h[w + 1], skip);
    cuda::prepare_found_kernel<<<blocks_for(plan.n), kThreads, 0, stream>>>(
        v, in, out, plan.prep(false, stream), plan.n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    plan.build(stream);
    plan.phase_b(v, BucketOp::kInsert, in, out, stream);
  }
  if (!go || !hit || !rows.defined()) rows = at::empty({0, dim}, keys.options().dtype(at::kFloat));
  return {slots, status, victim_keys, victim_scores, host, rows};
}

at::Tensor table_erase_cuda(const at::Tensor& index_keys, const at::Tensor& digests,
                            const at::Tensor& scores, const at::Tensor& slot_offsets,
                            const at::Tensor& bucket_widths, const at::Tensor& policies,
                            at::Tensor sizes, const at::Tensor& keys,
                            const at::Tensor& table_ids) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  return std::get<0>(bucket_op_cuda(ix, sizes, BucketOp::kErase, keys, table_ids, std::nullopt,
                                    std::nullopt, std::nullopt, nullptr, Speculate()));
}

at::Tensor table_timestamp_cuda(const at::Tensor& like, int64_t count) {
  TORCH_CHECK_VALUE(count >= 1, "count: ", count, "; the timestamp needs at least one copy");
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor out = at::empty({count}, like.options().dtype(at::kLong));
  cuda::timestamp_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(out.data_ptr<int64_t>(),
                                                                          count);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) {
  m.impl("table_lookup", &table_lookup_op<lookup_cuda>);
  m.impl("table_find_or_insert", &TableOps<bucket_op_cuda>::find_or_insert);
  m.impl("table_find_or_insert_rows", &TableOps<bucket_op_cuda>::find_or_insert_rows);
  m.impl("table_find_or_insert_gated", &table_find_or_insert_gated_cuda);
  m.impl("table_insert_or_assign", &TableOps<bucket_op_cuda>::insert_or_assign);
  m.impl("table_erase", &table_erase_cuda);
  m.impl("table_timestamp", &table_timestamp_cuda);
}

}  // namespace demb
