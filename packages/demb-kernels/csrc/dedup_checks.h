// Argument checks and the host half of dedup_batch, shared by its CPU (dedup.cpp) and CUDA
// (cuda/dedup_cuda.cu) implementations.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace demb {

// The first (T + 5 + F + 1) words the device part of dedup_batch reads back: per table, the
// number of unique keys up to its end (0 if it has none); then the batch's checks (offsets'
// decreases, offsets[0], N - offsets[-1], -1 keys, negative counters, feature tables out of
// [0, T)); then offsets[::B].
constexpr int64_t kDedupFlags = 6;

// Bits of `x` up to its highest set one (0 for 0): how many low bits the keys differ in.
inline int64_t bit_length(uint64_t x) {
  int64_t bits = 0;
  while (x != 0) {
    x >>= 1;
    ++bits;
  }
  return bits;
}

inline void check_dedup_args(const at::Tensor& indices, const at::Tensor& offsets,
                             const at::Tensor& feature_tables, int64_t num_tables,
                             int64_t batch_size, const std::optional<at::Tensor>& counters,
                             int64_t key_bits) {
  TORCH_CHECK_VALUE(key_bits >= 1 && key_bits <= 64, "key_bits=", key_bits,
                    ": must be in [1, 64]");
  for (const auto& [name, x] :
       {std::pair<const char*, const at::Tensor&>{"indices", indices},
        {"offsets", offsets},
        {"feature_tables", feature_tables}}) {
    TORCH_CHECK_TYPE(x.scalar_type() == at::kLong, name, " must be int64, got ", x.scalar_type());
    TORCH_CHECK_VALUE(x.dim() == 1, name, " must be 1-D, got ", x.sizes());
    TORCH_CHECK_VALUE(x.device() == indices.device(), name, " is on ", x.device(),
                      ", indices on ", indices.device());
  }
  const int64_t features = feature_tables.numel();
  TORCH_CHECK_VALUE(num_tables >= 1 && features >= 1, "dedup_batch needs >= 1 table and feature");
  TORCH_CHECK_VALUE(batch_size >= 1, "batch_size=", batch_size, ": must be >= 1");
  TORCH_CHECK_VALUE(offsets.numel() == features * batch_size + 1, "offsets: ", offsets.numel(),
                    " entries; expected F * B + 1 = ", features * batch_size + 1);
  if (counters) {
    TORCH_CHECK_TYPE(counters->scalar_type() == at::kLong,
                     "frequency_counters must be int64, got ", counters->scalar_type());
    TORCH_CHECK_VALUE(counters->sizes() == indices.sizes() &&
                          counters->device() == indices.device(),
                      "frequency_counters: must be shaped like indices, on their device");
  }
}

// From the words read back (`host`, see kDedupFlags): raises the error a bad batch earns, else
// returns bounds (T + 1 + F + 1,) int64 on the CPU: the table bounds of the unique keys (a
// table without keys ends where the last did), then offsets[::B].
// Raises the error the batch's checks `f` (kDedupFlags words) earn, if any; num_tables is
// only named (0: unknown, as in index_tables' read-back).
inline void raise_batch_checks(const int64_t* f, int64_t n, int64_t num_tables) {
  TORCH_CHECK_VALUE(f[5] == 0, "feature_tables: ", f[5], " entries outside [0, ",
                    num_tables > 0 ? std::to_string(num_tables) : std::string("num_tables"), ")");
  TORCH_CHECK_VALUE(f[3] == 0,
                    "indices: contains -1, the empty-key sentinel, which is never a key");
  TORCH_CHECK_VALUE(f[4] == 0, "frequency_counters: contains a negative count");
  TORCH_CHECK_VALUE(f[0] == 0 && f[1] == 0 && f[2] == 0, "offsets: must start at 0, never "
                    "decrease and end at ", n, " (the number of indices); got ", f[1], " ... ",
                    n - f[2], " with ", f[0], " decreases");
}

inline at::Tensor dedup_bounds(const int64_t* host, int64_t n, int64_t num_tables,
                               int64_t features) {
  raise_batch_checks(host + num_tables, n, num_tables);
  at::Tensor bounds = at::empty({num_tables + 1 + features + 1}, at::kLong);
  int64_t* b = bounds.data_ptr<int64_t>();
  b[0] = 0;
  for (int64_t t = 0; t < num_tables; ++t) b[t + 1] = host[t] > b[t] ? host[t] : b[t];
  for (int64_t j = 0; j <= features; ++j) {
    b[num_tables + 1 + j] = host[num_tables + kDedupFlags + j];
  }
  return bounds;
}

// status_counts' arguments: status (U,) int64, U < 2^31; bounds from 0 to U, never decreasing.
inline void check_status_counts(const at::Tensor& status, at::IntArrayRef bounds) {
  TORCH_CHECK_TYPE(status.scalar_type() == at::kLong && status.dim() == 1,
                   "status must be a 1-D int64 tensor, got ", status.scalar_type(), " ",
                   status.sizes());
  TORCH_CHECK_VALUE(!bounds.empty() && bounds.front() == 0 && bounds.back() == status.numel(),
                    "bounds: must run from 0 to ", status.numel(), " (the statuses)");
  TORCH_CHECK_VALUE(status.numel() < (int64_t{1} << 31), "status: ", status.numel(),
                    " entries; status_counts takes fewer than 2^31");
  for (size_t t = 1; t < bounds.size(); ++t) {
    TORCH_CHECK_VALUE(bounds[t] >= bounds[t - 1], "bounds: must never decrease");
  }
}

}  // namespace demb
