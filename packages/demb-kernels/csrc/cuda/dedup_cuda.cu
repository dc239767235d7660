// dedup_batch, index_tables (and batch_checks) on CUDA: the CPU's outputs
// (dedup.cpp) from a few kernels and two cub radix sorts: the batch's positions sorted by key
// (sign bit flipped: signed order), then stably by table (only the bits T needs), which is the
// one stable order by (table, key, position); or, when the keys differ only in their low bits,
// one sort of (table, low bits) packed into one key (by a shift, or for dedup_launch by a radix
// the caller picks: fewer radix passes). Each unique key is the first of its run; the checks
// ride the kernels into one read-back buffer.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_scan.cuh>
#include <limits>
#include <memory>
#include <mutex>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <optional>
#include <tuple>

#include "cuda/cub_call.cuh"
#include "cuda/dedup_cuda.h"
#include "cuda/dedup_kernels.cuh"
#include "cuda/dedup_sort_cache.cuh"
#include "dedup_checks.h"
#include "table_rule.h"

namespace demb {
namespace {

// A zeroed int64 buffer by one memset (at::zeros launches a fill kernel through more host work).
at::Tensor zeroed(int64_t n, const at::TensorOptions& opts, cudaStream_t stream) {
  at::Tensor out = at::empty({n}, opts.dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, n * sizeof(int64_t), stream));
  return out;
}

// dedup_launch's clock words at most (one per table of a module; a first block's thread writes
// them).
constexpr int64_t kMaxClockWords = 1024;

int bits_for(int64_t max_value) {
  int bits = 1;
  while (bits < 32 && (max_value >> bits) != 0) ++bits;
  return bits;
}

using DedupOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;  // rows counts ...
using LaunchOut = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // rows, counts, info

// One dedup of a batch on the device: its buffers, and the launches that fill them (no sync).
// `info` holds the words read back (dedup_bounds', see kDedupFlags), then the keys' varying
// bits and the largest low bits (dedup_prepare_kernel), then `extra` more words (zeroed), then
// one zeroed word no kernel here writes (dedup_launch's NaN/inf flag for the backward), then
// `clock_words` copies of the global timer (dedup_prepare_kernel; dedup_launch's clock).
struct DedupRun {
  at::Tensor indices, offsets, feature_tables, counters;
  const int64_t* cnt;
  int64_t n, features, bags, num_tables, batch_size, words;
  at::TensorOptions opts;
  cudaStream_t stream;
  at::Tensor info;
  // The int64 scratch (sort keys in and out, first flags, their ranks) and the int32 scratch
  // (tables, tables by key, sorted tables, positions, positions by key, sorted positions) are
  // the stream's, kept across calls (held locked until the run's work is queued; new ones,
  // `kept` null, while the stream is being captured); the outputs are one new (5, N) buffer
  // (inverse, order, keys, tables, starts: the ops return it whole, the Python wrappers take the
  // rows), made once the sort is queued (ensure_outputs: its allocation no longer delays the
  // first kernels).
  std::shared_ptr<SortScratch> kept;
  std::unique_lock<std::mutex> hold;
  at::Tensor scratch64, scratch32, outputs, counters_sorted;
  int table_bits;
  uint64_t radix;  // > 0: sort keys table * radix + low bits (dedup_launch's key_radix)
  int64_t flag_at;                // info[flag_at]: zeroed, written by no kernel here
  int64_t clock_at, clock_words;  // info[clock_at, + clock_words): the global timer
  int prepared = -1;  // the low bits the sort keys were made with

