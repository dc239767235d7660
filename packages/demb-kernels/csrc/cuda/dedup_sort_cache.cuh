// The dedup's sort scratch kept across calls, and its cub sort + scan replayed from a CUDA
// graph: cub's radix sort and scan are eight launches (histogram, bin offsets, a lookback reset
// and a pass per radix byte, the scan's init and pass), each costing the host ~10 us on the
// H200's hosts, more than their GPU time. Their buffers are the dedup's own scratch, so one
// graph per (n, sort bits) replays them for every batch of that size; the kernels that read
// the batch or write the outputs (prepare, scatter, counts) are launched as before. Include
// from dedup_cuda.cu only.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

namespace demb {

// Whether work queued on `stream` is being captured into a graph (a caller's torch.cuda.graph):
// a dedup then uses scratch of its own and launches its sort eagerly, so the caller's graph
// holds no buffer the cache hands to later calls.
inline bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// The sort and scan of SortScratch::run, run once with new cub scratch (no kept scratch).
template <typename Sizes, typename Run>
void sort_and_scan_eagerly(cudaStream_t stream, const at::TensorOptions& opts, Sizes sizes,
                           Run sort_and_scan) {
  size_t bytes = 0;
  sizes(bytes);
  const at::Tensor temp = at::empty({static_cast<int64_t>(bytes)}, opts.dtype(at::kByte));
  C10_CUDA_CHECK(sort_and_scan(temp.data_ptr(), bytes, stream));
}

// One stream's scratch for batches of n indices: the int64 rows (sort keys in and out, first
// flags, ranks) and the int32 rows (tables, tables by key, sorted tables, positions, positions
// by key, sorted positions), then per (sort bits, narrow keys) the graph of the sort and scan.
// A dedup holds `mutex` while it queues its work: its kernels and graph use these buffers in
// stream order, so two calls on one stream never interleave them.
struct SortScratch {
  at::Tensor scratch64;
  at::Tensor scratch32;
  std::mutex mutex;
  int64_t uses = 0;  // calls so far: a graph is made on the second (a size seen once is eager)

  struct Graph {
    cudaGraphExec_t exec = nullptr;
    at::Tensor temp;  // the sort's and the scan's cub scratch, captured into the graph
    bool failed = false;  // capture failed once: eager from then on
  };
  std::map<std::pair<int, bool>, Graph> graphs;

  SortScratch(int64_t n, const at::TensorOptions& opts)
      : scratch64(at::empty({4, n}, opts.dtype(at::kLong))),
        scratch32(at::empty({6, n}, opts.dtype(at::kInt))) {}
  SortScratch(const SortScratch&) = delete;
  SortScratch& operator=(const SortScratch&) = delete;
  ~SortScratch() {
    for (auto& [key, g] : graphs) {
      if (g.exec != nullptr) cudaGraphExecDestroy(g.exec);  // in flight: freed on completion
    }
  }

  // Runs `sort_and_scan(temp, bytes, stream)` (cub calls only, on `stream`, no allocation) on
  // `stream`: replayed from its graph when this (bits, narrow) has one, captured into one on
  // the second use, eager the first time and when capture fails. `sizes(bytes)` sets the cub
  // scratch bytes the calls need.
  template <typename Sizes, typename Run>
  void run(int bits, bool narrow, cudaStream_t stream, const at::TensorOptions& opts,
           Sizes sizes, Run sort_and_scan) {
    Graph& g = graphs[{bits, narrow}];
    if (!g.temp.defined()) {
      size_t bytes = 0;
      sizes(bytes);
      g.temp = at::empty({static_cast<int64_t>(bytes)}, opts.dtype(at::kByte));
    }
    if (g.exec == nullptr && !g.failed && uses >= 2) capture(g, sort_and_scan);
    if (g.exec != nullptr) {
      C10_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
      return;
    }
    C10_CUDA_CHECK(sort_and_scan(g.temp.data_ptr(), static_cast<size_t>(g.temp.numel()), stream));
  }

 private:
  // Captures the calls on a stream of their own (the caller's may be the legacy stream, which
  // cannot capture); on any error the graph is dropped and the calls run eagerly.
  template <typename Run>
  static void capture(Graph& g, Run sort_and_scan) {
    cudaStream_t side = nullptr;
    if (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) != cudaSuccess) {
      (void)cudaGetLastError();
      g.failed = true;
      return;
    }
    cudaGraph_t graph = nullptr;
    cudaError_t err = cudaStreamBeginCapture(side, cudaStreamCaptureModeThreadLocal);
    if (err == cudaSuccess) {
      const cudaError_t called =
          sort_and_scan(g.temp.data_ptr(), static_cast<size_t>(g.temp.numel()), side);
      err = cudaStreamEndCapture(side, &graph);
      if (called != cudaSuccess) err = called;
    }
    if (err == cudaSuccess) err = cudaGraphInstantiate(&g.exec, graph, 0);
    if (graph != nullptr) cudaGraphDestroy(graph);
    cudaStreamDestroy(side);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();  // clear it: the eager calls report their own
      g.exec = nullptr;
      g.failed = true;
    }
  }
};

// The scratch of the last few (device, stream, n) a dedup ran with; older ones are dropped.
// A stream is known by its handle, as PyTorch's caching allocator knows it: a stream destroyed
// while a dedup's work is queued on it must not have its handle reused for another (PyTorch's
// own streams never are; an external stream's owner keeps that rule).
class SortScratchCache {
 public:
  static std::shared_ptr<SortScratch> get(const at::TensorOptions& opts, cudaStream_t stream,
                                          int64_t n) {
    static std::mutex mutex;
    static std::map<std::array<int64_t, 3>, std::pair<int64_t, std::shared_ptr<SortScratch>>>
        entries;  // key -> (last use, scratch)
    static int64_t clock = 0;
    constexpr size_t kKept = 4;
    const std::array<int64_t, 3> key{opts.device().index(),
                                     static_cast<int64_t>(reinterpret_cast<uintptr_t>(stream)), n};
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = entries.find(key);
    if (it == entries.end()) {
      if (entries.size() >= kKept) {
        auto oldest = entries.begin();
        for (auto e = entries.begin(); e != entries.end(); ++e) {
          if (e->second.first < oldest->second.first) oldest = e;
        }
        entries.erase(oldest);
      }
      it = entries.emplace(key, std::make_pair(0, std::make_shared<SortScratch>(n, opts))).first;
    }
    it->second.first = ++clock;
    return it->second.second;
  }
};

}  // namespace demb
