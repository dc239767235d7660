// PinnedScratch and read_back_words (cuda/host_copy.h).
#include "cuda/host_copy.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace demb {
namespace {

constexpr int kCopyThreads = 128;
constexpr size_t kMinScratchBytes = 4096;

// dst[i] = src[i] for i < count words of Word (8 bytes when both ends and the size allow, else
// bytes); the stores are made visible to the host before the kernel ends.
template <typename Word>
__global__ void __launch_bounds__(kCopyThreads)
    copy_to_host_kernel(const Word* __restrict__ src, size_t count, Word* dst) {
  for (size_t i = threadIdx.x; i < count; i += kCopyThreads) dst[i] = src[i];
  __threadfence_system();
}

// The copy of `bytes` bytes from device address `src` to the device mapping `mapped` of pinned
// host memory, by copy_to_host_kernel.
void launch_copy_kernel(void* mapped, const void* src, size_t bytes, cudaStream_t stream) {
  const auto s = reinterpret_cast<uintptr_t>(src);
  const auto d = reinterpret_cast<uintptr_t>(mapped);
  if (s % 8 == 0 && d % 8 == 0 && bytes % 8 == 0) {
    copy_to_host_kernel<<<1, kCopyThreads, 0, stream>>>(static_cast<const uint64_t*>(src),
                                                        bytes / 8, static_cast<uint64_t*>(mapped));
  } else {
    copy_to_host_kernel<<<1, kCopyThreads, 0, stream>>>(static_cast<const uint8_t*>(src), bytes,
                                                        static_cast<uint8_t*>(mapped));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The device address of pinned CPU tensor `host`'s data (its device mapping), or null when it
// has none (registered without mapping): copies then go through the copy engine.
void* pinned_device_address(const at::Tensor& host) {
  void* mapped = nullptr;
  if (cudaHostGetDevicePointer(&mapped, host.data_ptr(), 0) != cudaSuccess) {
    (void)cudaGetLastError();  // not mapped
    return nullptr;
  }
  return mapped;
}

}  // namespace

// One thread's scratch on one device.
struct PinnedScratch::Slot {
  at::Tensor block;        // pinned bytes, from PyTorch's host allocator
  void* mapped = nullptr;  // block's device address (null: not mapped)
  size_t capacity = 0;
  cudaEvent_t event = nullptr;
  bool busy = false;

  Slot() = default;
  Slot(const Slot&) = delete;
  Slot& operator=(const Slot&) = delete;
  ~Slot() {
    // Errors ignored: a thread's slots may go at process exit, the runtime already shutting down.
    if (event != nullptr) (void)cudaEventDestroy(event);
  }

  // At least `bytes` bytes and an event on `device`. A smaller block is replaced: the slot is
  // idle here, every earlier use waited for its copy.
  void fit(c10::DeviceIndex device, size_t bytes) {
    const bool small = capacity == 0 || capacity < bytes;  // a block of some size always
    if (!small && event != nullptr) return;
    const c10::cuda::CUDAGuard guard(device);
    if (small) {
      size_t want = kMinScratchBytes;
      while (want < bytes) want *= 2;
      block = at::empty({static_cast<int64_t>(want)},
                        at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      mapped = pinned_device_address(block);
      capacity = want;
    }
    if (event == nullptr) C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  }
};

namespace {

// The calling thread's slots, by device index.
std::vector<std::unique_ptr<PinnedScratch::Slot>>& thread_slots() {
  thread_local std::vector<std::unique_ptr<PinnedScratch::Slot>> slots;
  return slots;
}

}  // namespace

PinnedScratch::PinnedScratch(c10::DeviceIndex device, size_t bytes) : slot_(nullptr), owned_(false) {
  TORCH_CHECK(device >= 0, "PinnedScratch: a CUDA device index, got ", static_cast<int>(device));
  auto& slots = thread_slots();
  if (slots.size() <= static_cast<size_t>(device)) slots.resize(static_cast<size_t>(device) + 1);
  std::unique_ptr<Slot>& mine = slots[static_cast<size_t>(device)];
  if (!mine) mine = std::make_unique<Slot>();
  if (mine->busy) {  // nested on this thread: a slot of its own
    auto own = std::make_unique<Slot>();
    own->fit(device, bytes);
    slot_ = own.release();
    owned_ = true;
    return;
  }
  mine->fit(device, bytes);
  mine->busy = true;
  slot_ = mine.get();
}

PinnedScratch::~PinnedScratch() {
  if (owned_) {
    delete slot_;
  } else {
    slot_->busy = false;
  }
}

void* PinnedScratch::host() const { return slot_->block.data_ptr(); }

void* PinnedScratch::device() const { return slot_->mapped; }

void PinnedScratch::copy_from(const void* src, size_t bytes, cudaStream_t stream) const {
  TORCH_CHECK(bytes <= slot_->capacity, "PinnedScratch: ", bytes, " bytes for a scratch of ",
              slot_->capacity);
  if (bytes == 0) return;
  if (slot_->mapped == nullptr) {
    C10_CUDA_CHECK(cudaMemcpyAsync(host(), src, bytes, cudaMemcpyDeviceToHost, stream));
    return;
  }
  launch_copy_kernel(slot_->mapped, src, bytes, stream);
}

void PinnedScratch::record(cudaStream_t stream) const {
  C10_CUDA_CHECK(cudaEventRecord(slot_->event, stream));
}

void PinnedScratch::wait() const { C10_CUDA_CHECK(cudaEventSynchronize(slot_->event)); }

at::Tensor read_back_words(const void* src, int64_t count, at::ScalarType dtype,
                           cudaStream_t stream, c10::DeviceIndex device,
                           const std::function<void()>& between) {
  const size_t bytes = static_cast<size_t>(count) * c10::elementSize(dtype);
  const PinnedScratch scratch(device, bytes);
  scratch.copy_from(src, bytes, stream);
  scratch.record(stream);
  try {
    if (between) between();
  } catch (...) {
    scratch.wait();  // the scratch goes to the next read-back only once the copy is done
    throw;
  }
  scratch.wait();
  at::Tensor out = at::empty({count}, at::TensorOptions().dtype(dtype));
  if (bytes > 0) std::memcpy(out.data_ptr(), scratch.host(), bytes);
  return out;
}

}  // namespace demb
