// Phase B of the table ops (docs/hash_table.md) on CUDA: one thread per run of a bucket's missing
// keys (or, for insert_or_assign and erase, of all its keys), in batch order. A thread owns its
// bucket, so it reads and writes it without atomics; threads of one warp own different buckets
// and never wait on each other (sub-warp tiles would serialize their divergent paths).
#pragma once

#include <cstdint>

#include "cuda/table_kernels.cuh"

namespace demb {
namespace cuda {

constexpr int kSharedTables = 32;  // tables whose size changes a block sums in shared memory

// The first empty slot of the bucket in circular order from `start`, or -1.
__device__ int64_t thread_first_empty(const TableView& v, int64_t base, int64_t width,
                                      int64_t start) {
  const auto empty = [](uint32_t w) { return __vcmpeq4(w, 0u); };
  const int64_t first = start - start % kDigestChunk;
  const uint32_t head = chunk_mask(load_digests(v, base + first), empty);
  const int s = static_cast<int>(start - first);
  const uint32_t at_or_after = head & (0xFFFFFFFFu << s);
  if (at_or_after) return base + first + __ffs(at_or_after) - 1;
  for (int64_t c = kDigestChunk; c < width; c += kDigestChunk) {
    const int64_t j0 = mod_u64(first + c, width);
    const uint32_t m = chunk_mask(load_digests(v, base + j0), empty);
    if (m) return base + j0 + __ffs(m) - 1;
  }
  if (head) return base + first + __ffs(head) - 1;  // the start chunk's slots before `start`
  return -1;
}

// The unprotected slot with the smallest score tuple (its rank with `by_rank`: victim_words),
// ties to the first in circular order from `start`; -1 if every slot is protected.
__device__ int64_t thread_victim(const TableView& v, int64_t base, int64_t width, int64_t start,
                                 bool by_rank) {
  int64_t best = -1, b0 = 0, b1 = 0, bd = 0;
  for (int64_t j0 = 0; j0 < width; j0 += kDigestChunk) {
    uint32_t open = ~chunk_mask(load_digests(v, base + j0),
                                [](uint32_t w) { return __vcmpgeu4(w, 0x80808080u); }) &
                    0xFFFFu;
    while (open) {
      const int j = __ffs(open) - 1;
      open &= open - 1;
      const int64_t g = base + j0 + j;
      int64_t s0 = 0, s1 = 0;
      victim_words(v, by_rank, g, s0, s1);
      const int64_t dist = circular(j0 + j, start, width);
      if (best < 0 || victim_before(s0, s1, dist, b0, b1, bd)) {
        best = g;
        b0 = s0;
        b1 = s1;
        bd = dist;
      }
    }
  }
  return best;
}

__device__ __forceinline__ void write_slot(const TableView& v, int64_t g, int64_t key,
                                           uint8_t digest, int64_t w0, int64_t w1) {
  v.keys[g] = key;
  v.digests[g] = digest | kProtectedBit;
  v.score(0, g) = w0;
  if (v.words > 1) v.score(1, g) = w1;
}

// One key of phase B. Returns the change of its table's size (+1 insert into an empty slot,
// -1 erase). `missing`: the key is known to be absent (the first miss of a find_or_insert run:
// phase A missed it and only this thread writes the bucket), so the bucket is not searched.
__device__ int64_t bucket_step(const TableView& v, BucketOp op, const BatchIn& in,
                               const BatchOut& out, int64_t i, bool missing) {
  const int64_t key = in.keys[i];
  const int64_t t = in.table_ids[i];
  const int64_t width = v.bucket_widths[t];
  const Home home = home_of(key, v.capacity(t), width);
  const int64_t offset = v.slot_offsets[t];
  const int64_t base = offset + home.bucket_base;
  const auto policy = static_cast<ScorePolicy>(v.policies[t]);
  const int64_t found =
      missing ? -1 : thread_find(v, base, width, key, home.digest, home.start);
  if (op == BucketOp::kErase) {
    out.slots[i] = found < 0 ? -1 : found - offset;
    if (found < 0) return 0;
    v.keys[found] = kEmptyKey;
    v.digests[found] = 0;
    for (int64_t w = 0; w < v.words; ++w) v.score(w, found) = 0;
    return -1;
  }
  int64_t w0 = 0;
  int64_t w1 = 0;
  const int64_t count = in.counts ? in.counts[i] : 1;
  int64_t target = found;
  auto status = InsertStatus::kHit;
  if (target < 0) {
    target = thread_first_empty(v, base, width, home.start);
    status = InsertStatus::kInserted;
    if (target < 0 && policy_evicts(policy)) {
      target = thread_victim(v, base, width, home.start, v.ranks_victims(t));
      status = InsertStatus::kEvicted;
    }
  }
  if (target < 0) {
    out.slots[i] = -1;
    out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
    return 0;
  }
  if (status == InsertStatus::kEvicted) {
    out.victim_keys[i] = v.keys[target];
    for (int64_t w = 0; w < v.words; ++w) out.victim_scores[w * in.n + i] = v.score(w, target);
  }
  if (op == BucketOp::kAssign) {
    w0 = in.assign_scores[i];
    if (v.words > 1) w1 = in.assign_scores[in.n + i];
  } else {
    if (status == InsertStatus::kHit) {
      w0 = v.score(0, target);
      if (v.words > 1) w1 = v.score(1, target);
    }
    touch_scores(policy, status != InsertStatus::kHit, in.score_args[t], count, w0, w1);
  }
  write_slot(v, target, key, home.digest, w0, w1);
  out.slots[i] = target - offset;
  out.status[i] = static_cast<int64_t>(status);
  return status == InsertStatus::kInserted ? 1 : 0;
}

// Sets (or clears) the protection of the slots that entries [begin, end) of the sorted batch
// were given (slot -1 skipped).
__device__ void set_protection(const TableView& v, const int64_t* slots,
                               const int32_t* positions, int32_t begin, int32_t end,
                               int64_t offset, bool on) {
  for (int32_t q = begin; q < end; ++q) {
    const int64_t slot = slots[positions[q]];
    if (slot < 0) continue;
    uint8_t& d = v.digests[offset + slot];
    d = on ? (d | kProtectedBit) : (d & static_cast<uint8_t>(~kProtectedBit));
  }
}

// The sorted batch cut into runs of equal sort keys (cub's run-length encoding).
struct Runs {
  const uint64_t* keys;      // (bucket start << 1) | hit
  const int32_t* offsets;    // first sorted entry of each run
  const int32_t* lengths;
  const int32_t* count;      // number of runs (device)
  const int32_t* positions;  // batch position of each sorted entry
};

// Phase B: one thread per run of misses (one bucket's missing keys, in batch order: the sort
// is stable). The bucket's hits, the next run, are protected first; every protection the thread
// set is cleared at the end. Size changes are summed per block before one global atomic per
// table: a global atomic per insert would serialize on one address.
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock, 5)
    bucket_kernel(TableView v, BucketOp op, BatchIn in, BatchOut out, Runs runs, uint64_t skip) {
  __shared__ unsigned long long deltas[kSharedTables];
  for (int j = threadIdx.x; j < kSharedTables; j += blockDim.x) deltas[j] = 0;
  __syncthreads();
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int32_t count = *runs.count;
  const uint64_t key = r < count ? runs.keys[r] : skip;
  if (key != skip && (key & 1) == 0) {
    const int32_t begin = runs.offsets[r];
    const int32_t end = begin + runs.lengths[r];
    const bool hits = r + 1 < count && runs.keys[r + 1] == (key | 1);
    const int32_t hit_begin = hits ? runs.offsets[r + 1] : 0;
    const int32_t hit_end = hits ? hit_begin + runs.lengths[r + 1] : 0;
    const int64_t t = in.table_ids[runs.positions[begin]];
    const int64_t offset = v.slot_offsets[t];
    set_protection(v, out.slots, runs.positions, hit_begin, hit_end, offset, true);
    int64_t delta = 0;
    for (int32_t q = begin; q < end; ++q) {
      const bool missing = op == BucketOp::kInsert && q == begin;
      delta += bucket_step(v, op, in, out, runs.positions[q], missing);
    }
    if (op != BucketOp::kErase) {
      set_protection(v, out.slots, runs.positions, hit_begin, hit_end, offset, false);
      set_protection(v, out.slots, runs.positions, begin, end, offset, false);
    }
    if (delta != 0) {
      auto* sum = t < kSharedTables ? &deltas[t]
                                    : reinterpret_cast<unsigned long long*>(&v.sizes[t]);
      atomicAdd(sum, static_cast<unsigned long long>(delta));
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < kSharedTables && j < v.num_tables; j += blockDim.x) {
    if (deltas[j] != 0) atomicAdd(reinterpret_cast<unsigned long long*>(&v.sizes[j]), deltas[j]);
  }
}

}  // namespace cuda
}  // namespace demb
