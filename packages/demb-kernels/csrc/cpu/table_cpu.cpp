// CPU kernels of the scored hash table (docs/hash_table.md). Phase A (lookups) runs in parallel over
// keys; phase B runs in parallel over buckets, each bucket's keys in batch order; so the result
// is the one the CUDA kernels give, whatever the number of threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "cpu/bucket_cpu.h"
#include "cpu/lookup_cpu.h"
#include "dedup_checks.h"
#include "gather_call.h"
#include "lookup_checks.h"
#include "table_checks.h"
#include "table_ops.h"
#include "table_rule.h"

namespace demb {
namespace {

// Data checks, free on the CPU: table ids in range, counts >= 0. An entry whose key is -1 (the
// empty key) is skipped, as the CUDA kernels skip it (slot -1; find_or_insert and
// insert_or_assign: FAILED): a caller masks entries out that way without compacting its batch.
// The Python wrappers reject -1 keys when asked to check (demb_kernels.table).
void check_batch_data(const TableView& v, const int64_t* /*keys*/, const int64_t* table_ids,
                      const int64_t* counts, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(table_ids[i] >= 0 && table_ids[i] < v.num_tables, "table_ids[", i,
                      "]=", table_ids[i], " is out of range for an index of ", v.num_tables,
                      " tables");
    TORCH_CHECK_VALUE(!counts || counts[i] >= 0, "counts[", i, "]=", counts ? counts[i] : 0,
                      " is negative");
  }
}

// The unprotected slot of the bucket at global slot `base` with the smallest (score tuple,
// circular distance from `start`) -- victim_before's order, the CUDA kernels' pick -- or -1.
// Two passes: the smallest first word over the bucket (a tight loop; a full 1,024-slot bucket
// of a counter or a cache is scanned once per missing key), then, in circular order from
// `start`, the first slot holding it with the smallest second word (the first one found where
// the second word is always 0).
int64_t lowest_victim(const TableView& v, bool by_rank, int64_t base, int64_t width,
                      int64_t start) {
  const int64_t* first = by_rank ? v.rank + base : &v.score(0, base);
  const uint8_t* digests = v.digests + base;
  int64_t low = INT64_MAX;
  bool any = false;
  for (int64_t j = 0; j < width; ++j) {
    const bool open = (digests[j] & kProtectedBit) == 0;
    any |= open;
    low = open && first[j] < low ? first[j] : low;
  }
  if (!any) return -1;
  const bool one_word = by_rank || v.words < 2;
  int64_t target = -1, best = 0;
  for (int64_t d = 0; d < width; ++d) {
    const int64_t j = start + d < width ? start + d : start + d - width;
    if ((digests[j] & kProtectedBit) || first[j] != low) continue;
    int64_t s0 = 0, s1 = 0;
    victim_words(v, by_rank, base + j, s0, s1);
    if (target < 0 || s1 < best) {
      target = base + j;
      best = s1;
      if (one_word) break;
    }
  }
  return target;
}

// The first empty slot of the bucket in circular order from `start`, or -1.
int64_t first_empty(const TableView& v, int64_t base, int64_t width, int64_t start) {
  const int64_t first = start - start % 8;
  const uint64_t head = zero_bytes(digest_group(v, base + first));
  for (uint64_t m = head; m; m &= m - 1) {  // the start group, at or after `start`
    const int64_t j = first + __builtin_ctzll(m) / 8;
    if (j >= start && v.digests[base + j] == 0) return base + j;
  }
  for (int64_t c = 8; c < width; c += 8) {
    const int64_t j0 = static_cast<int64_t>(mod_u64(static_cast<uint64_t>(first + c),
                                                    static_cast<uint64_t>(width)));
    for (uint64_t m = zero_bytes(digest_group(v, base + j0)); m; m &= m - 1) {
      const int64_t j = j0 + __builtin_ctzll(m) / 8;
      if (v.digests[base + j] == 0) return base + j;
    }
  }
  for (uint64_t m = head; m; m &= m - 1) {  // the start group, before `start`
    const int64_t j = first + __builtin_ctzll(m) / 8;
    if (j < start && v.digests[base + j] == 0) return base + j;
  }
  return -1;
}

void atomic_sat_add(int64_t* word, int64_t count) {
  int64_t old = __atomic_load_n(word, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(word, &old, sat_add(old, count), true, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
  }
}

// Phase A / lookup: slot of every key; with score_args, touch found keys; with `protect`, also
// mark them protected. The batch's data was checked before.
void lookup_phase(const TableView& v, const int64_t* keys, const int64_t* table_ids,
                  const int64_t* score_args, const int64_t* counts, bool protect, int64_t n,
                  int64_t* slots) {
  constexpr int64_t kAhead = 16;  // keys whose home slot is fetched ahead (cache misses)
  at::parallel_for(0, n, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (i + kAhead < end) {
        const int64_t ta = table_ids[i + kAhead];
        const Home ahead = home_of(keys[i + kAhead], v.capacity(ta), v.bucket_widths[ta]);
        const int64_t base = v.slot_offsets[ta] + ahead.bucket_base;
        __builtin_prefetch(v.digests + base + ahead.start - ahead.start % 8);
        __builtin_prefetch(v.keys + base + ahead.start);  // where an insert put it, if it could
        if (score_args) __builtin_prefetch(&v.score(0, base + ahead.start), 1);  // its score
      }
      const int64_t t = table_ids[i];
      const Home home = home_of(keys[i], v.capacity(t), v.bucket_widths[t]);
      const int64_t g = find_in_bucket(v, v.slot_offsets[t] + home.bucket_base,
                                       v.bucket_widths[t], keys[i], home.digest, home.start);
      slots[i] = g < 0 ? -1 : g - v.slot_offsets[t];
      if (g < 0) continue;
      if (score_args) {
        const auto policy = static_cast<ScorePolicy>(v.policies[t]);
        const int64_t count = counts ? counts[i] : 1;
        if (policy_counts(policy)) {
          atomic_sat_add(&v.score(0, g), count);
          if (policy == ScorePolicy::kTimestampLfu) {
            __atomic_store_n(&v.score(1, g), score_args[t], __ATOMIC_RELAXED);
          }
        } else {
          __atomic_store_n(&v.score(0, g), score_args[t], __ATOMIC_RELAXED);
        }
      }
      if (protect) __atomic_fetch_or(&v.digests[g], kProtectedBit, __ATOMIC_RELAXED);
    }
  });
}

