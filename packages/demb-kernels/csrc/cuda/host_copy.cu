// copy_to_pinned_async (cuda/host_copy.h).
#include "cuda/host_copy.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace demb {
namespace {

constexpr int kCopyThreads = 128;

// dst[i] = src[i] for i < count words of Word (8 bytes when both ends and the size allow, else
// bytes); the stores are made visible to the host before the kernel ends.
template <typename Word>
__global__ void __launch_bounds__(kCopyThreads)
    copy_to_host_kernel(const Word* __restrict__ src, size_t count, Word* dst) {
  for (size_t i = threadIdx.x; i < count; i += kCopyThreads) dst[i] = src[i];
  __threadfence_system();
}

}  // namespace

void copy_to_pinned_async(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return;
  void* mapped = nullptr;
  if (cudaHostGetDevicePointer(&mapped, dst, 0) != cudaSuccess || mapped == nullptr) {
    (void)cudaGetLastError();  // not mapped (e.g. registered without mapping): the copy engine
    C10_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream));
    return;
  }
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

void* pinned_device_address(const at::Tensor& host) {
  void* mapped = nullptr;
  if (cudaHostGetDevicePointer(&mapped, host.data_ptr(), 0) != cudaSuccess) {
    (void)cudaGetLastError();  // not mapped
    return nullptr;
  }
  return mapped;
}

void copy_to_pinned_async(const at::Tensor& host, const at::Tensor& src) {
  const c10::cuda::CUDAGuard guard(src.device());
  copy_to_pinned_async(host.data_ptr(), src.const_data_ptr(), src.nbytes(),
                       at::cuda::getCurrentCUDAStream());
}

}  // namespace demb