  DedupRun(const at::Tensor& indices_in, const at::Tensor& offsets_in,
           const at::Tensor& feature_tables_in, int64_t num_tables_, int64_t batch_size_,
           const std::optional<at::Tensor>& counters_in, int64_t extra, int64_t radix_,
           int64_t clock_words_ = 0)
      : indices(indices_in.contiguous()),
        offsets(offsets_in.contiguous()),
        feature_tables(feature_tables_in.contiguous()),
        counters(counters_in ? counters_in->contiguous() : at::Tensor()),
        cnt(counters.defined() && indices.numel() ? counters.const_data_ptr<int64_t>() : nullptr),
        n(indices.numel()),
        features(feature_tables.numel()),
        bags(offsets.numel() - 1),
        num_tables(num_tables_),
        batch_size(batch_size_),
        words(num_tables_ + kDedupFlags + feature_tables.numel() + 1),
        opts(indices.options()),
        stream(at::cuda::getCurrentCUDAStream()),
        info(zeroed(words + 2 + extra + 1 + clock_words_, indices.options(), stream)),
        kept(stream_capturing(stream) ? nullptr : SortScratchCache::get(opts, stream, n)),
        hold(kept ? std::unique_lock<std::mutex>(kept->mutex) : std::unique_lock<std::mutex>()),
        scratch64(kept ? kept->scratch64 : at::empty({4, n}, opts)),
        scratch32(kept ? kept->scratch32 : at::empty({6, n}, opts.dtype(at::kInt))),
        table_bits(bits_for(num_tables_ - 1)),
        radix(static_cast<uint64_t>(radix_)),
        flag_at(words + 2 + extra),
        clock_at(flag_at + 1),
        clock_words(clock_words_) {
    if (kept) ++kept->uses;
  }

  int64_t* s64(int64_t k) const { return scratch64.data_ptr<int64_t>() + k * n; }
  int32_t* s32(int64_t k) const { return scratch32.data_ptr<int32_t>() + k * n; }
  // The outputs' buffer (and the counters in order), made on the first call.
  void ensure_outputs() {
    if (outputs.defined()) return;
    outputs = at::empty({5, n}, opts);
    if (cnt) counters_sorted = at::empty({n}, opts);
  }
  int64_t* out(int64_t k) const { return outputs.data_ptr<int64_t>() + k * n; }

  // How the sort keys pack (table, key) when the keys agree above their low end_bit bits:
  // with a radix, table * radix + low bits (`bits` wide); else, with room for the table above
  // those bits, one sort orders by (table, key): the table goes above them (shift = end_bit),
  // or shift = 0 (two sorts, bits = 0).
  struct Packing {
    int shift;
    uint64_t radix;
    int bits;
  };
  Packing packing(int end_bit) const {
    if (radix != 0 && end_bit < 64) {
      const int bits =
          static_cast<int>(bit_length(static_cast<uint64_t>(num_tables) * radix - 1));
      return {0, radix, std::max(bits, 1)};
    }
    const int shift = end_bit + table_bits <= 64 ? end_bit : 0;
    return {shift, 0, shift > 0 ? shift + table_bits : 0};
  }
  // Combined keys of at most 32 bits are sorted as uint32 (in the first half of the buffers).
  static bool narrow(const Packing& p) { return p.bits > 0 && p.bits <= 32; }

