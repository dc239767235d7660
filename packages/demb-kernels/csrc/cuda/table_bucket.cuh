// Phase B of the table ops (docs/hash_table.md) on CUDA: one thread per run of a bucket's missing
// keys (or, for insert_or_assign and erase, of all its keys), in batch order. A thread owns its
// bucket, so it reads and writes it without atomics; threads of one warp own different buckets
// and never wait on each other (sub-warp tiles would serialize their divergent paths). A run of
// a wide bucket (kWideBucket slots or more: a cache's 1024) is handed to a whole warp instead
// (table_bucket_warp.cuh), which searches the bucket 32 slots at a time for the same slots.
#pragma once

#include <cstdint>

#include "cuda/table_kernels.cuh"

namespace demb {
namespace cuda {

constexpr int kSharedTables = 32;  // tables whose size changes a block sums in shared memory
// Buckets this wide or wider are searched by a warp (table_bucket_warp.cuh): a thread alone
// scans a full 1024-slot bucket once per missing key.
constexpr int64_t kWideBucket = 256;

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

// How one thread searches its bucket in phase B (ThreadSearch) or a warp together
// (table_bucket_warp.cuh's WarpSearch, StagedSearch): the same slots either way. `leads`: this
// thread writes the step's results (every thread of a ThreadSearch; lane 0 of a warp); it tells
// the search what it wrote (`wrote`: a search that keeps a copy of the bucket updates it).
struct ThreadSearch {
  __device__ int64_t find(const TableView& v, int64_t base, int64_t width, int64_t key,
                          uint8_t digest, int64_t start) const {
    return thread_find(v, base, width, key, digest, start);
  }
  __device__ int64_t first_empty(const TableView& v, int64_t base, int64_t width,
                                 int64_t start) const {
    return thread_first_empty(v, base, width, start);
  }
  __device__ int64_t victim(const TableView& v, int64_t base, int64_t width, int64_t start,
                            bool by_rank) const {
    return thread_victim(v, base, width, start, by_rank);
  }
  __device__ bool leads() const { return true; }
  // The leader wrote in-bucket slot j (its digest byte now `digest`).
  __device__ void wrote(int64_t /*j*/, uint8_t /*digest*/) const {}
};

// One key of phase B. Returns the change of its table's size (+1 insert into an empty slot,
// -1 erase; 0 on the threads that do not lead). `missing`: the key is known to be absent (the
// first miss of a find_or_insert run: phase A missed it and only this run writes the bucket),
// so the bucket is not searched.
template <typename Search>
__device__ int64_t bucket_step(const TableView& v, BucketOp op, const BatchIn& in,
                               const BatchOut& out, int64_t i, bool missing,
                               const Search& search) {
  const int64_t key = in.keys[i];
  const int64_t t = in.table_ids[i];
  const int64_t width = v.bucket_widths[t];
  const Home home = home_of(key, v.capacity(t), width);
  const int64_t offset = v.slot_offsets[t];
  const int64_t base = offset + home.bucket_base;
  const auto policy = static_cast<ScorePolicy>(v.policies[t]);
  const bool leads = search.leads();
  const int64_t found =
      missing ? -1 : search.find(v, base, width, key, home.digest, home.start);
  if (op == BucketOp::kErase) {
    if (!leads) return 0;
    out.slots[i] = found < 0 ? -1 : found - offset;
    if (found < 0) return 0;
    v.keys[found] = kEmptyKey;
    v.digests[found] = 0;
    for (int64_t w = 0; w < v.words; ++w) v.score(w, found) = 0;
    search.wrote(found - base, 0);
    return -1;
  }
  int64_t target = found;
  auto status = InsertStatus::kHit;
  if (target < 0) {
    target = search.first_empty(v, base, width, home.start);
    status = InsertStatus::kInserted;
    if (target < 0 && policy_evicts(policy)) {
      target = search.victim(v, base, width, home.start, v.ranks_victims(t));
      status = InsertStatus::kEvicted;
    }
  }
  if (!leads) return 0;
  if (target < 0) {
    out.slots[i] = -1;
    out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
    return 0;
  }
  if (status == InsertStatus::kEvicted) {
    out.victim_keys[i] = v.keys[target];
    for (int64_t w = 0; w < v.words; ++w) out.victim_scores[w * in.n + i] = v.score(w, target);
  }
  int64_t w0 = 0;
  int64_t w1 = 0;
  const int64_t count = in.counts ? in.counts[i] : 1;
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
  search.wrote(target - base, home.digest | kProtectedBit);
  out.slots[i] = target - offset;
  out.status[i] = static_cast<int64_t>(status);
  return status == InsertStatus::kInserted ? 1 : 0;
}

// Sets (or clears) the protection of the slots that entries [begin, end) of the sorted batch
// were given (slot -1 skipped), entries `stride` apart from `begin + first`.
__device__ void set_protection(const TableView& v, const int64_t* slots,
                               const int32_t* positions, int32_t begin, int32_t end,
                               int64_t offset, bool on, int32_t first = 0, int32_t stride = 1) {
  for (int32_t q = begin + first; q < end; q += stride) {
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
  int32_t* wide;             // (N,) the runs of wide buckets bucket_kernel left to a warp
  int32_t* wide_count;       // how many (device; zeroed before bucket_kernel)
};

// Run r of misses (its sort key `key`, of the form (bucket start << 1) | 0): its sorted entries,
// those of its bucket's hits (the next run, when it is one), its table.
struct MissRun {
  int32_t begin, end, hit_begin, hit_end;
  int64_t t, offset;
};

__device__ __forceinline__ MissRun miss_run(const TableView& v, const BatchIn& in,
                                            const Runs& runs, int64_t r, int32_t count,
                                            uint64_t key) {
  MissRun m;
  m.begin = runs.offsets[r];
  m.end = m.begin + runs.lengths[r];
  const bool hits = r + 1 < count && runs.keys[r + 1] == (key | 1);
  m.hit_begin = hits ? runs.offsets[r + 1] : 0;
  m.hit_end = hits ? m.hit_begin + runs.lengths[r + 1] : 0;
  m.t = in.table_ids[runs.positions[m.begin]];
  m.offset = v.slot_offsets[m.t];
  return m;
}

// Adds a run's size change to its table's: in the block's shared sums for the first tables.
__device__ __forceinline__ void add_size(const TableView& v, unsigned long long* deltas,
                                         int64_t t, int64_t delta) {
  if (delta == 0) return;
  auto* sum = t < kSharedTables ? &deltas[t] : reinterpret_cast<unsigned long long*>(&v.sizes[t]);
  atomicAdd(sum, static_cast<unsigned long long>(delta));
}

__device__ __forceinline__ void clear_sizes(unsigned long long* deltas) {
  for (int j = threadIdx.x; j < kSharedTables; j += blockDim.x) deltas[j] = 0;
  __syncthreads();
}

__device__ __forceinline__ void flush_sizes(const TableView& v, unsigned long long* deltas) {
  __syncthreads();
  for (int j = threadIdx.x; j < kSharedTables && j < v.num_tables; j += blockDim.x) {
    if (deltas[j] != 0) atomicAdd(reinterpret_cast<unsigned long long*>(&v.sizes[j]), deltas[j]);
  }
}

// Phase B: one thread per run of misses (one bucket's missing keys, in batch order: the sort
// is stable). The bucket's hits, the next run, are protected first; every protection the thread
// set is cleared at the end. Size changes are summed per block before one global atomic per
// table: a global atomic per insert would serialize on one address. A run of a wide bucket is
// appended to runs.wide for bucket_warp_kernel instead.
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock, 5)
    bucket_kernel(TableView v, BucketOp op, BatchIn in, BatchOut out, Runs runs, uint64_t skip) {
  __shared__ unsigned long long deltas[kSharedTables];
  clear_sizes(deltas);
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int32_t count = *runs.count;
  const uint64_t key = r < count ? runs.keys[r] : skip;
  if (key != skip && (key & 1) == 0) {
    const MissRun m = miss_run(v, in, runs, r, count, key);
    if (v.bucket_widths[m.t] >= kWideBucket) {
      runs.wide[atomicAdd(runs.wide_count, 1)] = static_cast<int32_t>(r);
    } else {
      set_protection(v, out.slots, runs.positions, m.hit_begin, m.hit_end, m.offset, true);
      int64_t delta = 0;
      for (int32_t q = m.begin; q < m.end; ++q) {
        const bool missing = op == BucketOp::kInsert && q == m.begin;
        delta += bucket_step(v, op, in, out, runs.positions[q], missing, ThreadSearch{});
      }
      if (op != BucketOp::kErase) {
        set_protection(v, out.slots, runs.positions, m.hit_begin, m.hit_end, m.offset, false);
        set_protection(v, out.slots, runs.positions, m.begin, m.end, m.offset, false);
      }
      add_size(v, deltas, m.t, delta);
    }
  }
  flush_sizes(v, deltas);
}

}  // namespace cuda
}  // namespace demb
