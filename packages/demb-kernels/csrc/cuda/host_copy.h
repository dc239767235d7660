// Small device-to-host copies on a step's critical path (a forward's read-back of its sizes, a
// backward's NaN/inf flag) by a one-block kernel that stores into the pinned buffer through its
// device mapping: on the H200 a copy-engine transfer between two kernels of a stream left the
// GPU idle 5-8 us at each hand-over, a kernel about 1.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstddef>

namespace demb {

// Queues a copy of `bytes` bytes from device address `src` to pinned host address `dst` on
// `stream`: by a kernel storing through dst's device mapping when it has one (pinned memory
// under unified addressing), else by cudaMemcpyAsync. The host reads dst once the stream's
// work up to here is done (an event recorded after it, synchronized).
void copy_to_pinned_async(void* dst, const void* src, size_t bytes, cudaStream_t stream);

// The same for tensors, on the current stream of src's device: `host` a pinned CPU tensor,
// `src` a CUDA tensor, both contiguous, of the same number of bytes (unchecked).
void copy_to_pinned_async(const at::Tensor& host, const at::Tensor& src);

// The device address of pinned CPU tensor `host`'s data (its device mapping, as
// copy_to_pinned_async uses it), or null when it has none (registered without mapping): a
// kernel may then store into it directly.
void* pinned_device_address(const at::Tensor& host);

}  // namespace demb
