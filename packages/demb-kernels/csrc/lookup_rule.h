// The two row ops of a table module step, shared by the CPU and CUDA kernels (plain C++):
//
// gather_table_rows: out[i] = float(values[t][slot, :dim]) for u = inverse[i] (u = i without
//   inverse), t = tables[u], slot = slots[u]; zeros for slot -1 (a key without a row).
// segment_sum_rows: out[u] = the sum of grads[order[k]] for k in [starts[u], starts[u + 1])
//   (the last segment ends at N), summed in a fixed order on every device: the segment is cut
//   into chunks of kSegmentChunk rows, each chunk summed in k order, then the chunk sums in
//   chunk order; a segment of one chunk is that chunk's sum. Long segments (hot keys) thus
//   spread over many warps on a GPU, and the CPU and the GPU give the same float. Also returns
//   whether any sum is NaN or infinite (the check before an optimizer update, for free).
#pragma once

#include <cstdint>

#include "ownership.h"  // DEMB_HD

namespace demb {

constexpr int64_t kSegmentChunk = 32;

// The most tables one gather_table_rows call takes (their pointers travel by value).
constexpr int kMaxGatherTables = 64;

struct GatherTables {
  const void* base[kMaxGatherTables];
  int64_t rows[kMaxGatherTables];
  int64_t width[kMaxGatherTables];
  int64_t count;
};

// Chunks of a segment of `length` rows.
DEMB_HD int64_t segment_chunks(int64_t length) {
  return (length + kSegmentChunk - 1) / kSegmentChunk;
}

}  // namespace demb
