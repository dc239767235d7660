// Phase B of the table ops for wide buckets (kWideBucket slots or more): one warp per run,
// its keys in batch order as bucket_kernel takes them, each searched by the 32 lanes together.
// A thread alone scans a full 1024-slot bucket once per missing key (a cache of 36 such buckets
// a table, a step's ~600 missing keys each, waited on one thread per bucket); a warp reads the
// bucket 32 slots at a time. A bucket of up to kStagedSlots slots is first copied into the
// warp's shared memory (digests and victim words, StagedSearch), which the lanes then search
// for every key of the run (the copy in global memory took ~8 us a key on an H100, an L2 round
// trip per 32 slots); a wider one is searched in global memory (WarpSearch). Same slots as
// ThreadSearch: the first empty slot in circular order from the key's start, else the
// unprotected slot with the smallest (score tuple, circular distance), a strict total order, so
// the lanes' minimum is the thread's pick.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/table_bucket.cuh"

namespace demb {
namespace cuda {

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kWideWarpsPerBlock = 2;  // bucket_warp_kernel's block (a StagedBucket per warp)
constexpr int kWideBlocksPerSm = 6;    // its resident blocks per SM (shared memory bound)
constexpr int64_t kStagedSlots = 1024;  // the widest bucket a warp copies to shared memory

// A warp's copy of one bucket: each slot's victim words (victim_words) and digest byte.
struct alignas(16) StagedBucket {
  int64_t w0[kStagedSlots];
  int64_t w1[kStagedSlots];
  uint8_t digests[kStagedSlots];
};

// Each lane's best slot among the candidates it saw, then the warp's (a butterfly of
// shuffles: every lane ends with the same, the order being strict and total). -1: none.
struct VictimPick {
  int64_t slot = -1, s0 = 0, s1 = 0, dist = 0;

  __device__ __forceinline__ void offer(int64_t g, int64_t a0, int64_t a1, int64_t d) {
    if (slot < 0 || victim_before(a0, a1, d, s0, s1, dist)) {
      slot = g;
      s0 = a0;
      s1 = a1;
      dist = d;
    }
  }

  __device__ __forceinline__ int64_t warp_min() {
    for (int o = kWarp / 2; o > 0; o >>= 1) {
      const int64_t og = __shfl_xor_sync(kFullMask, slot, o);
      const int64_t o0 = __shfl_xor_sync(kFullMask, s0, o);
      const int64_t o1 = __shfl_xor_sync(kFullMask, s1, o);
      const int64_t od = __shfl_xor_sync(kFullMask, dist, o);
      if (og >= 0) offer(og, o0, o1, od);
    }
    return slot;
  }
};

// The slot of the lowest circular distance among the lanes' (`best`, UINT_MAX: none), global.
__device__ __forceinline__ int64_t warp_nearest(unsigned best, int64_t base, int64_t width,
                                                int64_t start) {
  best = __reduce_min_sync(kFullMask, best);
  return best == UINT_MAX ? -1 : base + static_cast<int64_t>(mod_u64(start + best, width));
}

// The global slot some lane found (`mine`, -1: none), on every lane.
__device__ __forceinline__ int64_t warp_any(int64_t mine) {
  const unsigned who = __ballot_sync(kFullMask, mine >= 0);
  return who == 0 ? -1 : __shfl_sync(kFullMask, mine, __ffs(who) - 1);
}

// Lane `lane`'s digest chunks of a bucket (16 slots each, 32 chunks apart) read from `chunk(j0)`
// and matched: `visit(j0 + j)` for each slot j of a chunk whose digest `match`es.
template <typename Chunk, typename Match, typename Visit>
__device__ __forceinline__ void lane_chunks(int lane, int64_t width, const Chunk& chunk,
                                            const Match& match, const Visit& visit) {
  for (int64_t j0 = lane * kDigestChunk; j0 < width; j0 += kWarp * kDigestChunk) {
    uint32_t m = chunk_mask(chunk(j0), match);
    while (m) {
      const int j = __ffs(m) - 1;
      m &= m - 1;
      visit(j0 + j);
    }
  }
}

// A warp's search of one bucket in global memory (every lane calls each function, converged;
// each returns the same global slot, or -1, on every lane). Lane 0 leads: it writes the step's
// results.
struct WarpSearch {
  int lane;

