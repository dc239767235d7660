// The key-ownership rule of row-wise sharding, shared by the CPU and CUDA kernels.
//
// Plain C++ (no torch headers), callable from host and device code. It must stay bit-for-bit
// equal to demb_planner.ownership (numpy), which is the rule's definition; tests check it.
//
// A key is taken by its unsigned 64-bit pattern u (int32 keys are sign-extended first).
//   continuous:      owner = u / B, local = u % B  if u < B * W, else as roundrobin
//   roundrobin:      owner = u % W, local = u / W
//   hash_roundrobin: h = fmix64(u); owner = h % W, local = h / W
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define DEMB_HD __host__ __device__ __forceinline__
#else
#define DEMB_HD inline
#endif

namespace demb {

enum class DistType : int32_t { kContinuous = 0, kRoundRobin = 1, kHashRoundRobin = 2 };

constexpr uint64_t kFmix64C1 = 0xff51afd7ed558ccdULL;
constexpr uint64_t kFmix64C2 = 0xc4ceb9fe1a85ec53ULL;

// MurmurHash3's 64-bit finalizer: a bijection on 64-bit words, fmix64(0) == 0.
DEMB_HD uint64_t fmix64(uint64_t k) {
  k ^= k >> 33;
  k *= kFmix64C1;
  k ^= k >> 33;
  k *= kFmix64C2;
  k ^= k >> 33;
  return k;
}

// Unsigned 64-bit pattern of a signed key of any width (sign-extended to 64 bits first).
template <typename Key>
DEMB_HD uint64_t key_bits(Key key) {
  return static_cast<uint64_t>(static_cast<int64_t>(key));
}

struct Route {
  int64_t owner;
  uint64_t local;
};

// Owner rank and rank-local position of key pattern `u`. `world` >= 1; `block` is the continuous
// block size (> 0, block * world < 2**64) and is ignored by the other rules.
DEMB_HD Route route_key(uint64_t u, DistType dist, uint64_t world, uint64_t block) {
  if (dist == DistType::kHashRoundRobin) {
    u = fmix64(u);
  } else if (dist == DistType::kContinuous && u < block * world) {
    return Route{static_cast<int64_t>(u / block), u % block};
  }
  return Route{static_cast<int64_t>(u % world), u / world};
}

}  // namespace demb
