// The clock of timed scores on the GPU: its global timer (ns), read by timestamp_kernel and by
// dedup_launch's clock words (dedup_prepare_kernel).
#pragma once

#include <cstdint>

namespace demb {
namespace cuda {

__device__ __forceinline__ int64_t global_timer() {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  return static_cast<int64_t>(now);
}

}  // namespace cuda
}  // namespace demb
