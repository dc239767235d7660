// dedup_batch on the CPU: a table module batch's keys deduplicated per table, from ATen ops.
// cuda/dedup_cuda.cu gives the same outputs with its own kernels (a stable order by (table,
// key, position) is unique). One read-back of the bounds and checks.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

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

using DedupOut = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                            at::Tensor, at::Tensor>;

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
DedupOut dedup_batch(const at::Tensor& indices_in, const at::Tensor& offsets,
                     const at::Tensor& feature_tables, int64_t num_tables, int64_t batch_size,
                     const std::optional<at::Tensor>& counters, int64_t key_bits) {
  check_dedup_args(indices_in, offsets, feature_tables, num_tables, batch_size, counters,
                   key_bits);
  const at::Tensor indices = indices_in.contiguous();
  uint64_t varying = 0;
  const int64_t* idx = indices.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < indices.numel(); ++i) varying |= static_cast<uint64_t>(idx[i] ^ idx[0]);
  const int64_t n = indices.numel();
  const int64_t features = feature_tables.numel();
  const auto opts = indices.options();
  const at::Tensor tables = table_of_index(offsets, feature_tables, batch_size, n);
  // Sorted by (table, key): a stable sort by key, then a stable sort of their tables.
  const auto [keys_by_key, by_key] = at::sort(indices, true, 0, false);
  const auto [sorted_tables, by_table] =
      at::sort(tables.index_select(0, by_key).to(at::kInt), true, 0, false);
  const at::Tensor order = by_key.index_select(0, by_table);
  const at::Tensor sorted_keys = keys_by_key.index_select(0, by_table);
  at::Tensor first = at::ones({n}, opts.dtype(at::kBool));
  if (n > 1) {
    first.slice(0, 1).copy_(
        sorted_keys.slice(0, 1)
            .ne(sorted_keys.slice(0, 0, n - 1))
            .logical_or_(sorted_tables.slice(0, 1).ne(sorted_tables.slice(0, 0, n - 1))));
  }
  const at::Tensor rank = first.cumsum(0, at::kLong).sub_(1);
  const at::Tensor inverse = at::empty_like(rank).scatter_(0, order, rank);
  // Unique keys up to the end of each table (no atomics: the pairs are sorted by table).
  const at::Tensor ends =
      at::searchsorted(sorted_tables, at::arange(num_tables, opts.dtype(at::kInt)), false, true);
  const at::Tensor through =
      n == 0 ? at::zeros({num_tables}, opts)
             : at::where(ends > 0, rank.index_select(0, (ends - 1).clamp_min(0)) + 1, 0);
  const at::Tensor host =  // the one sync
      at::cat({through, batch_checks_cpu(indices, offsets, feature_tables, num_tables, batch_size,
                                     counters)})
          .cpu();
  const at::Tensor bounds =
      dedup_bounds(host.const_data_ptr<int64_t>(), n, num_tables, features);
  const int64_t unique = bounds.const_data_ptr<int64_t>()[num_tables];
  const at::Tensor starts = at::nonzero_static(first, unique).squeeze(1);
  // Occurrences (or summed counters) per unique key: segment sums over the sorted order.
  const at::Tensor segment_end =
      at::cat({starts.slice(0, 1), at::full({1}, n, opts)}).slice(0, 0, unique);
  at::Tensor counts;
  if (counters) {
    const at::Tensor w = counters->index_select(0, order);
    const at::Tensor summed = w.cumsum(0);
    counts = summed.index_select(0, segment_end - 1) - summed.index_select(0, starts) +
             w.index_select(0, starts);
  } else {
    counts = segment_end - starts;
  }
  return {sorted_keys.index_select(0, starts),
          sorted_tables.index_select(0, starts).to(at::kLong),
          inverse,
          counts,
          order,
          starts,
          bounds,
          at::scalar_tensor(bit_length(varying), at::kLong)};
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
