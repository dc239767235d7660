// Whether a pointer allows 16-byte (float4) loads and stores: the test behind every kernel's
// Vec4 path, shared by the CUDA bindings (lookup, find_rows, pool, optimizer_update).
#pragma once

#include <cstdint>

namespace demb {

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace demb