  // The key's slot: a key is in its bucket at most once, so any lane's match is the slot.
  __device__ int64_t find(const TableView& v, int64_t base, int64_t width, int64_t key,
                          uint8_t digest, int64_t /*start*/) const {
    const uint32_t pattern = 0x01010101u * digest;
    int64_t mine = -1;
    lane_chunks(
        lane, width, [&](int64_t j0) { return load_digests(v, base + j0); },
        [&](uint32_t w) { return __vcmpeq4(w & 0x7F7F7F7Fu, pattern); },
        [&](int64_t j) {
          if (v.keys[base + j] == key) mine = base + j;
        });
    return warp_any(mine);
  }

  // The empty slot nearest `start` in circular order (thread_first_empty's).
  __device__ int64_t first_empty(const TableView& v, int64_t base, int64_t width,
                                 int64_t start) const {
    unsigned best = UINT_MAX;
    lane_chunks(
        lane, width, [&](int64_t j0) { return load_digests(v, base + j0); },
        [](uint32_t w) { return __vcmpeq4(w, 0u); },
        [&](int64_t j) { best = min(best, static_cast<unsigned>(circular(j, start, width))); });
    return warp_nearest(best, base, width, start);
  }

  // thread_victim's pick: each lane's best of the slots lane, lane + 32, ..., then the warp's.
  __device__ int64_t victim(const TableView& v, int64_t base, int64_t width, int64_t start,
                            bool by_rank) const {
    VictimPick pick;
    for (int64_t j = lane; j < width; j += kWarp) {
      const int64_t g = base + j;
      if (v.digests[g] >= kProtectedBit) continue;
      int64_t s0 = 0, s1 = 0;
      victim_words(v, by_rank, g, s0, s1);
      pick.offer(g, s0, s1, circular(j, start, width));
    }
    return pick.warp_min();
  }

  __device__ bool leads() const { return lane == 0; }
  __device__ void wrote(int64_t /*j*/, uint8_t /*digest*/) const {}
};

// WarpSearch over the warp's StagedBucket copy of a bucket of at most kStagedSlots slots
// (stage()): digests and victim words read from shared memory, keys from global memory; the
// leader's writes are mirrored into the copy (`wrote`). A written slot is protected until the
// run ends, so its victim words are never read again.
struct StagedSearch {
  int lane;
  StagedBucket* copy;

  // Copies the bucket at global slot `base` (its digests as they are now, protections set).
  __device__ void stage(const TableView& v, int64_t base, int64_t width, bool by_rank) const {
    for (int64_t j = lane; j < width; j += kWarp) {
      copy->digests[j] = v.digests[base + j];
      victim_words(v, by_rank, base + j, copy->w0[j], copy->w1[j]);
    }
    __syncwarp();
  }

  __device__ __forceinline__ uint4 chunk(int64_t j0) const {
    return *reinterpret_cast<const uint4*>(copy->digests + j0);
  }

  __device__ int64_t find(const TableView& v, int64_t base, int64_t width, int64_t key,
                          uint8_t digest, int64_t /*start*/) const {
    const uint32_t pattern = 0x01010101u * digest;
    int64_t mine = -1;
    lane_chunks(
        lane, width, [&](int64_t j0) { return chunk(j0); },
        [&](uint32_t w) { return __vcmpeq4(w & 0x7F7F7F7Fu, pattern); },
        [&](int64_t j) {
          if (v.keys[base + j] == key) mine = base + j;
        });
    return warp_any(mine);
  }

  __device__ int64_t first_empty(const TableView& /*v*/, int64_t base, int64_t width,
                                 int64_t start) const {
    unsigned best = UINT_MAX;
    lane_chunks(
        lane, width, [&](int64_t j0) { return chunk(j0); },
        [](uint32_t w) { return __vcmpeq4(w, 0u); },
        [&](int64_t j) { best = min(best, static_cast<unsigned>(circular(j, start, width))); });
    return warp_nearest(best, base, width, start);
  }

