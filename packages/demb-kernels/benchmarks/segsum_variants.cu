// Variants of segment_chunk_sums_packed_kernel for segsum_variants.py (an H200 experiment; the
// packed kernel was replaced by the window sums, csrc/cuda/window_sums.cuh, in the tenth session).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
constexpr int W = 32;
template <int G, int MINB>
__global__ void __launch_bounds__(256, MINB) sums(const float* __restrict__ grads, const int64_t* __restrict__ order,
    const int64_t* __restrict__ cb, const int64_t* __restrict__ cl, const int64_t* __restrict__ cd,
    const int64_t* __restrict__ total_chunks, int64_t d, int64_t max_chunks, float* __restrict__ partial,
    float* __restrict__ out, bool* __restrict__ nonfinite) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % W;
  const int64_t first = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / W * G;
  const int64_t total = *total_chunks < max_chunks ? *total_chunks : max_chunks;
  if (first >= total) return;
  const int quads = (int)(d / 4);
  int len[G]; int32_t my_row[G]; int longest = 0;
#pragma unroll
  for (int c = 0; c < G; ++c) {
    const int64_t cc = first + c; const bool ok = cc < total;
    const int64_t b = ok ? cb[cc] : 0;
    len[c] = ok ? (int)cl[cc] : 0;
    my_row[c] = lane < len[c] ? (int32_t)order[b + lane] : 0;
    longest = len[c] > longest ? len[c] : longest;
  }
  float4 acc[G];
#pragma unroll
  for (int c = 0; c < G; ++c) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4* rows = reinterpret_cast<const float4*>(grads);
  for (int r = 0; r < longest; ++r) {
#pragma unroll
    for (int c = 0; c < G; ++c) {
      const int32_t row = __shfl_sync(kAll, my_row[c], r);
      if (r < len[c] && lane < quads) {
        const float4 x = __ldg(rows + (int64_t)row * quads + lane);
        acc[c].x += x.x; acc[c].y += x.y; acc[c].z += x.z; acc[c].w += x.w;
      }
    }
  }
#pragma unroll
  for (int c = 0; c < G; ++c) {
    if (len[c] == 0) continue;
    const int64_t dest = cd[first + c];
    float* dst = dest >= 0 ? out + dest * d : partial + (~dest) * d;
    if (lane < quads) reinterpret_cast<float4*>(dst)[lane] = acc[c];
    const bool bad = dest >= 0 && lane < quads && (!isfinite(acc[c].x) || !isfinite(acc[c].y) || !isfinite(acc[c].z) || !isfinite(acc[c].w));
    if (__any_sync(kAll, bad) && lane == 0) *nonfinite = true;
  }
}
// Loads of all G rows of step r issued before any add (explicit staging).
template <int G, int MINB>
__global__ void __launch_bounds__(256, MINB) sums_staged(const float* __restrict__ grads, const int64_t* __restrict__ order,
    const int64_t* __restrict__ cb, const int64_t* __restrict__ cl, const int64_t* __restrict__ cd,
    const int64_t* __restrict__ total_chunks, int64_t d, int64_t max_chunks, float* __restrict__ partial,
    float* __restrict__ out, bool* __restrict__ nonfinite) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % W;
  const int64_t first = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / W * G;
  const int64_t total = *total_chunks < max_chunks ? *total_chunks : max_chunks;
  if (first >= total) return;
  const int quads = (int)(d / 4);
  int len[G]; int32_t my_row[G]; int longest = 0;
  int64_t b[G];
#pragma unroll
  for (int c = 0; c < G; ++c) { const int64_t cc = first + c; const bool ok = cc < total; b[c] = ok ? cb[cc] : 0; len[c] = ok ? (int)cl[cc] : 0; }
#pragma unroll
  for (int c = 0; c < G; ++c) { my_row[c] = lane < len[c] ? (int32_t)order[b[c] + lane] : 0; longest = len[c] > longest ? len[c] : longest; }
  float4 acc[G];
#pragma unroll
  for (int c = 0; c < G; ++c) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4* rows = reinterpret_cast<const float4*>(grads);
  for (int r = 0; r < longest; ++r) {
    float4 x[G];
#pragma unroll
    for (int c = 0; c < G; ++c) {
      const int32_t row = __shfl_sync(kAll, my_row[c], r);
      x[c] = (r < len[c] && lane < quads) ? __ldg(rows + (int64_t)row * quads + lane) : make_float4(0.f,0.f,0.f,0.f);
    }
#pragma unroll
    for (int c = 0; c < G; ++c) { if (r < len[c]) { acc[c].x += x[c].x; acc[c].y += x[c].y; acc[c].z += x[c].z; acc[c].w += x[c].w; } }
  }
#pragma unroll
  for (int c = 0; c < G; ++c) {
    if (len[c] == 0) continue;
    const int64_t dest = cd[first + c];
    float* dst = dest >= 0 ? out + dest * d : partial + (~dest) * d;
    if (lane < quads) reinterpret_cast<float4*>(dst)[lane] = acc[c];
    const bool bad = dest >= 0 && lane < quads && (!isfinite(acc[c].x) || !isfinite(acc[c].y) || !isfinite(acc[c].z) || !isfinite(acc[c].w));
    if (__any_sync(kAll, bad) && lane == 0) *nonfinite = true;
  }
}
template <int G, int MINB, bool STAGED>
void run(at::Tensor grads, at::Tensor order, at::Tensor plan, int64_t unique, int64_t n, at::Tensor partial, at::Tensor out, at::Tensor bad) {
  const int64_t m = unique + n / 32 + 1;
  const int64_t* co = plan.data_ptr<int64_t>();
  const int64_t warps = (m + G - 1) / G;
  const unsigned blocks = (unsigned)((warps * 32 + 255) / 256);
  auto k = STAGED ? sums_staged<G, MINB> : sums<G, MINB>;
  k<<<blocks, 256, 0, at::cuda::getCurrentCUDAStream()>>>(grads.data_ptr<float>(), order.data_ptr<int64_t>(),
     co + unique + 1, co + unique + 1 + m, co + unique + 1 + 2 * m, co + unique, grads.size(1), m,
     partial.data_ptr<float>(), out.data_ptr<float>(), bad.data_ptr<bool>());
}
void variant(int64_t v, at::Tensor grads, at::Tensor order, at::Tensor plan, int64_t unique, at::Tensor partial, at::Tensor out, at::Tensor bad) {
  const int64_t n = grads.size(0);
  switch (v) {
    case 0: run<4, 6, false>(grads, order, plan, unique, n, partial, out, bad); break;
    case 1: run<1, 8, false>(grads, order, plan, unique, n, partial, out, bad); break;
    case 2: run<2, 8, false>(grads, order, plan, unique, n, partial, out, bad); break;
    case 3: run<2, 6, false>(grads, order, plan, unique, n, partial, out, bad); break;
    case 4: run<1, 6, false>(grads, order, plan, unique, n, partial, out, bad); break;
    case 5: run<2, 1, false>(grads, order, plan, unique, n, partial, out, bad); break;
    case 6: run<3, 8, false>(grads, order, plan, unique, n, partial, out, bad); break;
    case 7: run<2, 8, true>(grads, order, plan, unique, n, partial, out, bad); break;
  }
}
