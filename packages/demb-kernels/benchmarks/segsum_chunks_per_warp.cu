// Standalone (no torch): segment_chunk_sums_packed_kernel's loop with C chunks per warp, A rows
// of a chunk loaded ahead and B blocks per SM, on a synthetic copy of the reference workload's
// backward (ninth session). Build: nvcc -std=c++17 -O3 -arch=sm_90 --fmad=false. Its times did
// not carry over to the module (see results/segsum_chunks_per_warp_h200.txt). The packed kernel
// itself was replaced by the window sums (csrc/cuda/window_sums.cuh) in the tenth session.
#include <cuda_runtime.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

constexpr int kWarp = 32, kThreads = 256, kChunk = 32;
__device__ __forceinline__ int64_t warp_index() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarp;
}

template <int Chunks, int Ahead, int MinBlocks>
__global__ void __launch_bounds__(kThreads, MinBlocks)
    sums(const float* __restrict__ grads, const int64_t* __restrict__ order,
         const int64_t* __restrict__ chunk_begin, const int64_t* __restrict__ chunk_len,
         const int64_t* __restrict__ chunk_dest, const int64_t* __restrict__ total_chunks,
         int64_t d, int64_t max_chunks, bool skip_single, float* __restrict__ partial,
         float* __restrict__ out, bool* __restrict__ nonfinite) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % kWarp;
  const int64_t first = warp_index() * Chunks;
  const int64_t total = *total_chunks < max_chunks ? *total_chunks : max_chunks;
  if (first >= total) return;
  const int quads = static_cast<int>(d / 4);
  int len[Chunks];
  int32_t my_row[Chunks];
  int longest = 0;
#pragma unroll
  for (int c = 0; c < Chunks; ++c) {
    const int64_t cc = first + c;
    const bool ok = cc < total;
    const int64_t b = ok ? chunk_begin[cc] : 0;
    len[c] = ok ? static_cast<int>(chunk_len[cc]) : 0;
    my_row[c] = static_cast<int32_t>(lane < len[c] ? order[b + lane] : 0);
    longest = len[c] > longest ? len[c] : longest;
  }
  float4 acc[Chunks];