  __device__ int64_t victim(const TableView& /*v*/, int64_t base, int64_t width, int64_t start,
                            bool /*by_rank*/) const {
    VictimPick pick;
    for (int64_t j = lane; j < width; j += kWarp) {
      if (copy->digests[j] >= kProtectedBit) continue;
      pick.offer(base + j, copy->w0[j], copy->w1[j], circular(j, start, width));
    }
    return pick.warp_min();
  }

  __device__ bool leads() const { return lane == 0; }
  __device__ void wrote(int64_t j, uint8_t digest) const { copy->digests[j] = digest; }
};

// One run of misses of a wide bucket by a warp with `search` (bucket_kernel's steps); returns
// its table's size change (on lane 0; 0 on the others). Lane 0 writes; __syncwarp after each
// key makes its writes (the new slot's protection) seen by every lane before the next search.
template <typename Search>
__device__ int64_t warp_run(const TableView& v, BucketOp op, const BatchIn& in,
                            const BatchOut& out, const Runs& runs, const MissRun& m,
                            const Search& search) {
  int64_t delta = 0;
  for (int32_t q = m.begin; q < m.end; ++q) {
    const bool missing = op == BucketOp::kInsert && q == m.begin;
    delta += bucket_step(v, op, in, out, runs.positions[q], missing, search);
    __syncwarp();
  }
  return delta;
}

// Phase B of the runs bucket_kernel left in runs.wide: one warp per run (a grid of resident
// blocks, each warp taking runs a grid apart), its bucket's hits protected, then warp_run with
// a StagedSearch (a bucket of up to kStagedSlots slots) or a WarpSearch, then every protection
// the run set cleared.
__global__ void __launch_bounds__(kWarp * kWideWarpsPerBlock)
    bucket_warp_kernel(TableView v, BucketOp op, BatchIn in, BatchOut out, Runs runs) {
  __shared__ unsigned long long deltas[kSharedTables];
  __shared__ StagedBucket staged[kWideWarpsPerBlock];
  clear_sizes(deltas);
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const int warp = static_cast<int>(threadIdx.x / kWarp);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWideWarpsPerBlock;
  const int32_t wide = *runs.wide_count;
  const int32_t count = *runs.count;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWideWarpsPerBlock + warp; w < wide;
       w += warps) {
    const int64_t r = runs.wide[w];
    const MissRun m = miss_run(v, in, runs, r, count, runs.keys[r]);
    set_protection(v, out.slots, runs.positions, m.hit_begin, m.hit_end, m.offset, true, lane,
                   kWarp);
    __syncwarp();
    const int64_t width = v.bucket_widths[m.t];
    int64_t delta = 0;
    if (width <= kStagedSlots) {
      const StagedSearch search{lane, &staged[warp]};
      const int64_t key = in.keys[runs.positions[m.begin]];
      const int64_t base = m.offset + home_of(key, v.capacity(m.t), width).bucket_base;
      search.stage(v, base, width, v.ranks_victims(m.t));
      delta = warp_run(v, op, in, out, runs, m, search);
    } else {
      delta = warp_run(v, op, in, out, runs, m, WarpSearch{lane});
    }
    if (op != BucketOp::kErase) {
      set_protection(v, out.slots, runs.positions, m.hit_begin, m.hit_end, m.offset, false,
                     lane, kWarp);
      set_protection(v, out.slots, runs.positions, m.begin, m.end, m.offset, false, lane, kWarp);
    }
    if (lane == 0) add_size(v, deltas, m.t, delta);
    __syncwarp();
  }
  flush_sizes(v, deltas);
}

// bucket_warp_kernel's grid on `sms` SMs for a batch of `n` entries (at most n runs).
inline unsigned wide_blocks(int64_t n, int sms) {
  const int64_t needed = (n + kWideWarpsPerBlock - 1) / kWideWarpsPerBlock;
  const int64_t resident = static_cast<int64_t>(sms) * kWideBlocksPerSm;
  return static_cast<unsigned>(needed < resident ? needed : resident);
}

}  // namespace cuda
}  // namespace demb