  // Makes the sort keys (and the batch's checks: run again, they count the same flags), and
  // each index's table for the two-sort path only (packed keys carry their table).
  void prepare(int end_bit) {
    prepared = end_bit;
    const Packing p = packing(end_bit);
    auto* k_in = reinterpret_cast<uint64_t*>(s64(0));
    int64_t* const words_out = info.data_ptr<int64_t>();
    dedup_prepare_kernel<<<prepare_blocks(std::max(n, bags + 1)), kDedupThreads, 0, stream>>>(
        indices.const_data_ptr<int64_t>(), offsets.const_data_ptr<int64_t>(), bags,
        feature_tables.const_data_ptr<int64_t>(), features, batch_size, cnt, n, num_tables,
        end_bit, p.shift, p.radix, k_in,
        narrow(p) ? reinterpret_cast<uint32_t*>(k_in) : nullptr,
        p.bits > 0 ? nullptr : reinterpret_cast<uint32_t*>(s32(0)), s32(3), words_out,
        words_out + words, words_out + words + 1, words_out + clock_at, clock_words);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // The sort by key looks at bits [0, end_bit) only: right when every key agrees with the
  // first above them (a caller's guess `key_bits`: a few radix passes instead of eight for
  // small ids; the varying bits read back tell whether the keys fit).
  // With a gate (dedup_launch), the scatter's last block writes it (no index: a kernel does).
  void sort_and_scatter(int end_bit, const DedupGate& gate) {
    const Packing p = packing(end_bit);
    if (end_bit != prepared) prepare(end_bit);  // also with no index: the checks of the offsets
    if (n == 0) {
      ensure_outputs();
      if (gate.info != nullptr) {
        dedup_gate_kernel<<<1, 1, 0, stream>>>(gate);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      return;
    }
    const auto n32 = static_cast<int>(n);
    auto* k_in = reinterpret_cast<uint64_t*>(s64(0));
    auto* k_out = reinterpret_cast<uint64_t*>(s64(1));
    auto* k32_in = reinterpret_cast<uint32_t*>(k_in);
    auto* k32_out = reinterpret_cast<uint32_t*>(k_out);
    auto* t_in = reinterpret_cast<uint32_t*>(s32(0));
    auto* t_key = reinterpret_cast<uint32_t*>(s32(1));
    auto* t_out = reinterpret_cast<uint32_t*>(s32(2));
    int32_t* const positions = s32(3);
    int32_t* const by_key = s32(4);
    int32_t* const order32 = s32(5);
    SortedTables sorted{t_out, nullptr, nullptr, 0, 0};
    FirstFlags flags{s64(2), nullptr, nullptr};  // the two-sort path's flags, by a kernel
    int64_t* const rank = s64(3);
    if (p.bits > 0) {  // one sort of the combined keys (as uint32 when they fit), then the scan
      const bool keys32 = narrow(p);
      sorted = keys32 ? SortedTables{nullptr, nullptr, k32_out, p.shift, p.radix}
                      : SortedTables{nullptr, k_out, nullptr, p.shift, p.radix};
      // Combined sort keys give the first flags on the fly (in the scan and the scatter).
      flags = FirstFlags{nullptr, sorted.combined, sorted.combined32};
      const auto first_in =
          thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), flags);
      const auto sort = [&](void* temp, size_t& bytes, cudaStream_t s) {
        return keys32 ? cub::DeviceRadixSort::SortPairs(temp, bytes, k32_in, k32_out, positions,
                                                        order32, n32, 0, p.bits, s)
                      : cub::DeviceRadixSort::SortPairs(temp, bytes, k_in, k_out, positions,
                                                        order32, n32, 0, p.bits, s);
      };
      const auto scan = [&](void* temp, size_t& bytes, cudaStream_t s) {
        return cub::DeviceScan::ExclusiveSum(temp, bytes, first_in, rank, n32, s);
      };
      const auto sizes = [&](size_t& most) {
        size_t sort_bytes = 0;
        size_t scan_bytes = 0;
        C10_CUDA_CHECK(sort(nullptr, sort_bytes, stream));
        C10_CUDA_CHECK(scan(nullptr, scan_bytes, stream));
        most = std::max(sort_bytes, scan_bytes);
      };
      const auto sort_and_scan = [&](void* temp, size_t bytes, cudaStream_t s) {
        size_t sort_bytes = bytes;
        size_t scan_bytes = bytes;
        const cudaError_t err = sort(temp, sort_bytes, s);
        return err != cudaSuccess ? err : scan(temp, scan_bytes, s);
      };
      if (kept) {
        kept->run(p.bits, keys32, stream, opts, sizes, sort_and_scan);
      } else {
        sort_and_scan_eagerly(stream, opts, sizes, sort_and_scan);
      }
    } else {  // by key, then (stably) by table, then a kernel writes the first flags
      cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(temp, bytes, k_in, k_out, positions, by_key, n32,
                                               0, end_bit, stream);
      });
      dedup_permute_tables_kernel<<<dedup_blocks(n), kDedupThreads, 0, stream>>>(t_in, by_key,
                                                                                 n, t_key);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(temp, bytes, t_key, t_out, by_key, order32, n32, 0,
                                               table_bits, stream);
      });
      dedup_first_kernel<<<dedup_blocks(n), kDedupThreads, 0, stream>>>(
          indices.const_data_ptr<int64_t>(), order32, sorted, n, s64(2));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const auto first_in =
          thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), flags);
      cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
        return cub::DeviceScan::ExclusiveSum(temp, bytes, first_in, rank, n32, stream);
      });
    }
    ensure_outputs();  // behind the sort's launches
    dedup_scatter_kernel<<<dedup_blocks(n), kDedupThreads, 0, stream>>>(
        indices.const_data_ptr<int64_t>(), order32, sorted, end_bit, flags, rank, cnt, n, out(0),
        out(1), out(2), out(3), out(4), cnt ? counters_sorted.data_ptr<int64_t>() : nullptr,
        info.data_ptr<int64_t>(), num_tables, gate);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // dedup_launch's gate words (see DedupGate), for the sort on the low key_bits bits.
  DedupGate gate_for(int64_t key_bits) const {
    return DedupGate{info.data_ptr<int64_t>(), num_tables, words, key_bits, radix};
  }

  // (size,) counts of the first `unique` keys (see dedup_counts_kernel), or with `gate` (the
  // unique count and the go flag on the device), of the first gate[0] keys when gate[1] is set.
  at::Tensor counts(int64_t size, int64_t unique, const int64_t* gate) const {
    at::Tensor counts = at::empty({size}, opts);
    if (unique == 0 || n == 0) return counts;
    at::Tensor summed;
    if (cnt) {
      summed = at::empty({n}, opts);
      cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
        return cub::DeviceScan::InclusiveSum(temp, bytes, counters_sorted.const_data_ptr<int64_t>(),
                                             summed.data_ptr<int64_t>(), static_cast<int>(n),
                                             stream);
      });
    }
    dedup_counts_kernel<<<dedup_blocks(unique), kDedupThreads, 0, stream>>>(
        out(4), cnt ? summed.const_data_ptr<int64_t>() : nullptr,
        cnt ? counters_sorted.const_data_ptr<int64_t>() : nullptr, unique, gate, n,
        counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return counts;
  }
};