#pragma unroll
  for (int c = 0; c < Chunks; ++c) acc[c] = make_float4(0.f, 0.f, 0.f, 0.f);
  const float4* rows = reinterpret_cast<const float4*>(grads);
  for (int r = 0; r < longest; r += Ahead) {
    float4 x[Chunks][Ahead];
#pragma unroll
    for (int c = 0; c < Chunks; ++c) {
#pragma unroll
      for (int a = 0; a < Ahead; ++a) {
        const int32_t row = __shfl_sync(kAll, my_row[c], (r + a) & 31);
        if (r + a < len[c] && lane < quads) x[c][a] = __ldcs(rows + static_cast<int64_t>(row) * quads + lane);
      }
    }
#pragma unroll
    for (int c = 0; c < Chunks; ++c) {
#pragma unroll
      for (int a = 0; a < Ahead; ++a) {
        if (r + a < len[c] && lane < quads) {
          acc[c].x += x[c][a].x; acc[c].y += x[c][a].y; acc[c].z += x[c][a].z; acc[c].w += x[c][a].w;
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < Chunks; ++c) {
    if (len[c] == 0) continue;
    const int64_t dest = chunk_dest[first + c];
    float* dst = dest >= 0 ? out + dest * d : partial + (~dest) * d;
    const bool store = !(skip_single && dest >= 0 && len[c] == 1);
    if (store && lane < quads) reinterpret_cast<float4*>(dst)[lane] = acc[c];
    const bool bad = dest >= 0 && lane < quads &&
                     (!isfinite(acc[c].x) || !isfinite(acc[c].y) || !isfinite(acc[c].z) || !isfinite(acc[c].w));
    if (__any_sync(kAll, bad) && lane == 0) *nonfinite = true;
  }
}

__global__ void read_all(const float4* g, int64_t n4, float* sink) {
  float4 a = make_float4(0, 0, 0, 0);
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n4; i += (int64_t)gridDim.x * blockDim.x) {
    float4 x = __ldcs(g + i); a.x += x.x; a.y += x.y; a.z += x.z; a.w += x.w;
  }
  if (a.x == 1234.5f) *sink = a.y + a.z + a.w;
}

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s line %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

struct Dev {
  float *grads, *partial, *out; int64_t *order, *cb, *cl, *cd, *total; bool* flag; int64_t chunks, unique, n, d;
};

template <int C, int A, int B>
void run(const char* name, Dev& v, std::vector<float>& ref_out, std::vector<float>& ref_part, bool first) {
  int64_t warps = (v.chunks + C - 1) / C;
  unsigned blocks = (unsigned)((warps * kWarp + kThreads - 1) / kThreads);
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  std::vector<float> ms;
  for (int it = 0; it < 25; ++it) {
    CK(cudaMemset(v.out, 0, v.unique * v.d * 4));
    CK(cudaEventRecord(e0));
    sums<C, A, B><<<blocks, kThreads>>>(v.grads, v.order, v.cb, v.cl, v.cd, v.total, v.d, v.chunks, true, v.partial, v.out, v.flag);
    CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1)); CK(cudaGetLastError());
    float t; CK(cudaEventElapsedTime(&t, e0, e1)); if (it >= 5) ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  std::vector<float> o(v.unique * v.d), p(ref_part.size());
  CK(cudaMemcpy(o.data(), v.out, o.size() * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(p.data(), v.partial, p.size() * 4, cudaMemcpyDeviceToHost));
  bool same = true;
  if (first) { ref_out = o; ref_part = p; } else {
    same = memcmp(o.data(), ref_out.data(), o.size() * 4) == 0 && memcmp(p.data(), ref_part.data(), p.size() * 4) == 0;
  }
  cudaFuncAttributes at; CK(cudaFuncGetAttributes(&at, sums<C, A, B>));
  printf("%-28s median %8.1f us  min %8.1f us  regs %3d  same %d\n", name, ms[ms.size() / 2] * 1e3, ms[0] * 1e3, at.numRegs, (int)same);
}

int main() {
  const int T = 10; const int64_t per = 104857, rows = 1677721, D = 128; const double alpha = 1.05;
  std::mt19937_64 gen(1);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  std::vector<std::pair<std::pair<int, int64_t>, int64_t>> items;
  const double a = 1.0 - alpha, top = std::pow((double)(rows + 1), a);
  for (int t = 0; t < T; ++t)
    for (int64_t i = 0; i < per; ++i) {
      int64_t rank = (int64_t)std::floor(std::pow((top - 1.0) * uni(gen) + 1.0, 1.0 / a));
      rank = std::min<int64_t>(std::max<int64_t>(rank, 1), rows) - 1;
      int64_t id = (int64_t)(((unsigned __int128)rank * 2654435761ull) % rows);
      items.push_back({{t, id}, t * per + i});
    }
  std::sort(items.begin(), items.end());
  const int64_t n = items.size();
  std::vector<int64_t> order(n), starts;
  for (int64_t i = 0; i < n; ++i) {
    order[i] = items[i].second;
    if (i == 0 || items[i].first != items[i - 1].first) starts.push_back(i);
  }
  const int64_t U = starts.size();
  std::vector<int64_t> cb, cl, cd;
  int64_t single = 0, partials = 0;
  for (int64_t u = 0; u < U; ++u) {
    int64_t s = starts[u], e = u + 1 < U ? starts[u + 1] : n, k = (e - s + kChunk - 1) / kChunk;
    if (e - s == 1) ++single;
    for (int64_t j = 0; j < k; ++j) {
      int64_t c = cb.size();
      cb.push_back(s + j * kChunk); cl.push_back(std::min(s + (j + 1) * kChunk, e) - (s + j * kChunk));
      cd.push_back(k == 1 ? u : ~c); if (k > 1) ++partials;
    }
  }
  const int64_t C = cb.size();
  printf("N %ld U %ld singles %ld chunks %ld partial chunks %ld\n", n, U, single, C, partials);
  std::vector<float> g(n * D);
  std::mt19937 g2(2); std::normal_distribution<float> nd;
  for (auto& x : g) x = nd(g2);
  Dev v; v.chunks = C; v.unique = U; v.n = n; v.d = D;
  CK(cudaMalloc(&v.grads, n * D * 4)); CK(cudaMalloc(&v.partial, C * D * 4)); CK(cudaMalloc(&v.out, U * D * 4));
  CK(cudaMalloc(&v.order, n * 8)); CK(cudaMalloc(&v.cb, C * 8)); CK(cudaMalloc(&v.cl, C * 8)); CK(cudaMalloc(&v.cd, C * 8));
  CK(cudaMalloc(&v.total, 8)); CK(cudaMalloc(&v.flag, 1));
  CK(cudaMemcpy(v.grads, g.data(), n * D * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v.order, order.data(), n * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v.cb, cb.data(), C * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v.cl, cl.data(), C * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v.cd, cd.data(), C * 8, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v.total, &C, 8, cudaMemcpyHostToDevice));
  CK(cudaMemset(v.partial, 0, C * D * 4)); CK(cudaMemset(v.flag, 0, 1));
  {
    float* sink; CK(cudaMalloc(&sink, 4));
    cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int it = 0; it < 25; ++it) {
      CK(cudaEventRecord(e0)); read_all<<<132 * 8, 256>>>((const float4*)v.grads, n * D / 4, sink); CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1)); float t; CK(cudaEventElapsedTime(&t, e0, e1)); if (it >= 5) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    printf("read all grads (%.0f MB): %.1f us = %.2f TB/s\n", n * D * 4 / 1e6, ms[ms.size() / 2] * 1e3, n * D * 4 / (ms[ms.size() / 2] * 1e-3) / 1e12);
  }
  std::vector<float> ro, rp(C * D);
  run<2, 1, 8>("chunks2 ahead1 b8 (now)", v, ro, rp, true);
  run<1, 2, 8>("chunks1 ahead2 b8", v, ro, rp, false);
  run<1, 1, 8>("chunks1 ahead1 b8", v, ro, rp, false);
  run<1, 3, 8>("chunks1 ahead3 b8", v, ro, rp, false);
  run<1, 2, 7>("chunks1 ahead2 b7", v, ro, rp, false);
  run<1, 2, 6>("chunks1 ahead2 b6", v, ro, rp, false);
  run<1, 3, 6>("chunks1 ahead3 b6", v, ro, rp, false);
  run<2, 2, 7>("chunks2 ahead2 b7", v, ro, rp, false);
  run<1, 2, 8>("chunks1 ahead2 b8 (again)", v, ro, rp, false);
  return 0;
}
