// dedup_batch, index_tables (and batch_checks) on CUDA: the CPU's outputs
// (dedup.cpp) from a few kernels and two cub radix sorts: the batch's positions sorted by key
// (sign bit flipped: signed order), then stably by table (only the bits T needs), which is the
// one stable order by (table, key, position). Each unique key is the first of its run; the
// checks ride the kernels into one read-back buffer.
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
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>
#include <optional>
#include <tuple>

#include "cuda/cub_call.cuh"
#include "cuda/dedup_cuda.h"
#include "dedup_checks.h"
#include "table_rule.h"

namespace demb {
namespace {

constexpr int kDedupThreads = 256;
constexpr uint64_t kSignBit = uint64_t{1} << 63;

// A zeroed int64 buffer by one memset (at::zeros launches a fill kernel through more host work).
at::Tensor zeroed(int64_t n, const at::TensorOptions& opts, cudaStream_t stream) {
  at::Tensor out = at::empty({n}, opts.dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(out.data_ptr(), 0, n * sizeof(int64_t), stream));
  return out;
}

unsigned dedup_blocks(int64_t n) {
  return static_cast<unsigned>((n + kDedupThreads - 1) / kDedupThreads);
}

__device__ __forceinline__ void count_flag(int64_t* word) {
  atomicAdd(reinterpret_cast<unsigned long long*>(word), 1ull);
}

// Thread i's part of the batch's checks into flags (see kDedupFlags), then offsets[::B]: bag
// i's offsets in order, feature i's table id in [0, T), index i not -1, its counter >= 0.
__device__ void check_batch_entry(int64_t i, const int64_t* __restrict__ indices,
                                  const int64_t* __restrict__ offsets, int64_t bags,
                                  const int64_t* __restrict__ feature_tables, int64_t features,
                                  int64_t batch_size, const int64_t* __restrict__ counters,
                                  int64_t n, int64_t num_tables, int64_t* __restrict__ flags) {
  if (i < bags && offsets[i + 1] < offsets[i]) count_flag(flags);
  if (i <= features) flags[kDedupFlags + i] = offsets[i * batch_size];
  if (i < features && (feature_tables[i] < 0 || feature_tables[i] >= num_tables)) {
    count_flag(flags + 5);
  }
  if (i == 0) {
    flags[1] = offsets[0];
    flags[2] = n - offsets[bags];
  }
  if (i < n && indices[i] == -1) count_flag(flags + 3);
  if (i < n && counters && counters[i] < 0) count_flag(flags + 4);
}

// The table of index i: feature f owns [offsets[f * B], offsets[(f + 1) * B]) (the last feature
// whose first bag starts at or before i; feature 0 if none).
__device__ int64_t table_of(int64_t i, const int64_t* __restrict__ offsets,
                            const int64_t* __restrict__ feature_tables, int64_t features,
                            int64_t batch_size) {
  int64_t lo = 0;
  int64_t hi = features;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (offsets[mid * batch_size] <= i) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return feature_tables[lo];
}

// Per index: its table, its sort key (sign bit flipped: signed order; with table_shift > 0, its
// low table_shift bits under the table: the (table, key) sort in one; into keys32 instead of
// keys when that fits 32 bits, halving the sort's key traffic), its position; the
// batch's checks into info (after the T per-table words); and into *varying the bits in which
// some key differs from the first (OR of key ^ key 0, reduced per block first).
__global__ void __launch_bounds__(kDedupThreads)
    dedup_prepare_kernel(const int64_t* __restrict__ indices,
                         const int64_t* __restrict__ offsets, int64_t bags,
                         const int64_t* __restrict__ feature_tables, int64_t features,
                         int64_t batch_size, const int64_t* __restrict__ counters, int64_t n,
                         int64_t num_tables, int table_shift, uint64_t* __restrict__ keys,
                         uint32_t* __restrict__ keys32, uint32_t* __restrict__ tables,
                         int32_t* __restrict__ positions,
                         int64_t* __restrict__ info, int64_t* __restrict__ varying) {
  __shared__ unsigned long long block_varying;
  if (threadIdx.x == 0) block_varying = 0;
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  check_batch_entry(i, indices, offsets, bags, feature_tables, features, batch_size, counters, n,
                    num_tables, info + num_tables);
  unsigned long long diff = 0;
  if (i < n) {
    const uint64_t key = static_cast<uint64_t>(indices[i]) ^ kSignBit;
    const auto table =
        static_cast<uint32_t>(table_of(i, offsets, feature_tables, features, batch_size));
    const uint64_t sort_key = table_shift == 0
                                  ? key
                                  : (static_cast<uint64_t>(table) << table_shift) |
                                        (key & ((uint64_t{1} << table_shift) - 1));
    if (keys32 != nullptr) {
      keys32[i] = static_cast<uint32_t>(sort_key);
    } else {
      keys[i] = sort_key;
    }
    tables[i] = table;
    positions[i] = static_cast<int32_t>(i);
    diff = static_cast<unsigned long long>(indices[i] ^ indices[0]);
  }
  // OR-reduced per warp first: one shared atomic per warp, not per thread.
  const unsigned lo = __reduce_or_sync(0xFFFFFFFFu, static_cast<unsigned>(diff));
  const unsigned hi = __reduce_or_sync(0xFFFFFFFFu, static_cast<unsigned>(diff >> 32));
  if ((threadIdx.x % 32) == 0 && (lo | hi)) {
    atomicOr(&block_varying, (static_cast<unsigned long long>(hi) << 32) | lo);
  }
  __syncthreads();
  if (threadIdx.x == 0 && block_varying) {
    atomicOr(reinterpret_cast<unsigned long long*>(varying), block_varying);
  }
}

// index_tables: the table of each index (none when `tables` is null: batch_checks), and the
// batch's checks.
__global__ void index_tables_kernel(const int64_t* __restrict__ indices,
                                    const int64_t* __restrict__ offsets, int64_t bags,
                                    const int64_t* __restrict__ feature_tables, int64_t features,
                                    int64_t batch_size, int64_t n, int64_t num_tables,
                                    int64_t* __restrict__ tables, int64_t* __restrict__ flags) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  check_batch_entry(i, indices, offsets, bags, feature_tables, features, batch_size, nullptr, n,
                    num_tables, flags);
  if (tables != nullptr && i < n) {
    tables[i] = table_of(i, offsets, feature_tables, features, batch_size);
  }
}

// The tables of the key-sorted positions.
__global__ void dedup_permute_tables_kernel(const uint32_t* __restrict__ tables,
                                            const int32_t* __restrict__ by_key, int64_t n,
                                            uint32_t* __restrict__ out) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < n) out[k] = tables[by_key[k]];
}