// Per-key outputs of phase B.
struct Outputs {
  int64_t* slots;
  int64_t* status;        // null for erase
  int64_t* victim_keys;   // null for erase
  int64_t* victim_scores; // (W, N), null for erase
  int64_t n;
};

// Inputs of phase B: what to write for each key.
struct Inputs {
  const int64_t* keys;
  const int64_t* table_ids;
  const int64_t* score_args;     // kInsert
  const int64_t* counts;         // kInsert, may be null
  const int64_t* assign_scores;  // kAssign, (W, N)
};

void write_slot(const TableView& v, int64_t g, int64_t key, uint8_t digest, const int64_t* words) {
  v.keys[g] = key;
  v.digests[g] = digest | kProtectedBit;
  for (int64_t w = 0; w < v.words; ++w) v.score(w, g) = words[w];
}

// One key of phase B, with its bucket owned by the calling thread.
void bucket_step(const TableView& v, BucketOp op, const Inputs& in, const Outputs& out, int64_t i) {
  const int64_t key = in.keys[i];
  const int64_t t = in.table_ids[i];
  const int64_t width = v.bucket_widths[t];
  const Home home = home_of(key, v.capacity(t), width);
  const int64_t base = v.slot_offsets[t] + home.bucket_base;
  const auto policy = static_cast<ScorePolicy>(v.policies[t]);
  const int64_t found = find_in_bucket(v, base, width, key, home.digest, home.start);

  if (op == BucketOp::kErase) {
    out.slots[i] = found < 0 ? -1 : found - v.slot_offsets[t];
    if (found >= 0) {
      v.keys[found] = kEmptyKey;
      v.digests[found] = 0;
      for (int64_t w = 0; w < v.words; ++w) v.score(w, found) = 0;
      __atomic_fetch_sub(&v.sizes[t], 1, __ATOMIC_RELAXED);
    }
    return;
  }
  const int64_t count = in.counts ? in.counts[i] : 1;
  int64_t words[2] = {0, 0};
  if (found >= 0) {
    if (op == BucketOp::kAssign) {
      for (int64_t w = 0; w < v.words; ++w) words[w] = in.assign_scores[w * out.n + i];
    } else {
      for (int64_t w = 0; w < v.words; ++w) words[w] = v.score(w, found);
      touch_scores(policy, false, in.score_args[t], count, words[0], words[1]);
    }
    write_slot(v, found, key, home.digest, words);
    out.slots[i] = found - v.slot_offsets[t];
    out.status[i] = static_cast<int64_t>(InsertStatus::kHit);
    return;
  }
  // The first empty slot in circular order, else the unprotected victim with the lowest score
  // words (or rank, where the table ranks its victims).
  int64_t target = first_empty(v, base, width, home.start);
  InsertStatus status = InsertStatus::kInserted;
  if (target < 0 && policy_evicts(policy)) {
    target = lowest_victim(v, v.ranks_victims(t), base, width, home.start);
    status = InsertStatus::kEvicted;
  }
  if (target < 0) {
    out.slots[i] = -1;
    out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
    return;
  }
  if (status == InsertStatus::kEvicted) {
    out.victim_keys[i] = v.keys[target];
    for (int64_t w = 0; w < v.words; ++w) out.victim_scores[w * out.n + i] = v.score(w, target);
  } else {
    __atomic_fetch_add(&v.sizes[t], 1, __ATOMIC_RELAXED);
  }
  if (op == BucketOp::kAssign) {
    for (int64_t w = 0; w < v.words; ++w) words[w] = in.assign_scores[w * out.n + i];
  } else {
    touch_scores(policy, true, in.score_args[t], count, words[0], words[1]);
  }
  write_slot(v, target, key, home.digest, words);
  out.slots[i] = target - v.slot_offsets[t];
  out.status[i] = static_cast<int64_t>(status);
}

