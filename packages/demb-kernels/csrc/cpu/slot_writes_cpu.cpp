// CPU kernels of the online-delta paths (docs/online.md): the scan of an incremental export
// (table_export_scan) and a replay's writes of keys at given slots (slot_writes_check,
// slot_writes_apply). Each replaces a few dozen small tensor ops of the Python path that CUDA
// runs (demb_storage's _export.py and slot_writes.py), with the same results; on the CPU each
// small op costs more than the work itself.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu/bucket_cpu.h"
#include "table_checks.h"
#include "table_rule.h"

namespace demb {
namespace {

constexpr int64_t kScanChunk = int64_t{1} << 16;  // slots a task of the export scan reads

struct ScanChunk {
  int64_t part;   // position in table_ids
  int64_t begin;  // global slots [begin, end)
  int64_t end;
};

void check_tables_arg(const at::Tensor& slot_offsets, const at::Tensor& index_keys) {
  TORCH_CHECK_VALUE(index_keys.device().is_cpu() && slot_offsets.device().is_cpu(),
                    "the CPU kernel needs the index on the CPU");
  check_index_tensor(slot_offsets, "slot_offsets", at::kLong, index_keys);
  TORCH_CHECK_VALUE(slot_offsets.dim() == 1 && slot_offsets.numel() >= 2,
                    "slot_offsets must be (T + 1,) with T >= 1");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> table_export_scan_cpu(
    const at::Tensor& index_keys, const at::Tensor& scores, const at::Tensor& slot_offsets,
    at::IntArrayRef table_ids, at::IntArrayRef min_scores, int64_t word, at::IntArrayRef words) {
  check_tables_arg(slot_offsets, index_keys);
  check_index_tensor(index_keys, "keys", at::kLong, index_keys);
  check_index_tensor(scores, "scores", at::kLong, index_keys);
  const int64_t num_slots = index_keys.numel();
  TORCH_CHECK_VALUE(scores.dim() == 2 && scores.size(1) == num_slots,
                    "index scores must be (W, S), got ", scores.sizes());
  const int64_t num_words = scores.size(0);
  const int64_t num_tables = slot_offsets.numel() - 1;
  TORCH_CHECK_VALUE(table_ids.size() == min_scores.size(),
                    "table_ids and min_scores differ in length");
  TORCH_CHECK_VALUE(word >= 0 && word < num_words, "word ", word, " is not a score word of ",
                    num_words);
  for (const int64_t w : words) {
    TORCH_CHECK_VALUE(w >= 0 && w < num_words, "words: ", w, " is not a score word of ",
                      num_words);
  }
  const int64_t* offsets = slot_offsets.const_data_ptr<int64_t>();
  std::vector<ScanChunk> chunks;
  for (size_t i = 0; i < table_ids.size(); ++i) {
    const int64_t t = table_ids[i];
    TORCH_CHECK_VALUE(t >= 0 && t < num_tables, "table_ids: ", t, " is not a table of ",
                      num_tables);
    for (int64_t b = offsets[t]; b < offsets[t + 1]; b += kScanChunk) {
      chunks.push_back({static_cast<int64_t>(i), b, std::min(b + kScanChunk, offsets[t + 1])});
    }
  }
  const int64_t* keys = index_keys.const_data_ptr<int64_t>();
  const int64_t* all_words = scores.const_data_ptr<int64_t>();
  const int64_t* filter = all_words + word * num_slots;
  // Bit x of the mask: slot g + x (of at most 64 from g, up to `end`) is selected; built
  // without branches (a slot is selected unpredictably: a branch per slot mispredicts often).
  auto mask_at = [&](const ScanChunk& c, int64_t g) {
    const int64_t limit = min_scores[c.part];
    const int64_t len = std::min<int64_t>(64, c.end - g);
    uint64_t m = 0;
    for (int64_t x = 0; x < len; ++x) {
      m |= static_cast<uint64_t>((keys[g + x] != kEmptyKey) & (filter[g + x] >= limit)) << x;
    }
    return m;
  };
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  std::vector<int64_t> starts(num_chunks + 1, 0);
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      int64_t count = 0;
      for (int64_t g = chunks[c].begin; g < chunks[c].end; g += 64) {
        count += __builtin_popcountll(mask_at(chunks[c], g));
      }
      starts[c + 1] = count;
    }
  });
  at::Tensor counts = at::zeros({static_cast<int64_t>(table_ids.size())}, index_keys.options());
  int64_t* per_part = counts.data_ptr<int64_t>();
  for (int64_t c = 0; c < num_chunks; ++c) {
    per_part[chunks[c].part] += starts[c + 1];
    starts[c + 1] += starts[c];
  }
  const int64_t n = starts[num_chunks];
  const int64_t out_words = static_cast<int64_t>(words.size());
  at::Tensor slots = at::empty({n}, index_keys.options());
  at::Tensor found_keys = at::empty({n}, index_keys.options());
  at::Tensor found_words = at::empty({n, out_words}, index_keys.options());
  int64_t* s = slots.data_ptr<int64_t>();
  int64_t* k = found_keys.data_ptr<int64_t>();
  int64_t* w = found_words.data_ptr<int64_t>();
  at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      const int64_t lo = offsets[table_ids[chunks[c].part]];
      int64_t j = starts[c];
      for (int64_t g0 = chunks[c].begin; g0 < chunks[c].end; g0 += 64) {
        for (uint64_t m = mask_at(chunks[c], g0); m; m &= m - 1, ++j) {
          const int64_t g = g0 + __builtin_ctzll(m);
          s[j] = g - lo;
          k[j] = keys[g];
          for (int64_t x = 0; x < out_words; ++x) {
            w[j * out_words + x] = all_words[words[x] * num_slots + g];
          }
        }
      }
    }
  });
  return {slots, found_keys, found_words, counts};
}

