// Phase B of the table ops for wide buckets (kWideBucket slots or more): one warp per run,
// its keys in batch order as bucket_kernel takes them, each searched by the 32 lanes together.
// A thread alone scans a full 1024-slot bucket once per missing key (a cache of 36 such buckets
// a table, a step's ~600 missing keys each, waited on one thread per bucket); a warp reads the
// bucket 32 slots at a time. Same slots as ThreadSearch: the first empty slot in circular order
// from the key's start, else the unprotected slot with the smallest (score tuple, circular
// distance), a strict total order, so the lanes' minimum is the thread's pick.
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/table_bucket.cuh"

namespace demb {
namespace cuda {

constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kWideBlocksPerSm = 4;  // bucket_warp_kernel's resident blocks per SM

// A warp's search of one bucket (every lane calls each function, converged; each returns the
// same global slot, or -1, on every lane). Lane 0 leads: it writes the step's results.
struct WarpSearch {
  int lane;

  // The key's slot: a key is in its bucket at most once, so any lane's match is the slot.
  __device__ int64_t find(const TableView& v, int64_t base, int64_t width, int64_t key,
                          uint8_t digest, int64_t /*start*/) const {
    const uint32_t pattern = 0x01010101u * digest;
    int64_t mine = -1;
    for (int64_t j0 = lane * kDigestChunk; j0 < width; j0 += kWarp * kDigestChunk) {
      uint32_t m = chunk_mask(load_digests(v, base + j0),
                              [&](uint32_t w) { return __vcmpeq4(w & 0x7F7F7F7Fu, pattern); });
      while (m) {
        const int j = __ffs(m) - 1;
        m &= m - 1;
        if (v.keys[base + j0 + j] == key) mine = base + j0 + j;
      }
    }
    const unsigned who = __ballot_sync(kFullMask, mine >= 0);
    return who == 0 ? -1 : __shfl_sync(kFullMask, mine, __ffs(who) - 1);
  }

  // The empty slot nearest `start` in circular order (thread_first_empty's).
  __device__ int64_t first_empty(const TableView& v, int64_t base, int64_t width,
                                 int64_t start) const {
    unsigned best = UINT_MAX;
    for (int64_t j0 = lane * kDigestChunk; j0 < width; j0 += kWarp * kDigestChunk) {
      uint32_t m = chunk_mask(load_digests(v, base + j0),
                              [](uint32_t w) { return __vcmpeq4(w, 0u); });
      while (m) {
        const int j = __ffs(m) - 1;
        m &= m - 1;
        best = min(best, static_cast<unsigned>(circular(j0 + j, start, width)));
      }
    }
    best = __reduce_min_sync(kFullMask, best);
    return best == UINT_MAX ? -1 : base + static_cast<int64_t>(mod_u64(start + best, width));
  }

  // thread_victim's pick: each lane's best of the slots lane, lane + 32, ..., then the warp's.
  __device__ int64_t victim(const TableView& v, int64_t base, int64_t width, int64_t start,
                            bool by_rank) const {
    int64_t best = -1, b0 = 0, b1 = 0, bd = 0;
    for (int64_t j = lane; j < width; j += kWarp) {
      const int64_t g = base + j;
      if (v.digests[g] >= kProtectedBit) continue;
      int64_t s0 = 0, s1 = 0;
      victim_words(v, by_rank, g, s0, s1);
      const int64_t dist = circular(j, start, width);
      if (best < 0 || victim_before(s0, s1, dist, b0, b1, bd)) {
        best = g;
        b0 = s0;
        b1 = s1;
        bd = dist;
      }
    }
    for (int o = kWarp / 2; o > 0; o >>= 1) {
      const int64_t ob = __shfl_xor_sync(kFullMask, best, o);
      const int64_t o0 = __shfl_xor_sync(kFullMask, b0, o);
      const int64_t o1 = __shfl_xor_sync(kFullMask, b1, o);
      const int64_t od = __shfl_xor_sync(kFullMask, bd, o);
      if (ob >= 0 && (best < 0 || victim_before(o0, o1, od, b0, b1, bd))) {
        best = ob;
        b0 = o0;
        b1 = o1;
        bd = od;
      }
    }
    return best;
  }

  __device__ bool leads() const { return lane == 0; }
};

// Phase B of the runs bucket_kernel left in runs.wide: one warp per run (a grid of resident
// blocks, each warp taking runs a grid apart), bucket_kernel's steps with a WarpSearch. Lane 0
// writes; __syncwarp after each key makes its writes (the new slot's protection) seen by every
// lane before the next key's search.
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock)
    bucket_warp_kernel(TableView v, BucketOp op, BatchIn in, BatchOut out, Runs runs) {
  __shared__ unsigned long long deltas[kSharedTables];
  clear_sizes(deltas);
  const int lane = static_cast<int>(threadIdx.x % kWarp);
  const WarpSearch search{lane};
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const int32_t wide = *runs.wide_count;
  const int32_t count = *runs.count;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       w < wide; w += warps) {
    const int64_t r = runs.wide[w];
    const MissRun m = miss_run(v, in, runs, r, count, runs.keys[r]);
    set_protection(v, out.slots, runs.positions, m.hit_begin, m.hit_end, m.offset, true, lane,
                   kWarp);
    __syncwarp();
    int64_t delta = 0;
    for (int32_t q = m.begin; q < m.end; ++q) {
      const bool missing = op == BucketOp::kInsert && q == m.begin;
      delta += bucket_step(v, op, in, out, runs.positions[q], missing, search);
      __syncwarp();
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
  const int64_t needed = (n + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t resident = static_cast<int64_t>(sms) * kWideBlocksPerSm;
  return static_cast<unsigned>(needed < resident ? needed : resident);
}

}  // namespace cuda
}  // namespace demb