// The table of entry k of the (table, key) order: sorted tables, or the top bits of the sorted
// combined keys (dedup_prepare_kernel's table_shift), 64- or 32-bit.
struct SortedTables {
  const uint32_t* tables;
  const uint64_t* combined;
  const uint32_t* combined32;
  int shift;
  __device__ __forceinline__ uint32_t operator[](int64_t k) const {
    if (tables != nullptr) return tables[k];
    return combined32 != nullptr ? combined32[k] >> shift
                                 : static_cast<uint32_t>(combined[k] >> shift);
  }
};

// Whether entry k of the (table, key) order starts a unique key: first[k] (dedup_first_kernel's
// array) or, when the sort keys are combined (table above the low key bits), computed from
// them: the keys then agree above those bits (else the dedup runs again on all 64), so equal
// combined keys are equal (table, key) pairs.
struct FirstFlags {
  const int64_t* first;
  const uint64_t* combined;
  const uint32_t* combined32;
  __device__ __forceinline__ int64_t operator()(int64_t k) const {
    if (first != nullptr) return first[k];
    if (k == 0) return 1;
    return combined32 != nullptr ? combined32[k] != combined32[k - 1]
                                 : combined[k] != combined[k - 1];
  }
};

// first[k] = 1 where entry k of the (table, key) order starts a unique key (the two-sort path,
// whose sorted keys are the keys alone).
__global__ void dedup_first_kernel(const int64_t* __restrict__ indices,
                                   const int32_t* __restrict__ order, SortedTables tables,
                                   int64_t n,
                                   int64_t* __restrict__ first) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n) return;
  first[k] = k == 0 || tables[k] != tables[k - 1] || indices[order[k]] != indices[order[k - 1]];
}