// The arguments of slot writes: (N,) int64 keys, table ids and table-local slots, on the CPU.
void check_write_batch(const at::Tensor& slot_offsets, const at::Tensor& bucket_widths,
                       const at::Tensor& keys, const at::Tensor& table_ids,
                       const at::Tensor& slots) {
  check_index_tensor(bucket_widths, "bucket_widths", at::kLong, keys);
  TORCH_CHECK_VALUE(bucket_widths.numel() + 1 == slot_offsets.numel(),
                    "bucket_widths must be (T,) with slot_offsets (T + 1,)");
  for (const auto* t : {&keys, &table_ids, &slots}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kLong, "keys, table_ids and slots must be int64");
    TORCH_CHECK_VALUE(t->dim() == 1 && t->numel() == keys.numel() && t->is_contiguous() &&
                          t->device().is_cpu(),
                      "keys, table_ids and slots must be contiguous (N,) CPU tensors");
  }
  const int64_t num_tables = bucket_widths.numel();
  const int64_t* ids = table_ids.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < table_ids.numel(); ++i) {
    TORCH_CHECK_VALUE(ids[i] >= 0 && ids[i] < num_tables, "table_ids[", i, "]=", ids[i],
                      " is not a table of ", num_tables);
  }
}

// Open addressing over (key, table) pairs: whether a pair was seen before.
class PairSet {
 public:
  explicit PairSet(int64_t n) {
    int64_t size = 16;
    while (size < 2 * n) size *= 2;
    mask_ = size - 1;
    entries_.assign(static_cast<size_t>(size), -1);
  }

  // Inserts entry i's pair; false when an earlier entry holds the same pair.
  bool insert(int64_t i, const int64_t* keys, const int64_t* ids) {
    const uint64_t h = fmix64(key_bits(keys[i]) ^ fmix64(static_cast<uint64_t>(ids[i]) + 1));
    for (uint64_t p = h & mask_;; p = (p + 1) & mask_) {
      const int64_t j = entries_[p];
      if (j < 0) {
        entries_[p] = i;
        return true;
      }
      if (keys[j] == keys[i] && ids[j] == ids[i]) return false;
    }
  }

