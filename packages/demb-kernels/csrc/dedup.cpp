// dedup_batch on the CPU: a table module batch's keys deduplicated per table (a hash map and a
// sort of the unique keys). cuda/dedup_cuda.cu gives the same outputs with its own kernels (a
// stable order by (table, key, position) is unique).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu/lookup_cpu.h"
#include "dedup_checks.h"
#include "table_rule.h"

namespace demb {

// (N,) int64 table of each index: feature f owns [offsets[f * B], offsets[(f + 1) * B]) (the
// last feature whose first bag starts at or before the index; feature 0 if none).
at::Tensor table_of_index(const at::Tensor& offsets, const at::Tensor& feature_tables,
                          int64_t batch_size, int64_t n) {
  const at::Tensor feature_starts =
      offsets.slice(0, 0, offsets.numel() - 1, batch_size).contiguous();
  const at::Tensor feature =
      at::searchsorted(feature_starts, at::arange(n, offsets.options()), false, true)
          .sub_(1)
          .clamp_(0, feature_tables.numel() - 1);
  return feature_tables.index_select(0, feature);
}

// The batch's checks, then offsets[::B] (kDedupFlags + F + 1 words, see dedup_checks.h).
at::Tensor batch_checks_cpu(const at::Tensor& indices, const at::Tensor& offsets,
                            const at::Tensor& feature_tables, int64_t num_tables,
                            int64_t batch_size, const std::optional<at::Tensor>& counters) {
  const int64_t n = indices.numel();
  const at::Tensor negative =
      counters ? counters->lt(0).sum() : at::zeros({}, indices.options());
  const at::Tensor flags = at::stack(
      {offsets.slice(0, 1).lt(offsets.slice(0, 0, -1)).sum(), offsets[0], n - offsets[-1],
       indices.eq(-1).sum(), negative.to(at::kLong),
       feature_tables.lt(0).logical_or_(feature_tables.ge(num_tables)).sum()});
  return at::cat({flags, offsets.slice(0, 0, offsets.numel(), batch_size)});
}

namespace {

// (rows, counts, bounds, key bits): rows (5, N) holds inverse, order, keys, tables and starts
// (the last three in their first U entries, zeros after), as the CUDA kernel's buffer does.
using DedupOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// A unique (table, key) pair and its first-seen id.
struct UniqueKey {
  int64_t table;
  int64_t key;
  int32_t id;
};

// dedup_batch's hash slots and per-index ids, reused by the calls of one thread.
struct DedupScratch {
  std::vector<int32_t> slot_id;
  std::vector<int32_t> local;
};

DedupScratch& dedup_scratch() {
  thread_local DedupScratch scratch;
  return scratch;
}

std::tuple<at::Tensor, at::Tensor> index_tables(const at::Tensor& indices,
                                                const at::Tensor& offsets,
                                                const at::Tensor& feature_tables,
                                                int64_t num_tables, int64_t batch_size) {
  check_dedup_args(indices, offsets, feature_tables, num_tables, batch_size, std::nullopt, 64);
  return {table_of_index(offsets, feature_tables, batch_size, indices.numel()),
          batch_checks_cpu(indices, offsets, feature_tables, num_tables, batch_size, std::nullopt)};
}

// out = keys (U,) sorted by (table, key); tables (U,); inverse (N,) position in keys of each
// index; counts (U,) occurrences (or summed counters); order (N,) index positions sorted by
// (table, key), stable; starts (U,) where each key's occurrences start in order; bounds, on the
// CPU, (T + 1 + F + 1,): the table bounds of keys, then offsets[::B]; key_bits, on the CPU, ():
// the low bits in which the keys differ (the CUDA sort's guess `key_bits`; unused here).
//
// O(N) passes and a sort of the U unique keys only: the batch's checks first (nothing is read
// through a bad offset), then each (table, key) pair gets its unique id in first-seen order from
// an open-addressing hash map (each probe's home slot prefetched a few indices ahead), the unique
// pairs are sorted, and a counting sort of the positions by their key's sorted rank gives
// `order` (stable: positions are visited in order).
DedupOut dedup_batch(const at::Tensor& indices_in, const at::Tensor& offsets,
                     const at::Tensor& feature_tables_in, int64_t num_tables, int64_t batch_size,
                     const std::optional<at::Tensor>& counters_in, int64_t key_bits) {
  check_dedup_args(indices_in, offsets, feature_tables_in, num_tables, batch_size, counters_in,
                   key_bits);
  TORCH_CHECK_VALUE(indices_in.numel() <= std::numeric_limits<int32_t>::max(), "indices: ",
                    indices_in.numel(), " entries; dedup_batch takes at most 2^31 - 1");
  const at::Tensor indices = indices_in.contiguous();
  const at::Tensor feature_tables = feature_tables_in.contiguous();
  const int64_t n = indices.numel();
  const int64_t features = feature_tables.numel();
  const at::Tensor checks =
      batch_checks_cpu(indices, offsets, feature_tables, num_tables, batch_size, counters_in)
          .contiguous();
  const int64_t* check = checks.const_data_ptr<int64_t>();
  raise_batch_checks(check, n, num_tables);  // offsets and tables are sound from here on
  const int64_t* feature_start = check + kDedupFlags;  // offsets[::B]: F + 1 words
  const int64_t* ftab = feature_tables.const_data_ptr<int64_t>();
  const int64_t* key = indices.const_data_ptr<int64_t>();
  at::Tensor counters_c;
  const int64_t* counter = nullptr;
  if (counters_in) {
    counters_c = counters_in->contiguous();
    counter = counters_c.const_data_ptr<int64_t>();
  }
  uint64_t varying = 0;
  for (int64_t i = 0; i < n; ++i) varying |= static_cast<uint64_t>(key[i] ^ key[0]);

  // (table, key) -> unique id (first seen), open addressing at load <= 1/2, int32 ids: the
  // slot table of a 58K-index batch is 512 KiB, not 1 MiB. It and the per-index ids live in
  // this thread's scratch, kept across calls: fresh memory every call cost page faults.
  int64_t slots = 2;
  while (slots < 2 * n) slots <<= 1;
  DedupScratch& scratch = dedup_scratch();
  std::vector<int32_t>& slot_id = scratch.slot_id;
  std::vector<int32_t>& local = scratch.local;
  if (static_cast<int64_t>(slot_id.size()) < slots) slot_id.resize(static_cast<size_t>(slots));
  if (static_cast<int64_t>(local.size()) < n) local.resize(static_cast<size_t>(n));
  std::fill(slot_id.begin(), slot_id.begin() + slots, -1);
  std::vector<UniqueKey> uniq;
  std::vector<int64_t> u_occ, u_sum;
  const uint64_t mask = static_cast<uint64_t>(slots - 1);
  const auto home = [&](int64_t k, int64_t t) {
    uint64_t h = static_cast<uint64_t>(k) ^ (static_cast<uint64_t>(t) * 0x9E3779B97F4A7C15ULL);
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    return h & mask;
  };
  constexpr int64_t kAhead = 8;  // probes whose home slot is asked into cache ahead
  for (int64_t f = 0; f < features; ++f) {
    const int64_t t = ftab[f];
    const int64_t end = feature_start[f + 1];
    for (int64_t i = feature_start[f]; i < end; ++i) {
      if (i + kAhead < end) __builtin_prefetch(slot_id.data() + home(key[i + kAhead], t));
      uint64_t s = home(key[i], t);
      int32_t id;
      while (true) {
        id = slot_id[s];
        if (id < 0) {
          id = static_cast<int32_t>(uniq.size());
          slot_id[s] = id;
          uniq.push_back({t, key[i], id});
          u_occ.push_back(0);
          u_sum.push_back(0);
          break;
        }
        if (uniq[id].key == key[i] && uniq[id].table == t) break;
        s = (s + 1) & mask;
      }
      local[i] = id;
      u_occ[id] += 1;
      u_sum[id] += counter ? counter[i] : 1;
    }
  }
  const auto unique = static_cast<int64_t>(uniq.size());
  std::sort(uniq.begin(), uniq.end(), [](const UniqueKey& a, const UniqueKey& b) {
    return a.table != b.table ? a.table < b.table : a.key < b.key;
  });
  const auto opts = indices.options();
  at::Tensor rows = at::empty({5, n}, opts);
  at::Tensor counts = at::empty({unique}, opts);
  int64_t* inv = rows.data_ptr<int64_t>();
  int64_t* ord = inv + n;
  int64_t* k_out = inv + 2 * n;
  int64_t* t_out = inv + 3 * n;
  int64_t* s_out = inv + 4 * n;
  int64_t* c_out = counts.data_ptr<int64_t>();
  std::vector<int64_t> rank_of(static_cast<size_t>(unique));
  std::vector<int64_t> through(static_cast<size_t>(num_tables), 0);  // unique keys of tables <= t
  int64_t start = 0;
  for (int64_t r = 0; r < unique; ++r) {
    const UniqueKey& q = uniq[r];
    rank_of[q.id] = r;
    k_out[r] = q.key;
    t_out[r] = q.table;
    c_out[r] = u_sum[q.id];
    s_out[r] = start;
    start += u_occ[q.id];
    through[q.table] = r + 1;
  }
  for (int64_t* row : {k_out, t_out, s_out}) std::fill(row + unique, row + n, 0);  // past U
  std::vector<int64_t> cursor(s_out, s_out + unique);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = rank_of[local[i]];
    inv[i] = r;
    ord[cursor[r]++] = i;
  }
  at::Tensor host = at::empty({num_tables + checks.numel()}, at::kLong);
  int64_t* h = host.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tables; ++t) h[t] = through[t];
  std::copy(check, check + checks.numel(), h + num_tables);
  const at::Tensor bounds = dedup_bounds(h, n, num_tables, features);
  return {rows, counts, bounds, at::scalar_tensor(bit_length(varying), at::kLong)};
}