// Scatters entry k: its index's unique key (inverse), the order, and for the first entry of a
// key that key, its table and start; the last entry of each table writes the table's end
// (info[t], the number of unique keys up to it). Also gathers the counters in order.
__global__ void dedup_scatter_kernel(const int64_t* __restrict__ indices,
                                     const int32_t* __restrict__ order32, SortedTables tables,
                                     FirstFlags first,
                                     const int64_t* __restrict__ rank_excl,
                                     const int64_t* __restrict__ counters, int64_t n,
                                     int64_t* __restrict__ inverse, int64_t* __restrict__ order,
                                     int64_t* __restrict__ keys_out,
                                     int64_t* __restrict__ tables_out,
                                     int64_t* __restrict__ starts,
                                     int64_t* __restrict__ counters_sorted,
                                     int64_t* __restrict__ info) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k >= n) return;
  const int64_t p = order32[k];
  const int64_t starts_key = first(k);
  const int64_t u = rank_excl[k] + starts_key - 1;
  inverse[p] = u;
  order[k] = p;
  if (counters) counters_sorted[k] = counters[p];
  if (starts_key) {
    keys_out[u] = indices[p];
    tables_out[u] = tables[k];
    starts[u] = k;
  }
  if (k == n - 1 || tables[k + 1] != tables[k]) info[tables[k]] = u + 1;
}

// counts[u]: the occurrences of key u, or the sum of its counters (summed: inclusive prefix sums
// of the counters in order).
__global__ void dedup_counts_kernel(const int64_t* __restrict__ starts,
                                    const int64_t* __restrict__ summed,
                                    const int64_t* __restrict__ counters_sorted, int64_t unique,
                                    int64_t n, int64_t* __restrict__ counts) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (u >= unique) return;
  const int64_t end = u + 1 < unique ? starts[u + 1] : n;
  counts[u] = summed ? summed[end - 1] - summed[starts[u]] + counters_sorted[starts[u]]
                     : end - starts[u];
}

int bits_for(int64_t max_value) {
  int bits = 1;
  while (bits < 32 && (max_value >> bits) != 0) ++bits;
  return bits;
}

using DedupOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor>;