 private:
  uint64_t mask_ = 0;
  std::vector<int64_t> entries_;
};

// Flags of slot_writes_check, in its order.
enum Flag : int64_t { kEmpty = 0, kRepeatedKey, kOutside, kRepeatedSlot, kNotHome, kFlags };

std::tuple<at::Tensor, at::Tensor> slot_writes_check_cpu(const at::Tensor& slot_offsets,
                                                         const at::Tensor& bucket_widths,
                                                         const at::Tensor& keys,
                                                         const at::Tensor& table_ids,
                                                         const at::Tensor& slots) {
  check_tables_arg(slot_offsets, keys);
  check_write_batch(slot_offsets, bucket_widths, keys, table_ids, slots);
  const int64_t n = keys.numel();
  const int64_t* k = keys.const_data_ptr<int64_t>();
  const int64_t* ids = table_ids.const_data_ptr<int64_t>();
  const int64_t* s = slots.const_data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.const_data_ptr<int64_t>();
  const int64_t* widths = bucket_widths.const_data_ptr<int64_t>();
  at::Tensor digests = at::empty({n}, keys.options().dtype(at::kByte));
  at::Tensor flags = at::zeros({kFlags}, keys.options().dtype(at::kBool));
  uint8_t* d = digests.data_ptr<uint8_t>();
  bool* f = flags.data_ptr<bool>();
  const int64_t num_slots = offsets[bucket_widths.numel()];
  std::vector<uint64_t> taken(static_cast<size_t>(num_slots / 64 + 1), 0);
  PairSet pairs(n);
  // Per entry (in parallel): its digest, and whether it is the empty key, outside its table
  // or outside its home bucket; then the repeats, in order.
  std::vector<char> outside(static_cast<size_t>(n));
  std::array<std::atomic<bool>, kFlags> any{};
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    bool empty = false, out = false, away = false;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = ids[i];
      const int64_t capacity = offsets[t + 1] - offsets[t];
      const Home home = home_of(k[i], capacity, widths[t]);
      d[i] = home.digest;
      empty |= k[i] == kEmptyKey;
      outside[i] = s[i] < 0 || s[i] >= capacity;
      out |= outside[i] != 0;
      away |= outside[i] != 0 || s[i] - s[i] % widths[t] != home.bucket_base;
    }
    if (empty) any[kEmpty] = true;
    if (out) any[kOutside] = true;
    if (away) any[kNotHome] = true;
  });
  for (int64_t x = 0; x < kFlags; ++x) f[x] = any[x];
  for (int64_t i = 0; i < n; ++i) {
    f[kRepeatedKey] |= !pairs.insert(i, k, ids);
    if (outside[i]) continue;
    const uint64_t g = static_cast<uint64_t>(offsets[ids[i]] + s[i]);
    const uint64_t bit = uint64_t{1} << (g % 64);
    f[kRepeatedSlot] |= (taken[g / 64] & bit) != 0;
    taken[g / 64] |= bit;
  }
  return {digests, flags};
}

