// CUDA kernels of the scored hash table (docs/hash_table.md); plain CUDA, no torch headers.
//
// What the ops share, and phase A (one lane per key, table_find.cuh). Phase B is in
// table_bucket.cuh. The choices are those of the CPU kernels (cpu/table_cpu.cpp): same bucket,
// same empty slot, same victim. Include this header from one .cu file only: it defines kernels.
#pragma once

#include <cstdint>

#include "cuda/device_clock.cuh"
#include "cuda/table_find.cuh"
#include "table_rule.h"

namespace demb {
namespace cuda {

// The blocks of lookup_gated_kernel an SM holds at once (its launch bounds, and the grid
// resident_lookup_blocks sizes).
constexpr int kLookupBlocksPerSm = 8;

struct BatchIn {
  const int64_t* keys;
  const int64_t* table_ids;
  const int64_t* score_args;     // may be null (lookup without touch)
  const int64_t* counts;         // may be null (1 each)
  const int64_t* assign_scores;  // (W, N), insert_or_assign only
  int64_t n;                     // entries; the stride of (W, N) arrays
  // Lookup / phase A only: a device gate (dedup_launch's): entries [0, gate[0]) when gate[1] is
  // set, none otherwise (null: all n).
  const int64_t* gate = nullptr;
};

struct BatchOut {
  int64_t* slots;
  int64_t* status;         // null for lookup / erase
  int64_t* victim_keys;    // null for lookup / erase
  int64_t* victim_scores;  // (W, N), null for lookup / erase
};

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

// What phase A writes for phase B besides each entry's sort key: the sort's values (batch
// positions), zeroed run lengths, and the entry's "no victim" outputs (an empty victim key and
// zero victim scores; phase B overwrites them for EVICTED entries). All null for a lookup.
// `missed` (find_or_insert) is set to 1 when some entry is not a hit (a missing key, or an
// invalid entry: FAILED): with none, phase B has nothing to do and is not launched.
struct PhaseBPrep {
  uint64_t* sort_keys;   // (N,) (bucket start << 1) | hit, or `skip`
  int32_t* positions;    // (N,) i
  int32_t* run_lengths;  // (N,) 0
  uint64_t skip;
  int32_t* missed;  // zeroed before phase A, or null
};

// Sets *missed once: a read first, so that a batch of many misses stores to the word only until
// the stores show (a plain store of the same value, no atomic).
__device__ __forceinline__ void note_miss(int32_t* missed) {
  if (missed != nullptr && *reinterpret_cast<volatile int32_t*>(missed) == 0) *missed = 1;
}

__device__ __forceinline__ void prepare_entry(const PhaseBPrep& prep, const BatchOut& out,
                                              int64_t words, int64_t n, int64_t i,
                                              uint64_t sort_key) {
  prep.sort_keys[i] = sort_key;
  prep.positions[i] = static_cast<int32_t>(i);
  prep.run_lengths[i] = 0;
  if (out.victim_keys) {
    out.victim_keys[i] = kEmptyKey;
    for (int64_t w = 0; w < words; ++w) out.victim_scores[w * n + i] = 0;
  }
}

// Phase B's sort key of a valid entry whose key's bucket starts at global slot `base`:
// (base << 1) | hit.
__device__ __forceinline__ uint64_t bucket_sort_key(int64_t base, bool hit) {
  return (static_cast<uint64_t>(base) << 1) | (hit ? 1 : 0);
}

// What lookup / phase A records for entry i of table t, its key's bucket starting at global
// slot `base`, once the key's global slot g is known (-1: missing), by one lane. With
// score_args, touch a found key (atomically: other lanes may touch the same key). With
// `prep.sort_keys`, also prepare the entry for phase B (bucket_sort_key); a miss is noted in
// `prep.missed` either way (when given).
__device__ __forceinline__ void record_entry(const TableView& v, const BatchIn& in,
                                             const BatchOut& out, const PhaseBPrep& prep,
                                             int64_t i, int64_t t, int64_t base, int64_t g) {
  out.slots[i] = g < 0 ? -1 : g - v.slot_offsets[t];
  if (prep.sort_keys) prepare_entry(prep, out, v.words, in.n, i, bucket_sort_key(base, g >= 0));
  if (g < 0) note_miss(prep.missed);
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

// What lookup / phase A records for an invalid entry i (by one lane): it misses, is FAILED
// (status) and gets `skip`.
__device__ __forceinline__ void record_invalid(const TableView& v, const BatchIn& in,
                                               const BatchOut& out, const PhaseBPrep& prep,
                                               int64_t i) {
  out.slots[i] = -1;
  if (out.status) out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
  if (prep.sort_keys) prepare_entry(prep, out, v.words, in.n, i, prep.skip);
  note_miss(prep.missed);
}

// Entry i of a lookup / phase A before its probe: its key and table, and for a valid entry
// (valid_entry) its table's bucket width, its home (home_of) and the global slot its key's
// bucket starts at.
struct Probe {
  int64_t key;
  int64_t t;
  int64_t width;
  int64_t base;
  Home home;
  bool valid;
};

__device__ __forceinline__ Probe probe_of(const TableView& v, const BatchIn& in, int64_t i) {
  Probe p{in.keys[i], in.table_ids[i], 0, 0, Home{0, 0, 0}, false};
  p.valid = valid_entry(v, p.key, p.t);
  if (p.valid) {
    p.width = v.bucket_widths[p.t];
    p.home = home_of(p.key, v.capacity(p.t), p.width);
    p.base = v.slot_offsets[p.t] + p.home.bucket_base;
  }
  return p;
}

// The key word at a valid probe's start slot (find_after_home's `at_home`; 0 for an invalid
// entry, whose word finish_probe does not read).
__device__ __forceinline__ int64_t home_word(const TableView& v, const Probe& p) {
  return p.valid ? v.keys[p.base + p.home.start] : 0;
}

// Lookup / phase A of entry i from its probe and its start slot's key word (home_word): the
// key's slot (find_after_home), and what record_entry / record_invalid write for it.
__device__ __forceinline__ void finish_probe(const TableView& v, const BatchIn& in,
                                             const BatchOut& out, const PhaseBPrep& prep,
                                             int64_t i, const Probe& p, int64_t at_home) {
  if (!p.valid) {
    record_invalid(v, in, out, prep, i);
    return;
  }
  record_entry(v, in, out, prep, i, p.t, p.base,
               find_after_home(v, p.base, p.width, p.key, p.home, at_home));
}

// Lookup / phase A of entry i by one lane alone: finish_probe after its own start slot's load.
__device__ __forceinline__ void lookup_entry_lane(const TableView& v, const BatchIn& in,
                                                  const BatchOut& out, const PhaseBPrep& prep,
                                                  int64_t i) {
  const Probe p = probe_of(v, in, i);
  finish_probe(v, in, out, prep, i, p, home_word(v, p));
}

// Lookup / phase A (lookup_entry_lane) of the first `limit` entries (see BatchIn::gate), one
// lane per entry (blocks_for_lanes). (One 8-lane tile per entry had 4 probes in flight per warp
// against 32.)
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock, 8)
    lookup_kernel(TableView v, BatchIn in, BatchOut out, PhaseBPrep prep) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t limit = in.gate == nullptr ? in.n : (in.gate[1] != 0 ? in.gate[0] : 0);
  if (i < limit) lookup_entry_lane(v, in, out, prep, i);
}

// lookup_kernel for a gated launch, whose count is on the device: a grid of resident blocks
// (resident_lookup_blocks), each lane taking entries a grid apart (lookup_entry_lane), so that a
// warp's 32 probes are in flight together and its records are coalesced. (The grid of every
// entry scheduled its idle blocks for nothing: 73 us against 64 us for the reference batch; one
// 8-lane tile per entry took 69 us. A lane taking two entries at a time, both start slots
// loaded before either is compared, took 44.1-44.2 us, or 41.5-42.0 us at 6 blocks per SM,
// against 41.1-41.6 us for this kernel, on an H200.)
__global__ void __launch_bounds__(kWarp * kWarpsPerBlock, kLookupBlocksPerSm)
    lookup_gated_kernel(TableView v, BatchIn in, BatchOut out, PhaseBPrep prep) {
  const int64_t limit = in.gate[1] != 0 ? in.gate[0] : 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < limit;
       i += stride) {
    lookup_entry_lane(v, in, out, prep, i);
  }
}

