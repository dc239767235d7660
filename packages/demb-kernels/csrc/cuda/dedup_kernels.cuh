// The CUDA kernels of dedup_batch, dedup_launch and index_tables (bindings in dedup_cuda.cu);
// plain CUDA, no torch headers. Include this header from one .cu file only: it defines kernels.
#pragma once

#include <cstdint>

#include "cuda/device_clock.cuh"
#include "dedup_checks.h"

namespace demb {
namespace {

constexpr int kDedupThreads = 256;
constexpr uint64_t kSignBit = uint64_t{1} << 63;

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

// The feature of index i: feature f owns [offsets[f * B], offsets[(f + 1) * B]) (the last
// feature whose first bag starts at or before i; feature 0 if none).
__device__ int64_t feature_of(int64_t i, const int64_t* __restrict__ offsets, int64_t features,
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
  return lo;
}

// The table of index i (its feature's: feature_of).
__device__ int64_t table_of(int64_t i, const int64_t* __restrict__ offsets,
                            const int64_t* __restrict__ feature_tables, int64_t features,
                            int64_t batch_size) {
  return feature_tables[feature_of(i, offsets, features, batch_size)];
}

// Entries per thread of dedup_prepare_kernel: a block reduces its checks' words once for
// kPrepareItems * kDedupThreads indices, and finds their feature once when they share one.
constexpr int kPrepareItems = 4;

unsigned prepare_blocks(int64_t n) {
  constexpr int64_t per_block = int64_t{kPrepareItems} * kDedupThreads;
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

// Per index: its table (into `tables`, unless null: the packed keys carry it), its sort key
// (sign bit flipped: signed order; its low `low_bits` bits, `low`, under the table when packed:
// with radix > 0 as table * radix + low, valid when every low < radix (the gate checks
// *low_max), else with table_shift > 0 as (table << table_shift) | low (table_shift =
// low_bits); into keys32 instead of keys when that fits 32 bits, halving the sort's key
// traffic), its position; the batch's checks into info (after the T per-table
// words); into *varying the bits in which some key differs from the first (OR of key ^ key 0)
// and into *low_max the largest low (both reduced per thread, warp and block first). A thread
// takes kPrepareItems indices a block apart (prepare_blocks); the block's indices take the
// feature of its first and last when those agree (the features own consecutive ranges when the
// offsets are in order; when they are not, the checks fail and the keys are not used). Block 0's
// first thread writes the global timer, read once, into clock[0, clock_words) (dedup_launch's
// clock words: a training forward's timed scores, with no launch of their own).
__global__ void __launch_bounds__(kDedupThreads)
    dedup_prepare_kernel(const int64_t* __restrict__ indices,
                         const int64_t* __restrict__ offsets, int64_t bags,
                         const int64_t* __restrict__ feature_tables, int64_t features,
                         int64_t batch_size, const int64_t* __restrict__ counters, int64_t n,
                         int64_t num_tables, int low_bits, int table_shift, uint64_t radix,
                         uint64_t* __restrict__ keys, uint32_t* __restrict__ keys32,
                         uint32_t* __restrict__ tables, int32_t* __restrict__ positions,
                         int64_t* __restrict__ info, int64_t* __restrict__ varying,
                         int64_t* __restrict__ low_max, int64_t* __restrict__ clock,
                         int64_t clock_words) {
  __shared__ unsigned long long block_varying;
  __shared__ unsigned long long block_low;
  __shared__ int64_t block_feature;  // the feature of every index of the block, or -1
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x * kPrepareItems;
  if (threadIdx.x == 0) {
    if (blockIdx.x == 0 && clock_words > 0) {
      const int64_t now = cuda::global_timer();
      for (int64_t t = 0; t < clock_words; ++t) clock[t] = now;
    }
    block_varying = 0;
    block_low = 0;
    const int64_t last = min(first + int64_t{blockDim.x} * kPrepareItems, n) - 1;
    const int64_t f = first < n ? feature_of(first, offsets, features, batch_size) : -1;
    block_feature = f >= 0 && f == feature_of(last, offsets, features, batch_size) ? f : -1;
  }
  __syncthreads();
  const int64_t shared_feature = block_feature;
  const int64_t key0 = n > 0 ? indices[0] : 0;
  unsigned long long diff = 0;
  unsigned long long low = 0;
#pragma unroll
  for (int r = 0; r < kPrepareItems; ++r) {
    const int64_t i = first + int64_t{r} * blockDim.x + threadIdx.x;
    check_batch_entry(i, indices, offsets, bags, feature_tables, features, batch_size, counters,
                      n, num_tables, info + num_tables);
    if (i >= n) continue;
    const uint64_t key = static_cast<uint64_t>(indices[i]) ^ kSignBit;
    const int64_t f =
        shared_feature >= 0 ? shared_feature : feature_of(i, offsets, features, batch_size);
    const auto table = static_cast<uint32_t>(feature_tables[f]);
    const uint64_t mine = low_bits >= 64 ? key : key & ((uint64_t{1} << low_bits) - 1);
    uint64_t sort_key = key;
    if (radix != 0) {
      sort_key = static_cast<uint64_t>(table) * radix + mine;
    } else if (table_shift != 0) {
      sort_key = (static_cast<uint64_t>(table) << table_shift) | mine;
    }
    if (keys32 != nullptr) {
      keys32[i] = static_cast<uint32_t>(sort_key);
    } else {
      keys[i] = sort_key;
    }
    if (tables != nullptr) tables[i] = table;
    positions[i] = static_cast<int32_t>(i);
    diff |= static_cast<unsigned long long>(indices[i] ^ key0);
    low = mine > low ? mine : low;
  }
  // Reduced per warp first: one shared atomic per warp, not per thread.
  const unsigned lo = __reduce_or_sync(0xFFFFFFFFu, static_cast<unsigned>(diff));
  const unsigned hi = __reduce_or_sync(0xFFFFFFFFu, static_cast<unsigned>(diff >> 32));
  for (int offset = 16; offset > 0; offset /= 2) {
    const unsigned long long other = __shfl_xor_sync(0xFFFFFFFFu, low, offset);
    low = other > low ? other : low;
  }
  if ((threadIdx.x % 32) == 0) {
    if (lo | hi) atomicOr(&block_varying, (static_cast<unsigned long long>(hi) << 32) | lo);
    if (low) atomicMax(&block_low, low);
  }
  __syncthreads();
  if (threadIdx.x == 0 && block_varying) {
    atomicOr(reinterpret_cast<unsigned long long*>(varying), block_varying);
  }
  if (threadIdx.x == 0 && block_low) {
    atomicMax(reinterpret_cast<unsigned long long*>(low_max), block_low);
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

// The table of entry k of the (table, key) order: sorted tables, or from the sorted combined
// keys (dedup_prepare_kernel's packing), 64- or 32-bit: their quotient by `radix` when it is
// set, else their bits from `shift` up.
struct SortedTables {
  const uint32_t* tables;
  const uint64_t* combined;
  const uint32_t* combined32;
  int shift;
  uint64_t radix;
  __device__ __forceinline__ uint32_t operator[](int64_t k) const {
    if (tables != nullptr) return tables[k];
    if (combined32 != nullptr) {
      return radix != 0 ? combined32[k] / static_cast<uint32_t>(radix) : combined32[k] >> shift;
    }
    return static_cast<uint32_t>(radix != 0 ? combined[k] / radix : combined[k] >> shift);
  }
  // Whether the sort keys are combined (table and low key bits): key() then applies.
  __device__ __forceinline__ bool packed() const { return tables == nullptr; }
  // The key of entry k rebuilt from its combined sort key: its low `low_bits` bits (sign bit
  // flipped, below the table) from there, the bits above them those of `flipped0` (the first
  // index's, sign bit flipped), which every key shares whenever the dedup's outputs are used
  // (else the gate stays shut, or dedup_batch sorts again on all 64 bits): the scatter then
  // reads no index at a random position.
  __device__ __forceinline__ int64_t key(int64_t k, uint64_t flipped0, int low_bits) const {
    uint64_t low = 0;
    if (combined32 != nullptr) {
      const uint32_t c = combined32[k];
      low = radix != 0 ? c % static_cast<uint32_t>(radix) : c & ((uint32_t{1} << shift) - 1u);
    } else {
      const uint64_t c = combined[k];
      low = radix != 0 ? c % radix : c & ((uint64_t{1} << shift) - 1);
    }
    const uint64_t mask = (uint64_t{1} << low_bits) - 1;  // low_bits < 64 when combined
    return static_cast<int64_t>(((flipped0 & ~mask) | low) ^ kSignBit);
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

// dedup_launch's gate (see DedupGate) from the words the dedup left in info: U (the last
// table bound) and the go flag.
struct DedupGate {
  int64_t* info;       // null: no gate (dedup_batch)
  int64_t num_tables;  // T
  int64_t words;       // W: info[W] varying bits, [W + 1] low max, [W + 2] blocks done,
                       // [W + 3] U, [W + 4] go (written here)
  int64_t key_bits;
  uint64_t radix;
  // info[W + 3] = U, info[W + 4] = 1 when every check passed, no key differs from the first
  // above key_bits (the sort looked at enough bits) and, with a radix, every low < radix.
  __device__ void write() const {
    volatile int64_t* w = info;
    int64_t unique = 0;
    for (int64_t t = 0; t < num_tables; ++t) unique = w[t] > unique ? w[t] : unique;
    bool go = key_bits >= 64 || (static_cast<uint64_t>(w[words]) >> key_bits) == 0;
    go = go && (radix == 0 || static_cast<uint64_t>(w[words + 1]) < radix);
    for (int64_t f = 0; f < kDedupFlags; ++f) go = go && w[num_tables + f] == 0;
    w[words + 3] = unique;
    w[words + 4] = go ? 1 : 0;
  }
};

// Scatters entry k: its index's unique key (inverse), the order, and for the first entry of a
// key that key, its table and start; the last entry of each table writes the table's end
// (info[t], the number of unique keys up to it; only for t < T: keys packed with a radix they
// do not fit give other quotients, and the gate then stays shut). Also gathers the counters in
// order. With a gate, the block that finishes last writes it (the table ends fenced first).
// The keys come from the sorted combined keys when there are some (`low_bits`: the key bits
// they hold), else from indices.
__global__ void dedup_scatter_kernel(const int64_t* __restrict__ indices,
                                     const int32_t* __restrict__ order32, SortedTables tables,
                                     int low_bits, FirstFlags first,
                                     const int64_t* __restrict__ rank_excl,
                                     const int64_t* __restrict__ counters, int64_t n,
                                     int64_t* __restrict__ inverse, int64_t* __restrict__ order,
                                     int64_t* __restrict__ keys_out,
                                     int64_t* __restrict__ tables_out,
                                     int64_t* __restrict__ starts,
                                     int64_t* __restrict__ counters_sorted,
                                     int64_t* __restrict__ info, int64_t num_tables,
                                     DedupGate gate) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < n) {
    const int64_t p = order32[k];
    const int64_t starts_key = first(k);
    const int64_t u = rank_excl[k] + starts_key - 1;
    inverse[p] = u;
    order[k] = p;
    if (counters) counters_sorted[k] = counters[p];
    if (starts_key) {
      keys_out[u] = tables.packed()
                        ? tables.key(k, static_cast<uint64_t>(indices[0]) ^ kSignBit, low_bits)
                        : indices[p];
      tables_out[u] = tables[k];
      starts[u] = k;
    }
    if (k == n - 1 || first(k + 1)) {  // a table ends where a key does: its table read there
      const uint32_t t = tables[k];
      if ((k == n - 1 || tables[k + 1] != t) && t < num_tables) {
        info[t] = u + 1;
        if (gate.info != nullptr) __threadfence();  // before this block counts itself done
      }
    }
  }
  if (gate.info == nullptr) return;  // the same for the whole grid
  __syncthreads();
  if (threadIdx.x == 0) {
    auto* done = reinterpret_cast<unsigned long long*>(gate.info + gate.words + 2);
    if (atomicAdd(done, 1ull) == gridDim.x - 1) {  // the last block: every table end is out
      __threadfence();
      gate.write();
    }
  }
}

// counts[u]: the occurrences of key u, or the sum of its counters (summed: inclusive prefix sums
// of the counters in order), for u < unique, or with `gate` (dedup_gate_kernel's words), for
// u < gate[0] when gate[1] is set (none otherwise).
__global__ void dedup_counts_kernel(const int64_t* __restrict__ starts,
                                    const int64_t* __restrict__ summed,
                                    const int64_t* __restrict__ counters_sorted, int64_t unique,
                                    const int64_t* __restrict__ gate, int64_t n,
                                    int64_t* __restrict__ counts) {
  const int64_t u = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t limit = gate == nullptr ? unique : (gate[1] != 0 ? gate[0] : 0);
  if (u >= limit) return;
  const int64_t end = u + 1 < limit ? starts[u + 1] : n;
  counts[u] = summed ? summed[end - 1] - summed[starts[u]] + counters_sorted[starts[u]]
                     : end - starts[u];
}

// dedup_launch's gate when no scatter ran (no index).
__global__ void dedup_gate_kernel(DedupGate gate) { gate.write(); }

}  // namespace
}  // namespace demb