// Per table (keys grouped by table: table t's are [bounds[t], bounds[t + 1])), how many of the
// statuses are new rows (INSERTED or EVICTED) and how many FAILED: (2, T) int64 on the CPU.
// cuda/dedup_cuda.cu counts the same with one block per table and one read-back.
at::Tensor status_counts_cpu(const at::Tensor& status_in, at::IntArrayRef bounds) {
  check_status_counts(status_in, bounds);
  const at::Tensor status = status_in.contiguous();
  const int64_t* s = status.const_data_ptr<int64_t>();
  const auto tables = static_cast<int64_t>(bounds.size()) - 1;
  at::Tensor counts = at::zeros({2, tables}, at::kLong);
  int64_t* c = counts.data_ptr<int64_t>();
  for (int64_t t = 0; t < tables; ++t) {
    for (int64_t i = bounds[t]; i < bounds[t + 1]; ++i) {
      const auto code = static_cast<InsertStatus>(s[i]);
      c[t] += code == InsertStatus::kInserted || code == InsertStatus::kEvicted;
      c[tables + t] += code == InsertStatus::kFailed;
    }
  }
  return counts;
}

// The checks read back: raises the error a bad batch earns, else returns the bounds.
at::Tensor batch_bounds(const at::Tensor& host, int64_t n, int64_t num_tables,
                        int64_t features) {
  TORCH_CHECK_VALUE(host.device().is_cpu() && host.scalar_type() == at::kLong &&
                        host.dim() == 1 && host.is_contiguous() &&
                        host.numel() == num_tables + kDedupFlags + features + 1,
                    "host: expected the ", num_tables + kDedupFlags + features + 1,
                    " int64 words read back from index_tables / dedup_batch");
  return dedup_bounds(host.const_data_ptr<int64_t>(), n, num_tables, features);
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) {
  m.impl("dedup_batch", &dedup_batch);
  m.impl("index_tables", &index_tables);
  m.impl("batch_bounds", &batch_bounds);
  m.impl("status_counts", &status_counts_cpu);
}

}  // namespace demb
