// Launch sequences captured once into CUDA graphs over buffers they own, then replayed with one
// cudaGraphLaunch instead of one runtime call per kernel or memset (on the H200's hosts each
// such call costs several microseconds on the forward's path). Host code only.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <exception>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace demb {
namespace cuda {

// One captured sequence and the buffers its launches read and write.
struct Replay {
  std::vector<at::Tensor> buffers;
  cudaGraphExec_t exec = nullptr;

  Replay() = default;
  Replay(const Replay&) = delete;
  Replay& operator=(const Replay&) = delete;
  ~Replay() {
    if (exec != nullptr) cudaGraphExecDestroy(exec);  // freed once its launches complete
  }

  void launch(cudaStream_t stream) const { C10_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }
};

// The stream captures run on, one per device, made once (a stream of torch's pool could be in
// use by another thread while it is being captured).
inline cudaStream_t capture_stream(int device) {
  static std::mutex mutex;
  static std::vector<cudaStream_t> streams;
  const std::lock_guard<std::mutex> lock(mutex);
  if (streams.size() <= static_cast<size_t>(device)) {
    streams.resize(static_cast<size_t>(device) + 1, nullptr);
  }
  cudaStream_t& s = streams[static_cast<size_t>(device)];
  if (s == nullptr) C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

// Captures what `record(stream)` queues on the stream it is given (launches and memsets only: no
// sync, no allocation, no host read) into replay.exec. False when the capture failed: nothing
// is kept and the CUDA error is cleared (the caller then runs the sequence directly).
inline bool capture(Replay& replay, const std::function<void(cudaStream_t)>& record) {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const cudaStream_t side = capture_stream(device);
  if (cudaStreamBeginCapture(side, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  bool recorded = true;
  try {
    record(side);
  } catch (const std::exception&) {
    recorded = false;
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t ended = cudaStreamEndCapture(side, &graph);
  bool made = recorded && ended == cudaSuccess && graph != nullptr;
  if (made) made = cudaGraphInstantiate(&replay.exec, graph, 0) == cudaSuccess;
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (!made) {
    replay.exec = nullptr;
    (void)cudaGetLastError();
  }
  return made;
}

// Up to `capacity` replays by key, the least recently used dropped first. A caller holds `mutex`
// from get() until the last launch that uses the replay's buffers is queued: the next call
// reuses them, and stream order (keys name the stream) puts it after those launches.
template <typename Key>
class ReplayCache {
 public:
  explicit ReplayCache(size_t capacity) : capacity_(capacity) {}

  std::mutex mutex;

  // The replay of `key`, made by `make` (which allocates its buffers and captures) when there is
  // none; nullptr when its capture failed (a failed key is remembered, not captured again).
  Replay* get(const Key& key, const std::function<bool(Replay&)>& make) {
    for (auto it = entries_.begin(); it != entries_.end(); ++it) {
      if (it->first == key) {
        entries_.splice(entries_.begin(), entries_, it);
        return entries_.front().second.get();
      }
    }
    auto replay = std::make_unique<Replay>();
    if (!make(*replay)) replay.reset();
    entries_.emplace_front(key, std::move(replay));
    if (entries_.size() > capacity_) entries_.pop_back();
    return entries_.front().second.get();
  }

 private:
  size_t capacity_;
  std::list<std::pair<Key, std::unique_ptr<Replay>>> entries_;
};

}  // namespace cuda
}  // namespace demb