DedupOut dedup_batch_cuda(const at::Tensor& indices_in, const at::Tensor& offsets_in,
                          const at::Tensor& feature_tables_in, int64_t num_tables,
                          int64_t batch_size, const std::optional<at::Tensor>& counters_in,
                          int64_t key_bits) {
  check_dedup_args(indices_in, offsets_in, feature_tables_in, num_tables, batch_size,
                   counters_in, key_bits);
  const int64_t n = indices_in.numel();
  TORCH_CHECK_VALUE(n <= std::numeric_limits<int32_t>::max(), "indices: ", n,
                    " entries; dedup_batch takes at most 2^31 - 1");
  const c10::cuda::CUDAGuard guard(indices_in.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor indices = indices_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const at::Tensor feature_tables = feature_tables_in.contiguous();
  const at::Tensor counters = counters_in ? counters_in->contiguous() : at::Tensor();
  const int64_t* cnt = counters.defined() && n ? counters.const_data_ptr<int64_t>() : nullptr;
  const int64_t features = feature_tables.numel();
  const int64_t bags = offsets.numel() - 1;
  const auto opts = indices.options();
  // The words read back: dedup_bounds' (see kDedupFlags), then the keys' varying bits.
  const int64_t words = num_tables + kDedupFlags + features + 1;
  at::Tensor info = zeroed(words + 1, opts, stream);
  // Three allocations back the arrays (each costs host time on the forward's path): the int64
  // scratch (sort keys in and out, first flags, their ranks), the int32 scratch (tables, tables
  // by key, sorted tables, positions, positions by key, sorted positions) and the outputs
  // (views of one buffer).
  const at::Tensor scratch64 = at::empty({4, n}, opts);
  const at::Tensor scratch32 = at::empty({6, n}, opts.dtype(at::kInt));
  const at::Tensor outputs = at::empty({5, n}, opts);
  int64_t* const s64 = scratch64.data_ptr<int64_t>();
  int32_t* const s32 = scratch32.data_ptr<int32_t>();
  int64_t* const first = s64 + 2 * n;
  int64_t* const rank = s64 + 3 * n;
  int32_t* const positions = s32 + 3 * n;
  int32_t* const by_key = s32 + 4 * n;
  int32_t* const order32 = s32 + 5 * n;
  auto* k_in = reinterpret_cast<uint64_t*>(s64);  // sort keys
  auto* k_out = reinterpret_cast<uint64_t*>(s64 + n);
  auto* t_in = reinterpret_cast<uint32_t*>(s32);  // tables
  auto* t_key = reinterpret_cast<uint32_t*>(s32 + n);
  auto* t_out = reinterpret_cast<uint32_t*>(s32 + 2 * n);
  const int64_t threads = std::max(n, bags + 1);
  const int table_bits = bits_for(num_tables - 1);
  // With room for the table above the key bits sorted, one sort orders by (table, key): the
  // table goes above them (shift = those bits), else shift = 0 (two sorts).
  const auto shift_for = [&](int end_bit) { return end_bit + table_bits <= 64 ? end_bit : 0; };
  // Combined keys of at most 32 bits are sorted as uint32 (in the first half of the buffers).
  const auto narrow = [&](int shift) { return shift > 0 && shift + table_bits <= 32; };
  auto* k32_in = reinterpret_cast<uint32_t*>(k_in);
  auto* k32_out = reinterpret_cast<uint32_t*>(k_out);
  // Makes the sort keys (and the batch's checks: run again, they count the same flags).
  const auto prepare = [&](int shift) {
    dedup_prepare_kernel<<<dedup_blocks(threads), kDedupThreads, 0, stream>>>(
        indices.const_data_ptr<int64_t>(), offsets.const_data_ptr<int64_t>(), bags,
        feature_tables.const_data_ptr<int64_t>(), features, batch_size, cnt, n, num_tables,
        shift, k_in, narrow(shift) ? k32_in : nullptr, t_in, positions,
        info.data_ptr<int64_t>(),
        info.data_ptr<int64_t>() + words);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  int prepared = shift_for(static_cast<int>(key_bits));
  prepare(prepared);
  const at::Tensor inverse = outputs[0];
  const at::Tensor order = outputs[1];
  const at::Tensor keys_out = outputs[2];
  const at::Tensor tables_out = outputs[3];
  const at::Tensor starts = outputs[4];
  at::Tensor counters_sorted = cnt ? at::empty({n}, opts) : at::Tensor();
  // The sort by key looks at bits [0, end_bit) only: right when every key agrees with the
  // first above them. It is run with the caller's guess `key_bits` (a few radix passes instead
  // of eight for small ids); the one read-back tells whether the keys fit, else it runs again
  // on all 64 bits.
  const auto sort_and_scatter = [&](int end_bit) {
    const auto n32 = static_cast<int>(n);
    const int shift = shift_for(end_bit);
    if (shift != prepared) {
      prepared = shift;
      prepare(shift);
    }
    SortedTables sorted{t_out, nullptr, nullptr, 0};
    if (narrow(shift)) {  // one sort of the combined 32-bit keys
      cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(temp, bytes, k32_in, k32_out,
                                               positions,
                                               order32, n32, 0,
                                               shift + table_bits, stream);
      });
      sorted = SortedTables{nullptr, nullptr, k32_out, shift};
    } else if (shift > 0) {  // one sort of the combined keys
      cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(temp, bytes, k_in, k_out,
                                               positions,
                                               order32, n32, 0,
                                               shift + table_bits, stream);
      });
      sorted = SortedTables{nullptr, k_out, nullptr, shift};
    } else {  // by key, then (stably) by table
      cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(temp, bytes, k_in, k_out,
                                               positions,
                                               by_key, n32, 0, end_bit,
                                               stream);
      });
      dedup_permute_tables_kernel<<<dedup_blocks(n), kDedupThreads, 0, stream>>>(
          t_in, by_key, n, t_key);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
        return cub::DeviceRadixSort::SortPairs(temp, bytes, t_key, t_out,
                                               by_key,
                                               order32, n32, 0, table_bits,
                                               stream);
      });
    }
    // Combined sort keys give the first flags on the fly (in the scan and the scatter);
    // otherwise one kernel writes them.
    FirstFlags flags{nullptr, sorted.combined, sorted.combined32};
    if (sorted.tables != nullptr) {
      dedup_first_kernel<<<dedup_blocks(n), kDedupThreads, 0, stream>>>(
          indices.const_data_ptr<int64_t>(), order32, sorted, n, first);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      flags = FirstFlags{first, nullptr, nullptr};
    }
    const auto first_in =
        thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), flags);
    cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
      return cub::DeviceScan::ExclusiveSum(temp, bytes, first_in, rank, n32, stream);
    });
    dedup_scatter_kernel<<<dedup_blocks(n), kDedupThreads, 0, stream>>>(
        indices.const_data_ptr<int64_t>(), order32, sorted,
        flags, rank, cnt, n,
        inverse.data_ptr<int64_t>(), order.data_ptr<int64_t>(), keys_out.data_ptr<int64_t>(),
        tables_out.data_ptr<int64_t>(), starts.data_ptr<int64_t>(),
        cnt ? counters_sorted.data_ptr<int64_t>() : nullptr, info.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (n > 0) sort_and_scatter(static_cast<int>(key_bits));
  at::Tensor host = info.cpu();  // the one sync
  const int64_t needed = bit_length(static_cast<uint64_t>(host.const_data_ptr<int64_t>()[words]));
  if (n > 0 && needed > key_bits) {  // the guess was short: sort again, read back again
    sort_and_scatter(64);
    host = info.cpu();
  }
  const at::Tensor bounds =
      dedup_bounds(host.const_data_ptr<int64_t>(), n, num_tables, features);
  const int64_t unique = bounds.const_data_ptr<int64_t>()[num_tables];
  at::Tensor counts = at::empty({unique}, opts);
  if (unique > 0) {
    at::Tensor summed;
    if (cnt) {
      summed = at::empty({n}, opts);
      cuda::cub_call(indices, [&](void* temp, size_t& bytes) {
        return cub::DeviceScan::InclusiveSum(temp, bytes,
                                             counters_sorted.const_data_ptr<int64_t>(),
                                             summed.data_ptr<int64_t>(), static_cast<int>(n),
                                             stream);
      });
    }
    dedup_counts_kernel<<<dedup_blocks(unique), kDedupThreads, 0, stream>>>(
        starts.const_data_ptr<int64_t>(), cnt ? summed.const_data_ptr<int64_t>() : nullptr,
        cnt ? counters_sorted.const_data_ptr<int64_t>() : nullptr, unique, n,
        counts.data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return {keys_out.slice(0, 0, unique), tables_out.slice(0, 0, unique), inverse, counts, order,
          starts.slice(0, 0, unique), bounds, at::scalar_tensor(needed, at::kLong)};
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
  m.impl("index_tables", &index_tables_cuda);
}

}  // namespace demb
