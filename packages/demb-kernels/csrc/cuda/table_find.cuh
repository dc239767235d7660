// Finding a key in its bucket on CUDA (docs/hash_table.md), by one lane alone: its digests 16 at a
// time from its start slot's chunk (thread_find), after its start slot (lane_find_home). Device
// functions only, so that several .cu files can share them (kernels defined in a header would
// be defined twice).
#pragma once

#include <cstdint>

#include "table_rule.h"

namespace demb {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 8;

__device__ __forceinline__ bool valid_entry(const TableView& v, int64_t key, int64_t t) {
  return t >= 0 && t < v.num_tables && key != kEmptyKey;
}

constexpr int64_t kDigestChunk = 16;  // digests one 16-byte load covers

__device__ __forceinline__ uint4 load_digests(const TableView& v, int64_t g) {
  return *reinterpret_cast<const uint4*>(v.digests + g);
}

// Bit mask of the bytes of a 16-digest chunk that satisfy `match` (bit j = slot j).
template <typename Match>
__device__ __forceinline__ uint32_t chunk_mask(uint4 d, Match match) {
  const uint32_t words[4] = {d.x, d.y, d.z, d.w};
  uint32_t mask = 0;
  for (int q = 0; q < 4; ++q) {
    const uint32_t m = match(words[q]);  // 0xFF per matching byte
    for (int b = 0; b < 4; ++b) mask |= ((m >> (8 * b)) & 1u) << (4 * q + b);
  }
  return mask;
}

// Global slot of `key` in the bucket at global slot `base`, or -1: its digests scanned a chunk
// at a time in circular order from the chunk holding in-bucket position `start` (the key's
// home start: an insert puts a key at the first empty slot from there, so it is most often in
// that chunk or the next, and fewer digest matches elsewhere cost a key load first: the
// reference batch's gated lookup took 41.1-41.6 us against 44.6-44.7 us scanning from the
// bucket's first chunk, on an H200). A key is in its bucket at most once: the same slot
// whatever the order.
__device__ inline int64_t thread_find(const TableView& v, int64_t base, int64_t width,
                                      int64_t key, uint8_t digest, int64_t start) {
  const uint32_t pattern = 0x01010101u * digest;
  const int64_t first = start - start % kDigestChunk;
  for (int64_t c = 0; c < width; c += kDigestChunk) {
    const int64_t j0 = first + c < width ? first + c : first + c - width;
    uint32_t m = chunk_mask(load_digests(v, base + j0),
                            [&](uint32_t w) { return __vcmpeq4(w & 0x7F7F7F7Fu, pattern); });
    while (m) {
      const int j = __ffs(m) - 1;
      if (v.keys[base + j0 + j] == key) return base + j0 + j;
      m &= m - 1;
    }
  }
  return -1;
}

// thread_find trying the key's start slot first, whose key word `at_home` the caller loaded: an
// insert puts a key there when that slot is empty, so most keys are there. Only the start slot's
// key word is loaded: a slot's key word equals a (valid) key only while the slot holds it (an
// erase clears the word with the digest), so a match needs no digest, and a hit costs one random
// sector, not two. The bucket is scanned only when the start slot does not hold the key. The
// same slot as thread_find (a key is in its bucket at most once).
__device__ __forceinline__ int64_t find_after_home(const TableView& v, int64_t base,
                                                   int64_t width, int64_t key, const Home& home,
                                                   int64_t at_home) {
  if (at_home == key) return base + home.start;
  return thread_find(v, base, width, key, home.digest, home.start);
}

// find_after_home, loading the start slot's key word itself.
__device__ __forceinline__ int64_t lane_find_home(const TableView& v, int64_t base, int64_t width,
                                                  int64_t key, const Home& home) {
  return find_after_home(v, base, width, key, home, v.keys[base + home.start]);
}

}  // namespace cuda
}  // namespace demb
