// CUDA kernels of the scored hash table (HASH_TABLE.md); plain CUDA, no torch headers.
//
// One warp per key (lookups, phase A) or per bucket (phase B: the bucket's keys in batch order),
// each lane covering 4 slots of every 128-slot chunk of the bucket. The choices are those of
// the CPU kernels (cpu/table_cpu.cpp): same bucket, same empty slot, same victim.
#pragma once

#include <cstdint>

#include "table_rule.h"

namespace demb {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr unsigned kFull = 0xffffffffu;
constexpr int64_t kChunk = 4 * kWarp;  // slots a warp covers per step

struct DeviceView {
  int64_t* keys;
  uint8_t* digests;
  int64_t* scores;  // word w of global slot g at scores[w * num_slots + g]
  int64_t num_slots;
  int64_t words;
  const int64_t* slot_offsets;
  const int64_t* bucket_widths;
  const int64_t* policies;
  int64_t num_tables;
  int64_t* sizes;

  __device__ int64_t& score(int64_t w, int64_t g) const { return scores[w * num_slots + g]; }
  __device__ int64_t capacity(int64_t t) const { return slot_offsets[t + 1] - slot_offsets[t]; }
};

struct BatchIn {
  const int64_t* keys;
  const int64_t* table_ids;
  const int64_t* score_args;     // may be null (lookup without touch)
  const int64_t* counts;         // may be null (1 each)
  const int64_t* assign_scores;  // (W, N), insert_or_assign only
  int64_t n;
};

struct BatchOut {
  int64_t* slots;
  int64_t* status;         // null for lookup / erase
  int64_t* victim_keys;    // null for lookup / erase
  int64_t* victim_scores;  // (W, N), null for lookup / erase
};

inline unsigned blocks_for_warps(int64_t warps) {
  return static_cast<unsigned>((warps + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

__device__ __forceinline__ int64_t warp_index() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}

__device__ __forceinline__ bool valid_entry(const DeviceView& v, int64_t key, int64_t t) {
  return t >= 0 && t < v.num_tables && key != kEmptyKey;
}

__device__ __forceinline__ uint32_t digest_word(const DeviceView& v, int64_t g) {
  return *reinterpret_cast<const uint32_t*>(v.digests + g);
}

// Global slot of `key` in the bucket at global slot `base`, or -1; the same in every lane.
__device__ int64_t warp_find(const DeviceView& v, int64_t base, int64_t width, int64_t key,
                             uint8_t digest, int lane) {
  for (int64_t c = 0; c < width; c += kChunk) {
    const int64_t j0 = c + 4 * lane;
    int64_t hit = -1;
    if (j0 < width) {
      const uint32_t word = digest_word(v, base + j0);
      for (int b = 0; b < 4; ++b) {
        const uint32_t d = (word >> (8 * b)) & 0x7Fu;
        if (d == digest && v.keys[base + j0 + b] == key) hit = base + j0 + b;
      }
    }
    const unsigned mask = __ballot_sync(kFull, hit >= 0);
    if (mask) return __shfl_sync(kFull, hit, __ffs(mask) - 1);
  }
  return -1;
}

__device__ __forceinline__ void atomic_sat_add(int64_t* word, int64_t count) {
  auto* addr = reinterpret_cast<unsigned long long*>(word);
  unsigned long long old = *addr;
  unsigned long long assumed;
  do {
    assumed = old;
    const int64_t next = sat_add(static_cast<int64_t>(assumed), count);
    old = atomicCAS(addr, assumed, static_cast<unsigned long long>(next));
  } while (old != assumed);
}

__device__ __forceinline__ void atomic_protect(uint8_t* digests, int64_t g) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(digests + g);
  auto* word = reinterpret_cast<unsigned*>(addr & ~uintptr_t{3});
  atomicOr(word, static_cast<unsigned>(kProtectedBit) << (8 * (addr & 3)));
}

// Lookup / phase A: one warp per key. With score_args, touch found keys (atomically: other
// warps may touch the same key); with `protect`, mark them protected. With `sort_keys`, also
// write each key's phase-B sort key: its bucket's global start slot if it missed, else `skip`;
// invalid entries miss and are FAILED (status) and skipped.
__global__ void lookup_kernel(DeviceView v, BatchIn in, BatchOut out, bool protect,
                              uint64_t* sort_keys, uint64_t skip) {
  const int64_t i = warp_index();
  if (i >= in.n) return;
  const int lane = threadIdx.x % kWarp;
  const int64_t key = in.keys[i];
  const int64_t t = in.table_ids[i];
  if (!valid_entry(v, key, t)) {
    if (lane == 0) {
      out.slots[i] = -1;
      if (out.status) out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
      if (sort_keys) sort_keys[i] = skip;
    }
    return;
  }
  const int64_t width = v.bucket_widths[t];
  const Home home = home_of(key, v.capacity(t), width);
  const int64_t base = v.slot_offsets[t] + home.bucket_base;
  const int64_t g = warp_find(v, base, width, key, home.digest, lane);
  if (lane != 0) return;
  out.slots[i] = g < 0 ? -1 : g - v.slot_offsets[t];
  if (sort_keys) sort_keys[i] = g < 0 ? static_cast<uint64_t>(base) : skip;
  if (out.status) out.status[i] = static_cast<int64_t>(InsertStatus::kHit);
  if (g < 0) return;
  if (in.score_args) {
    const auto policy = static_cast<ScorePolicy>(v.policies[t]);
    if (policy_counts(policy)) {
      atomic_sat_add(&v.score(0, g), in.counts ? in.counts[i] : 1);
      if (policy == ScorePolicy::kTimestampLfu) v.score(1, g) = in.score_args[t];
    } else {
      v.score(0, g) = in.score_args[t];
    }
  }
  if (protect) atomic_protect(v.digests, g);
}

// Phase-B sort keys of every entry (insert_or_assign, erase): bucket start or `skip`.
__global__ void bucket_keys_kernel(DeviceView v, BatchIn in, BatchOut out, uint64_t* sort_keys,
                                   uint64_t skip) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= in.n) return;
  const int64_t key = in.keys[i];
  const int64_t t = in.table_ids[i];
  if (!valid_entry(v, key, t)) {
    out.slots[i] = -1;
    if (out.status) out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
    sort_keys[i] = skip;
    return;
  }
  const Home home = home_of(key, v.capacity(t), v.bucket_widths[t]);
  sort_keys[i] = static_cast<uint64_t>(v.slot_offsets[t] + home.bucket_base);
}

