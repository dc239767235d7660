// CUDA kernel and binding of pool_table_rows (pool_checks.h's rule). Warp w pools the bags that
// start in indices [w * kPoolSpan, (w + 1) * kPoolSpan): it walks their indices in order, a lane
// per index finding its slot and table, then the rows of kPoolRows indices loaded together and
// added in index order, each lane a column (or a float4 of columns) of the output row, which
// is stored when its bag ends. So a warp keeps rows in flight across its bags (most bags hold a
// few indices), and a long bag is its owner's alone (its sum stays in index order). Unchecked
// values: a table id out of range or a slot out of [0, rows) adds nothing; decreasing offsets
// give unspecified bags (no read leaves the arrays).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "cuda/feature_tables.cuh"
#include "cuda/gather_rows.cuh"
#include "pool_checks.h"

namespace demb {
namespace cuda {

constexpr int kPoolRows = 8;     // rows a warp loads before adding them
constexpr int64_t kPoolSpan = 256;  // indices whose bags a warp owns (by each bag's start)

__device__ __forceinline__ int64_t clamp64(int64_t x, int64_t lo, int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// The first bag in [0, bags) whose start offsets[q] is >= x, or `bags` (offsets non-decreasing),
// by the whole warp: each step its lanes probe 32 evenly spaced bags of the range left, so a
// million bags take four or five dependent loads, not twenty.
__device__ int64_t first_bag_at(const int64_t* offsets, int64_t bags, int64_t x, int lane) {
  int64_t lo = 0;
  int64_t hi = bags;  // the answer is in [lo, hi]
  while (lo < hi) {
    const int64_t step = (hi - lo + kLookupWarp - 1) / kLookupWarp;
    const int64_t p = lo + lane * step;
    const unsigned below = __ballot_sync(0xffffffffu, p < hi && offsets[p] < x);
    if (below == 0) return lo;  // offsets[lo] >= x
    const int j = 31 - __clz(below);  // the last probe below x: the answer is past it
    const int64_t next = lo + (j + 1) * step;
    lo = lo + j * step + 1;
    hi = next < hi ? next : hi;
  }
  return lo;
}

// A warp's walk through its bags [q, q_end): the current bag's first and end index, and the
// bag ends of the next 32 bags from `window` held one per lane (reloaded every 32 bags).
struct BagWalk {
  const int64_t* offsets;
  int64_t n;
  int64_t q;
  int64_t q_end;
  int64_t window;
  int64_t ends;  // this lane's: offsets[window + 1 + lane] (clamped)
  int64_t begin;
  int64_t end;

  __device__ __forceinline__ void load_window(int lane) {
    const int64_t e = window + 1 + lane;
    ends = e <= q_end ? offsets[e] : n;
  }
  // The current bag's end from the window (every lane: q is the same in each).
  __device__ __forceinline__ void load_end(int lane) {
    if (q - window == kLookupWarp) {
      window = q;
      load_window(lane);
    }
    end = clamp64(__shfl_sync(0xffffffffu, ends, static_cast<int>(q - window)), begin, n);
  }
};

// Bags of features * batch_size (k's offsets) into out (B, features * dim). Vec4: float32 rows
// whose dim, widths and bases are multiples of 4 floats, one float4 per lane and column block.
// (Measured on the H200, the SUM benchmark's eval batch of 5.8M indices: 1.08 ms at 3 blocks per
// SM (80 registers, a 60-byte spill), 1.21 ms at 2 (110 registers); with a span of 64 indices,
// 1.35 ms; one warp per bag, 1.43 ms.)
template <bool Vec4>
__global__ void __launch_bounds__(kLookupThreads, 3)
    pool_rows_kernel(const __grid_constant__ GatherTables g, const int64_t* __restrict__ slots,
                     KeyTables k, const float* __restrict__ weights, int64_t n, int64_t dim,
                     bool mean, float* __restrict__ out) {
  constexpr unsigned kAll = 0xffffffffu;
  __shared__ int64_t starts[kSharedFeatures];
  __shared__ int64_t tables_of[kSharedFeatures];
  stage_features(k, starts, tables_of);
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t lo = warp_index() * kPoolSpan;
  if (lo > n) return;  // the same for the warp's lanes
  const int64_t bags = k.features * k.batch_size;
  const int64_t q0 = first_bag_at(k.offsets, bags, lo, lane);
  const int64_t q1 = first_bag_at(k.offsets, bags, lo + kPoolSpan, lane);
  if (q0 >= q1) return;
  const int64_t i_begin = clamp64(k.offsets[q0], 0, n);
  const int64_t i_end = clamp64(k.offsets[q1], i_begin, n);
  const int64_t cols = Vec4 ? dim / 4 : dim;
  for (int64_t c0 = 0; c0 < cols; c0 += kLookupWarp) {
    const int64_t col = c0 + lane;
    BagWalk walk{k.offsets, n, q0, q1, q0, 0, i_begin, 0};
    walk.load_window(lane);
    walk.load_end(lane);
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // Stores the current bag's row and moves to the next bag (every lane).
    const auto flush = [&]() {
      if (col < cols) {
        if (mean && walk.end > walk.begin) {
          const auto len = static_cast<float>(walk.end - walk.begin);
          acc = make_float4(acc.x / len, acc.y / len, acc.z / len, acc.w / len);
        }
        const int64_t f = walk.q / k.batch_size;
        float* row = out + ((walk.q % k.batch_size) * k.features + f) * dim;
        if constexpr (Vec4) {
          reinterpret_cast<float4*>(row)[col] = acc;
        } else {
          row[col] = acc.x;
        }
      }
      acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      walk.begin = walk.end;
      if (++walk.q < walk.q_end) walk.load_end(lane);
    };
    for (int64_t i0 = i_begin; i0 < i_end; i0 += kLookupWarp) {
      int64_t my_slot = -1;
      int64_t my_table = -1;
      float my_weight = 1.0f;
      if (i0 + lane < i_end) {
        my_slot = slots[i0 + lane];
        my_table = feature_table(k, starts, tables_of, i0 + lane);
        if (weights != nullptr) my_weight = weights[i0 + lane];
      }
      const int here = static_cast<int>(i_end - i0 < kLookupWarp ? i_end - i0 : kLookupWarp);
      for (int r0 = 0; r0 < here; r0 += kPoolRows) {
        float4 x[kPoolRows];
        float w[kPoolRows];
        bool has[kPoolRows];
#pragma unroll
        for (int r = 0; r < kPoolRows; ++r) {
          const int64_t s = __shfl_sync(kAll, my_slot, r0 + r);
          const int64_t t = __shfl_sync(kAll, my_table, r0 + r);
          w[r] = __shfl_sync(kAll, my_weight, r0 + r);
          has[r] = r0 + r < here && !no_row(g, s, t);
          x[r] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          if (has[r] && col < cols) {
            const float* src = static_cast<const float*>(g.base[t]) + s * g.width[t];
            if constexpr (Vec4) {
              x[r] = __ldg(reinterpret_cast<const float4*>(src) + col);
            } else {
              x[r].x = __ldg(src + col);
            }
          }
        }
#pragma unroll
        for (int r = 0; r < kPoolRows; ++r) {
          if (r0 + r >= here) break;
          const int64_t i = i0 + r0 + r;
          while (walk.q < walk.q_end && i >= walk.end) flush();  // bags that end before i
          if (!has[r]) continue;
          if (weights != nullptr) {  // the product, then the sum (--fmad=false), as the CPU
            acc.x += x[r].x * w[r];
            acc.y += x[r].y * w[r];
            acc.z += x[r].z * w[r];
            acc.w += x[r].w * w[r];
          } else {
            acc.x += x[r].x;
            acc.y += x[r].y;
            acc.z += x[r].z;
            acc.w += x[r].w;
          }
        }
      }
    }
    while (walk.q < walk.q_end) flush();  // the last bag and any empty ones after it
  }
}

}  // namespace cuda

namespace {

at::Tensor pool_table_rows_cuda(at::TensorList values, const at::Tensor& slots_in,
                                const at::Tensor& offsets_in,
                                const at::Tensor& feature_tables_in, int64_t batch_size,
                                int64_t dim, bool mean,
                                const std::optional<at::Tensor>& weights_in) {
  const PoolShape p = check_pool_args(values, slots_in, offsets_in, feature_tables_in,
                                      batch_size, dim, weights_in);
  const c10::cuda::CUDAGuard guard(slots_in.device());
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const at::Tensor feature_tables = feature_tables_in.contiguous();
  const at::Tensor weights = weights_in ? weights_in->contiguous() : at::Tensor();
  at::Tensor out = at::empty({batch_size, p.features * dim}, slots.options().dtype(at::kFloat));
  const int64_t bags = p.features * batch_size;
  if (bags == 0) return out;
  const bool vec4 = float4_rows(p.tables, at::kFloat, dim);  // float32 rows (checked)
  const int64_t warps = p.n / cuda::kPoolSpan + 1;  // their spans cover [0, N]
  const auto blocks = static_cast<unsigned>((warps * cuda::kLookupWarp + cuda::kLookupThreads - 1) /
                                            cuda::kLookupThreads);
  const cuda::KeyTables k{nullptr, offsets.const_data_ptr<int64_t>(),
                          feature_tables.const_data_ptr<int64_t>(), p.features, batch_size};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const float* w = weights.defined() && p.n ? weights.const_data_ptr<float>() : nullptr;
  const auto launch = [&](auto kernel) {
    kernel<<<blocks, cuda::kLookupThreads, 0, stream>>>(p.tables, slots.const_data_ptr<int64_t>(),
                                                        k, w, p.n, dim, mean,
                                                        out.data_ptr<float>());
  };
  if (vec4) {
    launch(cuda::pool_rows_kernel<true>);
  } else {
    launch(cuda::pool_rows_kernel<false>);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) { m.impl("pool_table_rows", &pool_table_rows_cuda); }

}  // namespace demb
