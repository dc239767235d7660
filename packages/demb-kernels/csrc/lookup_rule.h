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
// segment_plan: the chunks of segment_sum_rows for given starts (PlanLayout), made ahead (a
//   training forward makes it while its gather runs, so its backward launches only the sums).
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

// segment_plan's int64 array for U segments over N rows: chunk_offsets (U + 1: chunk_offsets[u]
// is segment u's first chunk, chunk_offsets[U] the number of chunks), then per chunk c < that
// number, in three columns of max_chunks() entries: its first position in `order`, its rows
// (<= kSegmentChunk), and its destination (u: out row u, the segment's only chunk; ~c: partial
// row c, added into out by the finish pass).
struct PlanLayout {
  int64_t unique;
  int64_t n;
  // A bound on the chunks: sum over u of ceil(len_u / kSegmentChunk) <= U + N / kSegmentChunk.
  int64_t max_chunks() const { return unique + n / kSegmentChunk + 1; }
  int64_t begin() const { return unique + 1; }
  int64_t len() const { return begin() + max_chunks(); }
  int64_t dest() const { return len() + max_chunks(); }
  int64_t size() const { return dest() + max_chunks(); }
};

}  // namespace demb
