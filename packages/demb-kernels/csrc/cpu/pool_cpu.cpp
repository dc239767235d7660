// CPU kernel of pool_table_rows (pool_checks.h's rule), parallel over bags. Every argument's
// values are checked before any output is written.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "pool_checks.h"

namespace demb {
namespace {

// Columns of a bag summed at a time, in vector registers: the bag's rows are walked once per
// such block. (The sums kept in the output row, loaded and stored for every row added, took
// 4.6-5.2 ms for the scaled SUM benchmark's batch on a 2-vCPU VM; these blocks with their rows
// fetched ahead, 0.6 ms.)
constexpr int64_t kBlock = 32;

// Indices ahead whose block of columns is asked of the cache before it is added: a row is a
// random read, and the core does not run far enough ahead on its own.
constexpr int64_t kAhead = 16;

// Eight floats, added lane by lane (GCC's vector extension: one AVX register, or two SSE ones).
using Lanes = float __attribute__((vector_size(32)));
constexpr int64_t kLanes = 8;

// out[0, K) = sum over i in [begin, end), in order of i, of row s[i] of `base` (row stride
// `width`), columns [0, K) from `col` on (times w[i] when w is given: the product, then the
// sum); a slot of -1 adds nothing. Starts at 0.0f, one row at a time (pool_checks.h's rule).
// Rows of indices below `ahead_end` (the feature's end, so of the same table) are fetched ahead.
template <int64_t K>
inline void sum_block(float* __restrict__ out, const float* __restrict__ base, int64_t width,
                      const int64_t* __restrict__ s, const float* __restrict__ w, int64_t begin,
                      int64_t end, int64_t ahead_end, int64_t col) {
  static_assert(K % kLanes == 0, "a block is whole vectors");
  constexpr int64_t V = K / kLanes;
  Lanes acc[V];
#pragma GCC unroll 8
  for (int64_t v = 0; v < V; ++v) acc[v] = Lanes{};
  for (int64_t i = begin; i < end; ++i) {
    if (i + kAhead < ahead_end && s[i + kAhead] >= 0) {
      const float* next = base + s[i + kAhead] * width + col;
#pragma GCC unroll 8
      for (int64_t c = 0; c < K; c += 16) __builtin_prefetch(next + c);  // 64-byte lines
    }
    if (s[i] < 0) continue;
    const float* row = base + s[i] * width + col;
    if (w != nullptr) {
      const float f = w[i];
#pragma GCC unroll 8
      for (int64_t v = 0; v < V; ++v) {
        Lanes x;
        std::memcpy(&x, row + v * kLanes, sizeof(x));
        acc[v] = acc[v] + x * f;
      }
    } else {
#pragma GCC unroll 8
      for (int64_t v = 0; v < V; ++v) {
        Lanes x;
        std::memcpy(&x, row + v * kLanes, sizeof(x));
        acc[v] = acc[v] + x;
      }
    }
  }
#pragma GCC unroll 8
  for (int64_t v = 0; v < V; ++v) std::memcpy(out + v * kLanes, &acc[v], sizeof(Lanes));
}

// sum_block over `cols` < kBlock columns (a row's last, narrower block), one at a time.
inline void sum_columns(float* __restrict__ out, const float* __restrict__ base,
                        int64_t width, const int64_t* __restrict__ s, const float* __restrict__ w,
                        int64_t begin, int64_t end, int64_t col, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) {
    float acc = 0.0f;
    for (int64_t i = begin; i < end; ++i) {
      if (s[i] < 0) continue;
      const float x = base[s[i] * width + col + c];
      acc = w != nullptr ? acc + x * w[i] : acc + x;
    }
    out[c] = acc;
  }
}

// What pool_bags reads: the checked arguments' data (see pool_table_rows_cpu).
struct PoolData {
  const GatherTables* tables;
  const int64_t* slots;
  const int64_t* offsets;
  const int64_t* feature_tables;
  const float* weights;  // null: unweighted
  int64_t features, batch_size, dim;
  bool mean;
  float* out;  // (B, F * dim)
};

// Bags [begin, end) (feature-major: bag q is bag q % B of feature q / B) into their output
// columns. Built twice on x86-64 Linux (pool_bags_avx2, pool_bags_portable: pool_bags_for_cpu
// picks one).
__attribute__((always_inline)) inline void pool_bags(const PoolData& d, int64_t begin,
                                                     int64_t end) {
  const GatherTables& g = *d.tables;
  const int64_t* s = d.slots;
  const int64_t* off = d.offsets;
  const int64_t dim = d.dim;
  for (int64_t q = begin; q < end; ++q) {
    const int64_t f = q / d.batch_size;
    const int64_t b = q % d.batch_size;
    const int64_t t = d.feature_tables[f];
    const auto* base = static_cast<const float*>(g.base[t]);
    const int64_t width = g.width[t];
    float* bag = d.out + b * d.features * dim + f * dim;
    const int64_t feature_end = off[(f + 1) * d.batch_size];
    int64_t col = 0;
    for (; col + kBlock <= dim; col += kBlock) {
      sum_block<kBlock>(bag + col, base, width, s, d.weights, off[q], off[q + 1], feature_end,
                        col);
    }
    sum_columns(bag + col, base, width, s, d.weights, off[q], off[q + 1], col, dim - col);
    const int64_t len = off[q + 1] - off[q];
    if (d.mean && len > 0) {
      for (int64_t c = 0; c < dim; ++c) bag[c] = bag[c] / static_cast<float>(len);
    }
  }
}

// pool_bags for any CPU, and on x86-64 Linux for AVX2: the same float operations in the same
// order either way (no contraction: -ffp-contract=off, and AVX2 brings no FMA), eight lanes at a
// time or four.
using PoolBags = void (*)(const PoolData&, int64_t, int64_t);

__attribute__((flatten)) void pool_bags_portable(const PoolData& d, int64_t begin, int64_t end) {
  pool_bags(d, begin, end);
}

#if defined(__x86_64__) && defined(__linux__)
#define DEMB_POOL_AVX2 1
__attribute__((target("avx2"), flatten)) void pool_bags_avx2(const PoolData& d, int64_t begin,
                                                               int64_t end) {
  pool_bags(d, begin, end);
}
#endif

// The build for the CPU capability PyTorch's own kernels use (at::get_cpu_capability: the
// CPU's, or a lower one named by ATEN_CPU_CAPABILITY, which PyTorch reads once), chosen once.
PoolBags pool_bags_for_cpu() {
#ifdef DEMB_POOL_AVX2
  static const PoolBags chosen = [] {
    const std::string cap = at::get_cpu_capability();
    return cap == "AVX2" || cap == "AVX512" ? &pool_bags_avx2 : &pool_bags_portable;
  }();
  return chosen;
#else
  return &pool_bags_portable;
#endif
}

at::Tensor pool_table_rows_cpu(at::TensorList values, const at::Tensor& slots_in,
                               const at::Tensor& offsets_in, const at::Tensor& feature_tables_in,
                               int64_t batch_size, int64_t dim, bool mean,
                               const std::optional<at::Tensor>& weights_in) {
  const PoolShape p = check_pool_args(values, slots_in, offsets_in, feature_tables_in,
                                      batch_size, dim, weights_in);
  const GatherTables& g = p.tables;
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const at::Tensor feature_tables = feature_tables_in.contiguous();
  const at::Tensor weights = weights_in ? weights_in->contiguous() : at::Tensor();
  const int64_t* s = slots.const_data_ptr<int64_t>();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t* ft = feature_tables.const_data_ptr<int64_t>();
  const float* w = weights.defined() && p.n ? weights.const_data_ptr<float>() : nullptr;
  const int64_t bags = p.features * batch_size;
  TORCH_CHECK_VALUE(off[0] == 0 && off[bags] == p.n, "offsets: must start at 0 and end at ",
                    p.n, " (the slots), got ", off[0], " and ", off[bags]);
  for (int64_t q = 0; q < bags; ++q) {
    TORCH_CHECK_VALUE(off[q] <= off[q + 1], "offsets: decrease at ", q, " (", off[q], " > ",
                      off[q + 1], ")");
  }
  for (int64_t f = 0; f < p.features; ++f) {
    TORCH_CHECK_VALUE(ft[f] >= 0 && ft[f] < g.count, "feature_tables: ", ft[f],
                      " is out of range for ", g.count, " tables");
    for (int64_t i = off[f * batch_size]; i < off[(f + 1) * batch_size]; ++i) {
      TORCH_CHECK_VALUE(s[i] >= -1 && s[i] < g.rows[ft[f]], "slots: ", s[i],
                        " is out of range for table ", ft[f], " of ", g.rows[ft[f]], " rows");
    }
  }
  at::Tensor out = at::empty({batch_size, p.features * dim}, slots.options().dtype(at::kFloat));
  const PoolData d{&g, s, off, ft, w, p.features, batch_size, dim, mean, out.data_ptr<float>()};
  const PoolBags pool = pool_bags_for_cpu();
  at::parallel_for(0, bags, 256, [&](int64_t begin, int64_t end) { pool(d, begin, end); });
  return out;
}

std::string pool_cpu_build() {
  return pool_bags_for_cpu() == &pool_bags_portable ? "portable" : "avx2";
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) { m.impl("pool_table_rows", &pool_table_rows_cpu); }

TORCH_LIBRARY_IMPL(demb, CompositeImplicitAutograd, m) {
  m.impl("pool_cpu_build", &pool_cpu_build);  // no tensors: one kernel for every backend
}

}  // namespace demb