// Phase B over the keys `todo` (batch positions): grouped by bucket, batch order within one.
void bucket_phase(const TableView& v, BucketOp op, const Inputs& in, const Outputs& out,
                  const std::vector<int64_t>& todo) {
  std::vector<std::pair<int64_t, int64_t>> order;  // (global bucket start, batch position)
  order.reserve(todo.size());
  for (const int64_t i : todo) {
    const int64_t t = in.table_ids[i];
    const Home home = home_of(in.keys[i], v.capacity(t), v.bucket_widths[t]);
    order.emplace_back(v.slot_offsets[t] + home.bucket_base, i);
  }
  std::sort(order.begin(), order.end());
  std::vector<int64_t> heads;
  for (size_t q = 0; q < order.size(); ++q) {
    if (q == 0 || order[q].first != order[q - 1].first) heads.push_back(static_cast<int64_t>(q));
  }
  heads.push_back(static_cast<int64_t>(order.size()));
  at::parallel_for(0, static_cast<int64_t>(heads.size()) - 1, 64, [&](int64_t b, int64_t e) {
    for (int64_t h = b; h < e; ++h) {
      for (int64_t q = heads[h]; q < heads[h + 1]; ++q) {
        bucket_step(v, op, in, out, order[q].second);
      }
    }
  });
}

// Clears the protection of every slot an op returned.
void unprotect(const TableView& v, const int64_t* table_ids, const int64_t* slots, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (slots[i] >= 0) v.digests[v.slot_offsets[table_ids[i]] + slots[i]] &= ~kProtectedBit;
  }
}

// table_lookup (table_lookup_op).
at::Tensor lookup_cpu(const IndexTensors& ix, const at::Tensor& keys_in,
                      const at::Tensor& table_ids_in, const std::optional<at::Tensor>& score_args,
                      const std::optional<at::Tensor>& counts_in) {
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor table_ids = table_ids_in.contiguous();
  const std::optional<at::Tensor> counts =
      counts_in.has_value() ? std::optional<at::Tensor>(counts_in->contiguous()) : std::nullopt;
  const TableView v = make_view(ix, nullptr);
  const int64_t n = keys.numel();
  const int64_t* cnt = counts ? counts->const_data_ptr<int64_t>() : nullptr;
  check_batch_data(v, keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(), cnt, n);
  at::Tensor slots = at::empty({n}, keys.options());
  const at::Tensor args = score_args.has_value() ? score_args->contiguous() : at::Tensor();
  lookup_phase(v, keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(),
               args.defined() ? args.const_data_ptr<int64_t>() : nullptr, cnt, false, n,
               slots.data_ptr<int64_t>());
  return slots;
}

