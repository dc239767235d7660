// Digest scans of one bucket on the CPU, shared by the table kernels (table_cpu.cpp) and the
// slot writes of a replay (slot_writes_cpu.cpp).
#pragma once

#include <cstdint>
#include <cstring>

#include "table_rule.h"

namespace demb {

constexpr uint64_t kLowBits = 0x0101010101010101ULL;
constexpr uint64_t kHighBits = 0x8080808080808080ULL;

// Eight digests of a bucket (widths are multiples of 16, so a group never crosses it).
inline uint64_t digest_group(const TableView& v, int64_t g) {
  uint64_t word;
  std::memcpy(&word, v.digests + g, sizeof(word));
  return word;
}

// High bit set in (at least) every zero byte of `x`; a byte above a zero byte may be flagged
// too, so callers confirm each candidate.
inline uint64_t zero_bytes(uint64_t x) { return (x - kLowBits) & ~x & kHighBits; }

// Global slot of `key` in its bucket, or -1; compares eight digests at a time, from the group
// of the key's start position on (where an insert puts it when it can), circularly.
inline int64_t find_in_bucket(const TableView& v, int64_t base, int64_t width, int64_t key,
                              uint8_t digest, int64_t start) {
  const uint64_t pattern = kLowBits * digest;
  const int64_t first = start - start % 8;
  for (int64_t c = 0; c < width; c += 8) {
    const int64_t j0 = first + c < width ? first + c : first + c - width;
    uint64_t candidates = zero_bytes((digest_group(v, base + j0) & ~kHighBits) ^ pattern);
    while (candidates) {
      const int64_t g = base + j0 + __builtin_ctzll(candidates) / 8;
      if ((v.digests[g] & ~kProtectedBit) == digest && v.keys[g] == key) return g;
      candidates &= candidates - 1;
    }
  }
  return -1;
}

}  // namespace demb