void check_dedup_size(int64_t n) {
  TORCH_CHECK_VALUE(n <= std::numeric_limits<int32_t>::max(), "indices: ", n,
                    " entries; dedup_batch takes at most 2^31 - 1");
}

DedupOut dedup_batch_cuda(const at::Tensor& indices, const at::Tensor& offsets,
                          const at::Tensor& feature_tables, int64_t num_tables,
                          int64_t batch_size, const std::optional<at::Tensor>& counters,
                          int64_t key_bits) {
  check_dedup_args(indices, offsets, feature_tables, num_tables, batch_size, counters, key_bits);
  check_dedup_size(indices.numel());
  const c10::cuda::CUDAGuard guard(indices.device());
  DedupRun d(indices, offsets, feature_tables, num_tables, batch_size, counters, 0, 0);
  const DedupGate none{nullptr, 0, 0, 0, 0};
  d.sort_and_scatter(static_cast<int>(key_bits), none);
  at::Tensor host = d.info.cpu();  // the one sync
  const int64_t needed = bit_length(static_cast<uint64_t>(host.const_data_ptr<int64_t>()[d.words]));
  if (d.n > 0 && needed > key_bits) {  // the guess was short: sort again, read back again
    d.sort_and_scatter(64, none);
    host = d.info.cpu();
  }
  const at::Tensor bounds =
      dedup_bounds(host.const_data_ptr<int64_t>(), d.n, num_tables, d.features);
  const int64_t unique = bounds.const_data_ptr<int64_t>()[num_tables];
  const at::Tensor counts = d.counts(unique, unique, nullptr);
  d.ensure_outputs();  // (an empty batch sorts nothing)
  if (unique < d.n) {  // keys, tables and starts past U: zeros, as on the CPU (one launch)
    C10_CUDA_CHECK(cudaMemset2DAsync(d.out(2) + unique, d.n * sizeof(int64_t), 0,
                                     (d.n - unique) * sizeof(int64_t), 3, d.stream));
  }
  return {d.outputs, counts, bounds, at::scalar_tensor(needed, at::kLong)};
}