__device__ __forceinline__ unsigned warp_min_u32(unsigned value) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_min_sync(kFull, value);
#else
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    value = min(value, __shfl_xor_sync(kFull, value, offset));
  }
  return value;
#endif
}

struct Victim {
  bool have;
  int64_t s0, s1, dist;
};

__device__ __forceinline__ Victim warp_min_victim(Victim mine) {
  for (int offset = kWarp / 2; offset > 0; offset /= 2) {
    Victim other;
    other.have = __shfl_xor_sync(kFull, static_cast<int>(mine.have), offset) != 0;
    other.s0 = __shfl_xor_sync(kFull, mine.s0, offset);
    other.s1 = __shfl_xor_sync(kFull, mine.s1, offset);
    other.dist = __shfl_xor_sync(kFull, mine.dist, offset);
    if (other.have &&
        (!mine.have ||
         victim_before(other.s0, other.s1, other.dist, mine.s0, mine.s1, mine.dist))) {
      mine = other;
    }
  }
  return mine;
}

// The slot (global) where a missing key goes: the first empty slot in circular order, else
// (if the policy evicts) the lowest-score unprotected slot; -1 if none. Same in every lane.
__device__ int64_t warp_target(const DeviceView& v, int64_t base, int64_t width, int64_t start,
                               bool evicts, int lane, bool& evicted) {
  unsigned best = 0xffffffffu;
  for (int64_t c = 0; c < width; c += kChunk) {
    const int64_t j0 = c + 4 * lane;
    if (j0 >= width) continue;
    const uint32_t word = digest_word(v, base + j0);
    for (int b = 0; b < 4; ++b) {
      if (((word >> (8 * b)) & 0xFFu) == 0) {
        best = min(best, static_cast<unsigned>(circular(j0 + b, start, width)));
      }
    }
  }
  best = warp_min_u32(best);
  evicted = false;
  if (best != 0xffffffffu) return base + (start + best) % width;
  if (!evicts) return -1;
  Victim mine{false, 0, 0, 0};
  for (int64_t c = 0; c < width; c += kChunk) {
    const int64_t j0 = c + 4 * lane;
    if (j0 >= width) continue;
    const uint32_t word = digest_word(v, base + j0);
    for (int b = 0; b < 4; ++b) {
      if ((word >> (8 * b)) & kProtectedBit) continue;
      const int64_t g = base + j0 + b;
      const Victim cand{true, v.score(0, g), v.words > 1 ? v.score(1, g) : 0,
                        circular(j0 + b, start, width)};
      if (!mine.have || victim_before(cand.s0, cand.s1, cand.dist, mine.s0, mine.s1, mine.dist)) {
        mine = cand;
      }
    }
  }
  mine = warp_min_victim(mine);
  if (!mine.have) return -1;
  evicted = true;
  return base + (start + mine.dist) % width;
}

