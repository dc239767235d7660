// CUDA kernels of the value-row ops; plain CUDA, no torch headers. A row is `units` copy units
// of type U; a block covers 256 / units rows (or one row, looping, when a row is wider).
#pragma once

#include <cstdint>

namespace demb {
namespace cuda {

constexpr int kRowThreads = 256;

struct RowGrid {
  int64_t rows_per_block;
  int64_t blocks;
};

inline RowGrid row_grid(int64_t n, int64_t units) {
  const int64_t per_block = units <= kRowThreads ? kRowThreads / units : 1;
  return RowGrid{per_block, (n + per_block - 1) / per_block};
}

// out[i] = values[slots[i]], zeros where slots[i] is -1 (or out of range: skipped safely).
template <typename U>
__global__ void gather_rows_kernel(const U* values, int64_t num_rows, const int64_t* slots,
                                   int64_t n, int64_t units, int64_t rows_per_block, U* out) {
  const int64_t lane_row = units <= kRowThreads ? threadIdx.x / units : 0;
  const int64_t i = blockIdx.x * rows_per_block + lane_row;
  if (lane_row >= rows_per_block || i >= n) return;
  const int64_t slot = slots[i];
  const bool valid = slot >= 0 && slot < num_rows;
  const int64_t first = units <= kRowThreads ? threadIdx.x % units : threadIdx.x;
  const int64_t step = units <= kRowThreads ? units : kRowThreads;
  for (int64_t u = first; u < units; u += step) {
    out[i * units + u] = valid ? values[slot * units + u] : U{};
  }
}

// values[slots[i]] = rows[i] where slots[i] >= 0 (out-of-range slots skipped safely).
template <typename U>
__global__ void scatter_rows_kernel(U* values, int64_t num_rows, const int64_t* slots,
                                    int64_t n, int64_t units, int64_t rows_per_block,
                                    const U* rows) {
  const int64_t lane_row = units <= kRowThreads ? threadIdx.x / units : 0;
  const int64_t i = blockIdx.x * rows_per_block + lane_row;
  if (lane_row >= rows_per_block || i >= n) return;
  const int64_t slot = slots[i];
  if (slot < 0 || slot >= num_rows) return;
  const int64_t first = units <= kRowThreads ? threadIdx.x % units : threadIdx.x;
  const int64_t step = units <= kRowThreads ? units : kRowThreads;
  for (int64_t u = first; u < units; u += step) values[slot * units + u] = rows[i * units + u];
}

}  // namespace cuda
}  // namespace demb