// dedup_batch's rows and counts at full size N (the first U entries of keys, tables, starts and
// counts are the unique keys'; U, like the rest, is on the device), with no sync: `info` (W + 6,) int64 on the device holds the words
// dedup_batch reads back (W = T + kDedupFlags + F + 1: see kDedupFlags) and then: the keys'
// varying bits, their largest low key_bits bits, a count of the scatter's finished blocks, U,
// the go flag (1: every check passed, the keys differ in no bit above key_bits and, with a
// key_radix, their low bits are all below it, so the first U rows are right; else the caller
// reads info back and raises, or dedups again on all 64 bits), and a zeroed word a consumer
// may use as a flag (find_or_insert sets its low half when phase A missed a key): the last
// three are U, go and that flag. A consumer reads U and the go flag on the device
// (table_find_or_insert_gated). key_radix > 0 sorts (table, key) as table * key_radix + the
// key's low key_bits bits: fewer radix passes than the table above those bits, when T *
// key_radix fits fewer bytes. want_counts=false skips the counts (a (0,) tensor in their
// place: a caller whose tables count no occurrences saves their launch). `info` (returned whole)
// ends with a zeroed word no kernel here writes, whose first byte is summed_update's
// `nonfinite` (a backward's NaN/inf flag with no allocation or memset of its own), then C =
// clock_words copies of the global timer read by the first kernel (the timed scores of the
// batch, as timestamp_kernel makes them, with no launch of their own).
LaunchOut dedup_launch_cuda(const at::Tensor& indices, const at::Tensor& offsets,
                            const at::Tensor& feature_tables, int64_t num_tables,
                            int64_t batch_size, const std::optional<at::Tensor>& counters,
                            int64_t key_bits, int64_t key_radix, bool want_counts,
                            int64_t clock_words) {
  check_dedup_args(indices, offsets, feature_tables, num_tables, batch_size, counters, key_bits);
  check_dedup_size(indices.numel());
  TORCH_CHECK_VALUE(key_radix >= 0 && (key_radix == 0 || key_radix <= (int64_t{1} << 62) /
                                                                           num_tables),
                    "key_radix=", key_radix, ": must be 0 (no radix) or in [1, 2^62 / ",
                    num_tables, "] (num_tables * key_radix must fit the sort keys)");
  TORCH_CHECK_VALUE(clock_words >= 0 && clock_words <= kMaxClockWords, "clock_words=",
                    clock_words, ": must be in [0, ", kMaxClockWords, "]");
  const c10::cuda::CUDAGuard guard(indices.device());
  DedupRun d(indices, offsets, feature_tables, num_tables, batch_size, counters, 4,
             key_bits < 64 ? key_radix : 0, clock_words);
  d.sort_and_scatter(static_cast<int>(key_bits), d.gate_for(key_bits));
  int64_t* const info = d.info.data_ptr<int64_t>();
  const at::Tensor counts =
      want_counts ? d.counts(d.n, d.n, info + d.words + 3) : at::empty({0}, d.opts);
  d.ensure_outputs();
  return {d.outputs, counts, d.info};
}

// The batch's checks, and each index's table into `tables` when it is given.
at::Tensor launch_index_tables(const at::Tensor& indices_in, const at::Tensor& offsets_in,
                               const at::Tensor& feature_tables_in, int64_t num_tables,
                               int64_t batch_size, at::Tensor* tables) {
  check_dedup_args(indices_in, offsets_in, feature_tables_in, num_tables, batch_size,
                   std::nullopt, 64);
  const c10::cuda::CUDAGuard guard(indices_in.device());
  const at::Tensor indices = indices_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const at::Tensor feature_tables = feature_tables_in.contiguous();
  const int64_t n = indices.numel();
  const int64_t features = feature_tables.numel();
  const int64_t bags = offsets.numel() - 1;
  if (tables != nullptr) *tables = at::empty({n}, indices.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor flags = zeroed(kDedupFlags + features + 1, indices.options(), stream);
  index_tables_kernel<<<dedup_blocks(std::max(n, bags + 1)), kDedupThreads, 0, stream>>>(
      indices.const_data_ptr<int64_t>(), offsets.const_data_ptr<int64_t>(), bags,
      feature_tables.const_data_ptr<int64_t>(), features, batch_size, n, num_tables,
      tables != nullptr ? tables->data_ptr<int64_t>() : nullptr, flags.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return flags;
}

std::tuple<at::Tensor, at::Tensor> index_tables_cuda(const at::Tensor& indices,
                                                     const at::Tensor& offsets,
                                                     const at::Tensor& feature_tables,
                                                     int64_t num_tables, int64_t batch_size) {
  at::Tensor tables;
  at::Tensor flags =
      launch_index_tables(indices, offsets, feature_tables, num_tables, batch_size, &tables);
  return {tables, flags};
}


}  // namespace

at::Tensor batch_checks_cuda(const at::Tensor& indices, const at::Tensor& offsets,
                             const at::Tensor& feature_tables, int64_t num_tables,
                             int64_t batch_size) {
  return launch_index_tables(indices, offsets, feature_tables, num_tables, batch_size, nullptr);
}

TORCH_LIBRARY_IMPL(demb, CUDA, m) {
  m.impl("dedup_batch", &dedup_batch_cuda);
  m.impl("dedup_launch", &dedup_launch_cuda);
  m.impl("index_tables", &index_tables_cuda);
}

}  // namespace demb