at::Tensor slot_writes_apply_cpu(at::Tensor index_keys, at::Tensor digests, at::Tensor scores,
                                 const at::Tensor& slot_offsets, const at::Tensor& bucket_widths,
                                 at::Tensor sizes, const at::Tensor& keys,
                                 const at::Tensor& table_ids, const at::Tensor& slots,
                                 const at::Tensor& key_digests, const at::Tensor& words) {
  check_tables_arg(slot_offsets, index_keys);
  check_index_tensor(index_keys, "keys", at::kLong, index_keys);
  check_index_tensor(digests, "digests", at::kByte, index_keys);
  check_index_tensor(scores, "scores", at::kLong, index_keys);
  check_index_tensor(sizes, "sizes", at::kLong, index_keys);
  check_write_batch(slot_offsets, bucket_widths, keys, table_ids, slots);
  const int64_t n = keys.numel();
  const int64_t num_slots = index_keys.numel();
  TORCH_CHECK_VALUE(digests.numel() == num_slots && scores.dim() == 2 &&
                        scores.size(1) == num_slots,
                    "index digests (S,) and scores (W, S) must match the index keys");
  const int64_t num_words = scores.size(0);
  TORCH_CHECK_VALUE(sizes.numel() == bucket_widths.numel(), "sizes must be (T,)");
  TORCH_CHECK_VALUE(key_digests.scalar_type() == at::kByte && key_digests.numel() == n &&
                        key_digests.is_contiguous() && key_digests.device().is_cpu(),
                    "key_digests must be a contiguous (N,) uint8 CPU tensor");
  TORCH_CHECK_VALUE(words.scalar_type() == at::kLong && words.dim() == 2 &&
                        words.size(0) == num_words && words.size(1) == n &&
                        words.is_contiguous() && words.device().is_cpu(),
                    "words must be a contiguous (W, N) int64 CPU tensor, W the index's words");
  const int64_t* k = keys.const_data_ptr<int64_t>();
  const int64_t* ids = table_ids.const_data_ptr<int64_t>();
  const int64_t* s = slots.const_data_ptr<int64_t>();
  const uint8_t* kd = key_digests.const_data_ptr<uint8_t>();
  const int64_t* w = words.const_data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.const_data_ptr<int64_t>();
  const int64_t* widths = bucket_widths.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t capacity = offsets[ids[i] + 1] - offsets[ids[i]];
    TORCH_CHECK_VALUE(s[i] >= 0 && s[i] < capacity, "slots[", i, "]=", s[i],
                      " is outside its table's ", capacity, " slots");
  }
  TableView v{index_keys.data_ptr<int64_t>(),
              digests.data_ptr<uint8_t>(),
              scores.data_ptr<int64_t>(),
              num_slots,
              num_words,
              offsets,
              widths,
              nullptr,
              bucket_widths.numel(),
              sizes.data_ptr<int64_t>()};
  at::Tensor taken_over = at::empty({n}, keys.options().dtype(at::kBool));
  bool* taken = taken_over.data_ptr<bool>();
  // Every key's current slot, read before anything is written (as the Python path does).
  std::vector<int64_t> found(static_cast<size_t>(n));
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = ids[i];
      const int64_t lo = offsets[t];
      const Home home = home_of(k[i], offsets[t + 1] - lo, widths[t]);
      taken[i] = v.keys[lo + s[i]] != k[i];
      found[i] = find_in_bucket(v, lo + home.bucket_base, widths[t], k[i], home.digest,
                                home.start);
    }
  });
  auto clear = [&](int64_t g) {
    v.keys[g] = kEmptyKey;
    v.digests[g] = 0;
    for (int64_t x = 0; x < num_words; ++x) v.score(x, g) = 0;
  };
  for (int64_t i = 0; i < n; ++i) {  // a key found at another slot leaves it
    const int64_t g = offsets[ids[i]] + s[i];
    if (found[i] >= 0 && found[i] != g) {
      clear(found[i]);
      v.sizes[ids[i]] -= 1;
    }
  }
  // The slots are distinct (checked): the writes run in parallel, a slot filled from empty
  // counting into its table's size atomically.
  at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = offsets[ids[i]] + s[i];
      if (v.keys[g] == kEmptyKey) __atomic_fetch_add(v.sizes + ids[i], 1, __ATOMIC_RELAXED);
      v.keys[g] = k[i];
      v.digests[g] = kd[i];
      for (int64_t x = 0; x < num_words; ++x) v.score(x, g) = w[x * n + i];
    }
  });
  return taken_over;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) {
  m.impl("table_export_scan", &table_export_scan_cpu);
  m.impl("slot_writes_check", &slot_writes_check_cpu);
  m.impl("slot_writes_apply", &slot_writes_apply_cpu);
}

}  // namespace demb