// find_or_insert (op kInsert) and insert_or_assign (op kAssign), TableOps' bucket op. For
// kInsert, *all_hit tells whether the lookup phase found every key (the batch's data is checked
// first, so only a miss can make an entry anything but HIT), and then `speculate` is given the
// slots.
InsertOutputs insert_cpu(const IndexTensors& ix, at::Tensor& sizes, BucketOp op,
                         const at::Tensor& keys_in, const at::Tensor& table_ids_in,
                         const std::optional<at::Tensor>& score_args,
                         const std::optional<at::Tensor>& counts_in,
                         const std::optional<at::Tensor>& assign_in, bool* all_hit,
                         const Speculate& speculate) {
  check_batch(ix, keys_in, table_ids_in, score_args, counts_in);
  check_index_tensor(sizes, "sizes", at::kLong, ix.keys);
  TORCH_CHECK_VALUE(sizes.numel() == ix.num_tables(), "index sizes must be (T,)");
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor table_ids = table_ids_in.contiguous();
  const at::Tensor counts = counts_in.has_value() ? counts_in->contiguous() : at::Tensor();
  const at::Tensor args = score_args.has_value() ? score_args->contiguous() : at::Tensor();
  const at::Tensor assign = assign_in.has_value() ? assign_in->contiguous() : at::Tensor();
  const TableView v = make_view(ix, &sizes);
  const int64_t n = keys.numel();
  const int64_t* cnt = counts.defined() ? counts.const_data_ptr<int64_t>() : nullptr;
  check_batch_data(v, keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(), cnt, n);

  at::Tensor slots = at::empty({n}, keys.options());
  at::Tensor status = at::full({n}, static_cast<int64_t>(InsertStatus::kHit), keys.options());
  at::Tensor victim_keys = at::full({n}, kEmptyKey, keys.options());
  at::Tensor victim_scores = at::zeros({ix.score_words(), n}, keys.options());
  const Inputs in{keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(),
                  args.defined() ? args.const_data_ptr<int64_t>() : nullptr, cnt,
                  assign.defined() ? assign.const_data_ptr<int64_t>() : nullptr};
  const Outputs out{slots.data_ptr<int64_t>(), status.data_ptr<int64_t>(),
                    victim_keys.data_ptr<int64_t>(), victim_scores.data_ptr<int64_t>(), n};
  std::vector<int64_t> todo;
  bool skipped = false;  // an entry of the empty key: slot -1, FAILED, in no phase B
  const auto skip = [&](int64_t i) {
    out.slots[i] = -1;
    out.status[i] = static_cast<int64_t>(InsertStatus::kFailed);
    skipped = true;
  };
  if (op == BucketOp::kInsert) {
    lookup_phase(v, in.keys, in.table_ids, in.score_args, cnt, true, n, out.slots);
    for (int64_t i = 0; i < n; ++i) {
      if (in.keys[i] == kEmptyKey) {
        skip(i);
      } else if (out.slots[i] < 0) {
        todo.push_back(i);
      }
    }
    if (all_hit != nullptr) *all_hit = todo.empty() && !skipped;
  } else {
    todo.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (in.keys[i] == kEmptyKey) {
        skip(i);
      } else {
        todo.push_back(i);
      }
    }
  }
  bucket_phase(v, op, in, out, todo);
  unprotect(v, in.table_ids, out.slots, n);
  if (op == BucketOp::kInsert && todo.empty() && !skipped && speculate) speculate(slots);
  return {slots, status, victim_keys, victim_scores};
}

