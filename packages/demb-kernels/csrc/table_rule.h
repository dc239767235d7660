// The rules of the scored hash table (docs/hash_table.md), shared by the CPU and CUDA kernels.
//
// Plain C++ (no torch headers), callable from host and device code. Where a key lives must stay
// bit-for-bit equal to demb_planner.table_hash (numpy), which is its definition; tests check it.
#pragma once

#include <cstdint>

#include "ownership.h"

namespace demb {

constexpr int64_t kEmptyKey = -1;
constexpr uint64_t kTableHashSeed = 0x9E3779B97F4A7C15ULL;
constexpr uint64_t kDigestModulus = 127;
constexpr uint8_t kProtectedBit = 0x80;  // set on a slot's digest while an op protects it
constexpr int64_t kMaxScore = INT64_MAX;

// How a table scores touched keys (demb_kernels.table.ScorePolicy).
enum class ScorePolicy : int64_t {
  kTimestamp = 0,
  kStep = 1,
  kCustomized = 2,
  kLfu = 3,
  kNoEviction = 4,
  kTimestampLfu = 5,
};

// Per-key outcome of find_or_insert / insert_or_assign (demb_kernels.table.InsertStatus).
enum class InsertStatus : int64_t { kHit = 0, kInserted = 1, kEvicted = 2, kFailed = 3 };

// What the bucket-sequential kernel does with each key.
enum class BucketOp : int32_t { kInsert = 0, kAssign = 1, kErase = 2 };

// Raw view of an index for one op (docs/hash_table.md's tensors), the same on host and device.
struct TableView {
  int64_t* keys;
  uint8_t* digests;
  int64_t* scores;  // word w of global slot g at scores[w * num_slots + g]
  int64_t num_slots;
  int64_t words;
  const int64_t* slot_offsets;
  const int64_t* bucket_widths;
  const int64_t* policies;
  int64_t num_tables;
  int64_t* sizes;  // null where an op does not change sizes
  // Per-slot victim ranks (num_slots), and per table (num_tables) nonzero where the table picks
  // victims by them; both null when no table does (then every table compares score words).
  const int64_t* rank = nullptr;
  const int64_t* ranked = nullptr;

  DEMB_HD int64_t& score(int64_t w, int64_t g) const { return scores[w * num_slots + g]; }
  DEMB_HD int64_t capacity(int64_t t) const { return slot_offsets[t + 1] - slot_offsets[t]; }
  // Whether table t picks its victims by `rank` instead of its score words.
  DEMB_HD bool ranks_victims(int64_t t) const {
    return rank != nullptr && ranked != nullptr && ranked[t] != 0;
  }
};

struct Home {
  int64_t bucket_base;  // table-local slot of the home bucket's first slot
  int64_t start;        // start position inside the bucket
  uint8_t digest;       // in [1, 127]
};

// a % m, with a mask when m is a power of two (64-bit division is slow on GPUs).
DEMB_HD uint64_t mod_u64(uint64_t a, uint64_t m) {
  return (m & (m - 1)) == 0 ? a & (m - 1) : a % m;
}

DEMB_HD Home home_of(int64_t key, int64_t capacity, int64_t bucket_width) {
  const uint64_t h = fmix64(key_bits(key) ^ kTableHashSeed);
  const uint64_t p = mod_u64(h, static_cast<uint64_t>(capacity));
  const uint64_t start = mod_u64(p, static_cast<uint64_t>(bucket_width));
  return Home{static_cast<int64_t>(p - start), static_cast<int64_t>(start),
              static_cast<uint8_t>(1 + (h >> 56) % kDigestModulus)};
}

DEMB_HD int64_t sat_add(int64_t a, int64_t b) { return a > kMaxScore - b ? kMaxScore : a + b; }

DEMB_HD bool policy_counts(ScorePolicy p) {
  return p == ScorePolicy::kLfu || p == ScorePolicy::kTimestampLfu;
}

DEMB_HD bool policy_evicts(ScorePolicy p) { return p != ScorePolicy::kNoEviction; }

// Scores of a touched key. `w0`, `w1` are its current words (ignored on insert); `words` is the
// index's score words (1 or 2). Writes the new words to w0 / w1.
DEMB_HD void touch_scores(ScorePolicy p, bool inserted, int64_t score_arg, int64_t count,
                          int64_t& w0, int64_t& w1) {
  if (policy_counts(p)) {
    w0 = inserted ? count : sat_add(w0, count);
    if (p == ScorePolicy::kTimestampLfu) w1 = score_arg;
  } else {
    w0 = score_arg;
  }
}

// Circular distance of position `i` from start `s` in a bucket of `width` slots.
DEMB_HD int64_t circular(int64_t i, int64_t s, int64_t width) {
  return i >= s ? i - s : i + width - s;
}

// What victims compare for global slot g before its circular distance: (rank[g], 0) where the
// table ranks its victims (`by_rank`: TableView::ranks_victims), else its score words (word 1
// taken as 0 in a one-word index).
DEMB_HD void victim_words(const TableView& v, bool by_rank, int64_t g, int64_t& k0, int64_t& k1) {
  if (by_rank) {
    k0 = v.rank[g];
    k1 = 0;
    return;
  }
  k0 = v.score(0, g);
  k1 = v.words > 1 ? v.score(1, g) : 0;
}

// Strict order of victim candidates: smaller score tuple first, then smaller circular distance.
DEMB_HD bool victim_before(int64_t a0, int64_t a1, int64_t a_dist, int64_t b0, int64_t b1,
                           int64_t b_dist) {
  if (a0 != b0) return a0 < b0;
  if (a1 != b1) return a1 < b1;
  return a_dist < b_dist;
}

}  // namespace demb
