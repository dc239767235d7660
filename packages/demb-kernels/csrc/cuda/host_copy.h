// Small device-to-host copies on a step's critical path (a forward's read-back of its sizes, a
// backward's NaN/inf flag) by a one-block kernel that stores into the pinned buffer through its
// device mapping: on the H200 a copy-engine transfer between two kernels of a stream left the
// GPU idle 5-8 us at each hand-over, a kernel about 1.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <functional>

namespace demb {

// The calling thread's pinned scratch on one device, for the small read-backs on a step's
// critical path: a pinned block from PyTorch's host allocator with its device mapping (none:
// copies go through the copy engine) and an event, made on the thread's first use of the device
// and kept for the thread's life, so a read-back makes no allocation, no device-address query
// and no event of its own (on a virtualized host each CUDA runtime call can cost several us of host
// time). One PinnedScratch holds it for one read-back or one backward's flag: a nested one on the
// same thread and device gets a scratch of its own, made and dropped with it.
class PinnedScratch {
 public:
  PinnedScratch(c10::DeviceIndex device, size_t bytes);
  ~PinnedScratch();
  PinnedScratch(const PinnedScratch&) = delete;
  PinnedScratch& operator=(const PinnedScratch&) = delete;

  // The first `bytes` bytes asked for: host address, and device address or null.
  void* host() const;
  void* device() const;

  // Queues a copy of `bytes` bytes (at most the scratch's) from device address `src` into the
  // scratch on `stream`, by a kernel through the device mapping, else by cudaMemcpyAsync.
  void copy_from(const void* src, size_t bytes, cudaStream_t stream) const;

  // Records the scratch's event on `stream` / waits for it.
  void record(cudaStream_t stream) const;
  void wait() const;

  struct Slot;  // one thread's scratch on one device (host_copy.cu)

 private:
  Slot* slot_;
  bool owned_;  // a nested scratch's own slot, freed with it
};

// `count` elements of `dtype` at device address `src`, read back into a new CPU tensor on
// `stream` through the thread's PinnedScratch: the host waits for the copy only (and the work
// before it), after `between` has queued its work behind the copy.
at::Tensor read_back_words(const void* src, int64_t count, at::ScalarType dtype,
                           cudaStream_t stream, c10::DeviceIndex device,
                           const std::function<void()>& between);

}  // namespace demb