at::Tensor table_erase_cpu(const at::Tensor& index_keys, const at::Tensor& digests,
                           const at::Tensor& scores, const at::Tensor& slot_offsets,
                           const at::Tensor& bucket_widths, const at::Tensor& policies,
                           at::Tensor sizes, const at::Tensor& keys_in,
                           const at::Tensor& table_ids_in) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  check_batch(ix, keys_in, table_ids_in, std::nullopt, std::nullopt);
  check_index_tensor(sizes, "sizes", at::kLong, ix.keys);
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor table_ids = table_ids_in.contiguous();
  const TableView v = make_view(ix, &sizes);
  const int64_t n = keys.numel();
  check_batch_data(v, keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(),
                   nullptr, n);
  at::Tensor slots = at::empty({n}, keys.options());
  const Inputs in{keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(), nullptr,
                  nullptr, nullptr};
  const Outputs out{slots.data_ptr<int64_t>(), nullptr, nullptr, nullptr, n};
  std::vector<int64_t> todo;  // an entry of the empty key is skipped (slot -1), as in insert_cpu
  todo.reserve(static_cast<size_t>(n));
  int64_t* s = out.slots;
  for (int64_t i = 0; i < n; ++i) {
    if (in.keys[i] == kEmptyKey) {
      s[i] = -1;
    } else {
      todo.push_back(i);
    }
  }
  bucket_phase(v, BucketOp::kErase, in, out, todo);
  return slots;
}

// table_find_rows (table_find_rows_op): table_lookup (no score touched), then
// gather_table_rows of the slots.
std::tuple<at::Tensor, at::Tensor> find_rows_cpu(const IndexTensors& ix, const GatherTables& g,
                                                 at::TensorList values, const at::Tensor& keys,
                                                 const at::Tensor& table_ids, int64_t dim) {
  const int64_t* offsets = ix.slot_offsets.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < g.count; ++t) {
    TORCH_CHECK_VALUE(g.rows[t] >= offsets[t + 1] - offsets[t], "values[", t, "] has ",
                      g.rows[t], " rows for a table of ", offsets[t + 1] - offsets[t], " slots");
  }
  at::Tensor slots = lookup_cpu(ix, keys, table_ids, std::nullopt, std::nullopt);
  return {gather_table_rows_cpu(values, slots, table_ids.contiguous(), std::nullopt, dim), slots};
}

// table_find_batch_rows: the batch's checks first (with check), each index's table from its
// feature, then table_find_rows.
std::tuple<at::Tensor, at::Tensor> table_find_batch_rows_cpu(
    const at::Tensor& index_keys, const at::Tensor& digests, const at::Tensor& scores,
    const at::Tensor& slot_offsets, const at::Tensor& bucket_widths, const at::Tensor& policies,
    at::TensorList values, const at::Tensor& indices, const at::Tensor& offsets,
    const at::Tensor& feature_tables, int64_t batch_size, int64_t dim, bool check) {
  const int64_t num_tables = bucket_widths.numel();
  check_dedup_args(indices, offsets, feature_tables, num_tables, batch_size, std::nullopt, 64);
  if (check) {
    const at::Tensor words = batch_checks_cpu(indices, offsets, feature_tables, num_tables,
                                              batch_size, std::nullopt);
    raise_batch_checks(words.const_data_ptr<int64_t>(), indices.numel(), num_tables);
  }
  const at::Tensor tables =
      table_of_index(offsets.contiguous(), feature_tables.contiguous(), batch_size,
                     indices.numel());
  return table_find_rows_op<find_rows_cpu>(index_keys, digests, scores, slot_offsets,
                                           bucket_widths, policies, values, indices, tables,
                                           dim);
}

at::Tensor table_timestamp_cpu(const at::Tensor& like, int64_t count) {
  TORCH_CHECK_VALUE(count >= 1, "count: ", count, "; the timestamp needs at least one copy");
  const auto now = std::chrono::steady_clock::now().time_since_epoch();
  const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(now).count();
  return at::full({count}, ns, like.options().dtype(at::kLong));
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) {
  m.impl("table_lookup", &table_lookup_op<lookup_cpu>);
  m.impl("table_find_or_insert", &TableOps<insert_cpu>::find_or_insert);
  m.impl("table_find_or_insert_rows", &TableOps<insert_cpu>::find_or_insert_rows);
  m.impl("table_insert_or_assign", &TableOps<insert_cpu>::insert_or_assign);
  m.impl("table_erase", &table_erase_cpu);
  m.impl("table_timestamp", &table_timestamp_cpu);
  m.impl("table_find_rows", &table_find_rows_op<find_rows_cpu>);
  m.impl("table_find_batch_rows", &table_find_batch_rows_cpu);
}

}  // namespace demb
