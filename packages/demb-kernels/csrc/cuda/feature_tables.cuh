// Each index's table in a TBE-layout batch, from its feature (index_tables' rule), for kernels
// that find it as they go (find_rows_kernel, pool_rows_kernel). Device functions only.
#pragma once

#include <cstdint>

namespace demb {
namespace cuda {

// Where a kernel takes each index's table: tables[i], or (tables null) the table of the
// feature owning index i of a TBE-layout batch (feature f owns [offsets[f * B],
// offsets[(f + 1) * B]): the last feature whose first bag starts at or before i, feature 0 if
// none; index_tables' rule).
struct KeyTables {
  const int64_t* tables;
  const int64_t* offsets;
  const int64_t* feature_tables;
  int64_t features;
  int64_t batch_size;
};

constexpr int kSharedFeatures = 256;  // features whose starts a block keeps in shared memory

// The table of index i from the features' first offsets (`starts` in shared memory when the
// batch has at most kSharedFeatures features, else read from `offsets`).
__device__ __forceinline__ int64_t feature_table(const KeyTables& k, const int64_t* starts,
                                                 const int64_t* tables_of, int64_t i) {
  const bool shared = k.features <= kSharedFeatures;
  int64_t lo = 0;
  int64_t hi = k.features;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    const int64_t start = shared ? starts[mid] : k.offsets[mid * k.batch_size];
    if (start <= i) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return shared ? tables_of[lo] : k.feature_tables[lo];
}

// A block's copy of the features' first offsets and tables in shared memory (when there are at
// most kSharedFeatures of them), then a barrier: every thread of the block must call it.
__device__ __forceinline__ void stage_features(const KeyTables& k, int64_t* starts,
                                               int64_t* tables_of) {
  if (k.features <= kSharedFeatures) {
    for (int64_t f = threadIdx.x; f < k.features; f += blockDim.x) {
      starts[f] = k.offsets[f * k.batch_size];
      tables_of[f] = k.feature_tables[f];
    }
  }
  __syncthreads();
}

}  // namespace cuda
}  // namespace demb