__device__ __forceinline__ void write_slot(const DeviceView& v, int64_t g, int64_t key,
                                           uint8_t digest, const int64_t* words) {
  v.keys[g] = key;
  v.digests[g] = digest | kProtectedBit;
  for (int64_t w = 0; w < v.words; ++w) v.score(w, g) = words[w];
}

// One key of phase B; the calling warp owns the key's bucket. Lane 0 writes.
__device__ void warp_bucket_step(const DeviceView& v, BucketOp op, const BatchIn& in,
                                 const BatchOut& out, int64_t i, int lane) {
  const int64_t key = in.keys[i];
  const int64_t t = in.table_ids[i];
  const int64_t width = v.bucket_widths[t];
  const Home home = home_of(key, v.capacity(t), width);
  const int64_t base = v.slot_offsets[t] + home.bucket_base;
  const auto policy = static_cast<ScorePolicy>(v.policies[t]);
  const int64_t found = warp_find(v, base, width, key, home.digest, lane);
  const int64_t offset = v.slot_offsets[t];
  const int64_t count = in.counts ? in.counts[i] : 1;
  int64_t words[2] = {0, 0};
  if (op == BucketOp::kErase) {
    if (lane == 0) {
      out.slots[i] = found < 0 ? -1 : found - offset;
      if (found >= 0) {
        v.keys[found] = kEmptyKey;
        v.digests[found] = 0;
        for (int64_t w = 0; w < v.words; ++w) v.score(w, found) = 0;
        atomicAdd(reinterpret_cast<unsigned long long*>(&v.sizes[t]),
                  static_cast<unsigned long long>(-1LL));
      }
    }
  } else if (found >= 0) {
    if (lane == 0) {
      if (op == BucketOp::kAssign) {
        for (int64_t w = 0; w < v.words; ++w) words[w] = in.assign_scores[w * in.n + i];
      } else {
        for (int64_t w = 0; w < v.words; ++w) words[w] = v.score(w, found);
        touch_scores(policy, false, in.score_args[t], count, words[0], words[1]);
      }
      write_slot(v, found, key, home.digest, words);
      out.slots[i] = found - offset;
      out.status[i] = static_cast<int64_t>(InsertStatus::kHit);
    }
  } else {
    bool evicted = false;
    const int64_t target =
        warp_target(v, base, width, home.start, policy_evicts(policy), lane, evicted);
    if (lane == 0) {
      if (target < 0) {
        out.slots[i] = -1;
        out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
      } else {
        if (evicted) {
          out.victim_keys[i] = v.keys[target];
          for (int64_t w = 0; w < v.words; ++w) {
            out.victim_scores[w * in.n + i] = v.score(w, target);
          }
        } else {
          atomicAdd(reinterpret_cast<unsigned long long*>(&v.sizes[t]), 1ULL);
        }
        if (op == BucketOp::kAssign) {
          for (int64_t w = 0; w < v.words; ++w) words[w] = in.assign_scores[w * in.n + i];
        } else {
          touch_scores(policy, true, in.score_args[t], count, words[0], words[1]);
        }
        write_slot(v, target, key, home.digest, words);
        out.slots[i] = target - offset;
        out.status[i] = static_cast<int64_t>(evicted ? InsertStatus::kEvicted
                                                     : InsertStatus::kInserted);
      }
    }
  }
  __syncwarp();  // lane 0's writes are seen by the warp's next step
}

// Phase B: one warp per run of equal sort keys (one bucket), entries in sorted order, which is
// batch order within a bucket (the sort is stable).
__global__ void bucket_kernel(DeviceView v, BucketOp op, BatchIn in, BatchOut out,
                              const uint64_t* sorted_keys, const int32_t* sorted_pos,
                              uint64_t skip) {
  const int64_t p = warp_index();
  if (p >= in.n) return;
  const uint64_t bucket = sorted_keys[p];
  if (bucket == skip || (p > 0 && sorted_keys[p - 1] == bucket)) return;
  const int lane = threadIdx.x % kWarp;
  for (int64_t q = p; q < in.n && sorted_keys[q] == bucket; ++q) {
    warp_bucket_step(v, op, in, out, sorted_pos[q], lane);
  }
}

// Clears the protection of every slot an op returned.
__global__ void unprotect_kernel(DeviceView v, BatchIn in, const int64_t* slots) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= in.n || slots[i] < 0) return;
  const int64_t g = v.slot_offsets[in.table_ids[i]] + slots[i];
  v.digests[g] = v.digests[g] & static_cast<uint8_t>(~kProtectedBit);
}

__global__ void timestamp_kernel(int64_t* out) {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  *out = static_cast<int64_t>(now);
}

}  // namespace cuda
}  // namespace demb