// Blocks of kWarp * kWarpsPerBlock lanes covering `entries` entries, one lane each.
inline unsigned blocks_for_lanes(int64_t entries) {
  const int64_t per_block = kWarpsPerBlock * kWarp;
  return static_cast<unsigned>((entries + per_block - 1) / per_block);
}

// The blocks of lookup_gated_kernel resident at once on `sms` SMs (its launch bounds).
inline unsigned resident_lookup_blocks(int sms) {
  return static_cast<unsigned>(sms) * static_cast<unsigned>(kLookupBlocksPerSm);
}

// Phase B's preparation of the first `count` entries after a lean phase A (one that wrote
// only slots and statuses, and noted misses: table_find_or_insert_gated), from the slots it
// found: what record_entry / record_invalid would have prepared (sort key, position, zeroed
// run length, no victim).
__global__ void prepare_found_kernel(TableView v, BatchIn in, BatchOut out, PhaseBPrep prep,
                                     int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  const Probe p = probe_of(v, in, i);
  prepare_entry(prep, out, v.words, in.n, i,
                p.valid ? bucket_sort_key(p.base, out.slots[i] >= 0) : prep.skip);
}

// Phase B's preparation of every entry (insert_or_assign, erase): sort key bucket_sort_key (as
// a miss: every entry is in phase B's runs), or `skip`; an invalid entry is FAILED.
__global__ void bucket_keys_kernel(TableView v, BatchIn in, BatchOut out, PhaseBPrep prep) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= in.n) return;
  const Probe p = probe_of(v, in, i);
  if (!p.valid) {
    out.slots[i] = -1;
    if (out.status) out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
    prepare_entry(prep, out, v.words, in.n, i, prep.skip);
    return;
  }
  prepare_entry(prep, out, v.words, in.n, i, bucket_sort_key(p.base, false));
}

// out[0, count) = the global timer, read once.
__global__ void timestamp_kernel(int64_t* out, int64_t count) {
  const int64_t now = global_timer();
  for (int64_t i = 0; i < count; ++i) out[i] = now;
}

}  // namespace cuda
}  // namespace demb
