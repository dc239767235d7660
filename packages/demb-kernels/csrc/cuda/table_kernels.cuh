// CUDA kernels of the scored hash table (HASH_TABLE.md); plain CUDA, no torch headers.
//
// What the ops share, and phase A: a tile of 8 lanes per key, each lane covering 16 slots of
// every 128-slot step through the bucket. Phase B is in table_bucket.cuh. The choices are those
// of the CPU kernels (cpu/table_cpu.cpp): same bucket, same empty slot, same victim.
#pragma once

#include <cooperative_groups.h>

#include <cstdint>

#include "table_rule.h"

namespace demb {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;
constexpr int kFindTile = 8;  // lanes per key in lookups (16 slots per lane and step)

namespace cg = cooperative_groups;

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

__device__ __forceinline__ bool valid_entry(const TableView& v, int64_t key, int64_t t) {
  return t >= 0 && t < v.num_tables && key != kEmptyKey;
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

// Global slot of `key` in the bucket at global slot `base`, or -1; the same in every lane of
// the tile. Each lane compares 16 digests at once (one 16-byte load) per step.
template <typename Tile>
__device__ int64_t tile_find(const Tile& tile, const TableView& v, int64_t base, int64_t width,
                             int64_t key, uint8_t digest) {
  const int lane = static_cast<int>(tile.thread_rank());
  const uint32_t pattern = 0x01010101u * digest;
  const int64_t step = 16 * static_cast<int64_t>(tile.num_threads());
  for (int64_t c = 0; c < width; c += step) {
    const int64_t j0 = c + 16 * lane;
    int64_t hit = -1;
    if (j0 < width) {
      const uint4 d = *reinterpret_cast<const uint4*>(v.digests + base + j0);
      const uint32_t words[4] = {d.x, d.y, d.z, d.w};
      for (int q = 0; q < 4; ++q) {
        uint32_t m = __vcmpeq4(words[q] & 0x7F7F7F7Fu, pattern);
        while (m) {
          const int b = (__ffs(m) - 1) >> 3;
          const int64_t g = base + j0 + 4 * q + b;
          if (v.keys[g] == key) hit = g;
          m &= ~(0xFFu << (8 * b));
        }
      }
    }
    const unsigned mask = tile.ballot(hit >= 0);
    if (mask) return tile.shfl(hit, __ffs(mask) - 1);
  }
  return -1;
}

// Lookup / phase A: one tile of kFindTile lanes per key. With score_args, touch found keys
// (atomically: other tiles may touch the same key). With `sort_keys`, also write each key's
// phase-B sort key: (its bucket's global start slot << 1) | hit; invalid entries miss, are
// FAILED (status) and get `skip`.
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock, 8)
    lookup_kernel(TableView v, BatchIn in, BatchOut out, uint64_t* sort_keys, uint64_t skip) {
  const auto tile = cg::tiled_partition<kFindTile>(cg::this_thread_block());
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kFindTile;
  if (i >= in.n) return;
  const bool leader = tile.thread_rank() == 0;
  const int64_t key = in.keys[i];
  const int64_t t = in.table_ids[i];
  if (!valid_entry(v, key, t)) {
    if (leader) {
      out.slots[i] = -1;
      if (out.status) out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
      if (sort_keys) sort_keys[i] = skip;
    }
    return;
  }
  const int64_t width = v.bucket_widths[t];
  const Home home = home_of(key, v.capacity(t), width);
  const int64_t base = v.slot_offsets[t] + home.bucket_base;
  const int64_t g = tile_find(tile, v, base, width, key, home.digest);
  if (!leader) return;
  out.slots[i] = g < 0 ? -1 : g - v.slot_offsets[t];
  if (sort_keys) sort_keys[i] = (static_cast<uint64_t>(base) << 1) | (g < 0 ? 0 : 1);
  if (out.status) out.status[i] = static_cast<int64_t>(InsertStatus::kHit);
  if (g < 0 || !in.score_args) return;
  const auto policy = static_cast<ScorePolicy>(v.policies[t]);
  if (policy_counts(policy)) {
    atomic_sat_add(&v.score(0, g), in.counts ? in.counts[i] : 1);
    if (policy == ScorePolicy::kTimestampLfu) v.score(1, g) = in.score_args[t];
  } else {
    v.score(0, g) = in.score_args[t];
  }
}

inline unsigned blocks_for_tiles(int64_t tiles) {
  const int64_t per_block = kWarpsPerBlock * kWarp / kFindTile;
  return static_cast<unsigned>((tiles + per_block - 1) / per_block);
}

// Phase-B sort keys of every entry (insert_or_assign, erase): bucket start << 1, or `skip`.
__global__ void bucket_keys_kernel(TableView v, BatchIn in, BatchOut out, uint64_t* sort_keys,
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
  sort_keys[i] = static_cast<uint64_t>(v.slot_offsets[t] + home.bucket_base) << 1;
}

__global__ void timestamp_kernel(int64_t* out) {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  *out = static_cast<int64_t>(now);
}

}  // namespace cuda
}  // namespace demb
