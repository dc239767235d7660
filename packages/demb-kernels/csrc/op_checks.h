// Argument checks shared by the CPU and CUDA bindings of the ownership ops. The Python wrappers
// (demb_kernels.ops) validate first with typed errors; these guard direct torch.ops calls.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string_view>
#include <tuple>

#include "named_choice.h"
#include "ownership.h"

namespace demb {

inline DistType parse_dist_type(std::string_view name) {
  static constexpr NamedChoice<DistType> kDistTypes[] = {
      {"continuous", DistType::kContinuous}, {"roundrobin", DistType::kRoundRobin},
      {"hash_roundrobin", DistType::kHashRoundRobin}};
  return parse_choice(name, kDistTypes, "dist_type",
                      "unknown; expected 'continuous', 'roundrobin' or 'hash_roundrobin'");
}

inline void check_keys(const at::Tensor& keys, const char* name) {
  TORCH_CHECK_TYPE(keys.scalar_type() == at::kLong || keys.scalar_type() == at::kInt, name,
                   " must be int64 or int32 ids, got ", keys.scalar_type());
}

// A continuous block size must be positive with block_size * world_size < 2**64.
inline void check_block_size(int64_t block_size, int64_t world_size) {
  TORCH_CHECK_VALUE(block_size >= 1, "block_size=", block_size,
                    ": dist_type='continuous' needs a positive block size");
  const auto world = static_cast<uint64_t>(world_size);
  TORCH_CHECK_VALUE(static_cast<uint64_t>(block_size) <= UINT64_MAX / world,
                    "block_size=", block_size, ": block_size * world_size must be < 2**64");
}

inline void check_routing(int64_t world_size, DistType dist, int64_t block_size) {
  TORCH_CHECK_VALUE(world_size >= 1, "world_size=", world_size, ": must be >= 1");
  if (dist == DistType::kContinuous) {
    check_block_size(block_size, world_size);
  } else {
    TORCH_CHECK_VALUE(block_size == 0, "block_size=", block_size,
                      ": only applies to dist_type='continuous'");
  }
}

// Checks of bucketize_by_owner's arguments that need no device sync. Returns the batch size
// (segments per feature) used to map a segment to its feature's block size.
inline int64_t check_bucketize(const at::Tensor& lengths, const at::Tensor& values,
                               const std::optional<at::Tensor>& weights, int64_t world_size,
                               DistType dist, const std::optional<at::Tensor>& block_sizes) {
  TORCH_CHECK_TYPE(lengths.scalar_type() == at::kLong || lengths.scalar_type() == at::kInt,
                   "lengths must be int64 or int32, got ", lengths.scalar_type());
  check_keys(values, "values");
  TORCH_CHECK_VALUE(lengths.dim() == 1 && values.dim() == 1, "lengths and values must be 1-D");
  TORCH_CHECK_VALUE(lengths.device() == values.device(), "lengths and values on different devices");
  TORCH_CHECK_VALUE(world_size >= 1 && world_size <= INT32_MAX, "world_size=", world_size,
                    ": must be in [1, 2**31 - 1]");
  if (weights.has_value()) {
    TORCH_CHECK_VALUE(weights->dim() == 1 && weights->numel() == values.numel(),
                      "weights must be 1-D with one weight per value");
    TORCH_CHECK_VALUE(weights->device() == values.device(), "weights on another device");
    TORCH_CHECK_TYPE(at::isFloatingType(weights->scalar_type()),
                     "weights must be floating point, got ", weights->scalar_type());
  }
  if (dist != DistType::kContinuous) {
    TORCH_CHECK_VALUE(!block_sizes.has_value(),
                      "block_sizes only applies to dist_type='continuous'");
    return std::max<int64_t>(lengths.numel(), 1);
  }
  TORCH_CHECK_VALUE(block_sizes.has_value(), "dist_type='continuous' needs block_sizes");
  TORCH_CHECK_TYPE(block_sizes->scalar_type() == at::kLong, "block_sizes must be int64");
  TORCH_CHECK_VALUE(block_sizes->dim() == 1 && block_sizes->numel() >= 1,
                    "block_sizes must be 1-D with one entry per feature");
  TORCH_CHECK_VALUE(block_sizes->device() == values.device(), "block_sizes on another device");
  const int64_t features = block_sizes->numel();
  TORCH_CHECK_VALUE(lengths.numel() % features == 0, "lengths has ", lengths.numel(),
                    " entries, not a multiple of the ", features, " features in block_sizes");
  return std::max<int64_t>(lengths.numel() / features, 1);
}

// The op route_keys, for every device: the checks above, then `Route`, the device's kernel,
// given (keys, world_size, the parsed dist, block_size).
template <auto Route>
std::tuple<at::Tensor, at::Tensor> route_keys_op(const at::Tensor& keys, int64_t world_size,
                                                 c10::string_view dist_type, int64_t block_size) {
  check_keys(keys, "keys");
  const DistType dist = parse_dist_type(dist_type);
  check_routing(world_size, dist, block_size);
  return Route(keys, world_size, dist, block_size);
}

// The op bucketize_by_owner, for every device: check_bucketize, then `Bucketize`, the device's
// kernel, given the arguments with dist parsed and the batch size check_bucketize returns.
using BucketizeOutputs = std::tuple<at::Tensor, at::Tensor, std::optional<at::Tensor>, at::Tensor>;

template <auto Bucketize>
BucketizeOutputs bucketize_by_owner_op(const at::Tensor& lengths, const at::Tensor& values,
                                       const std::optional<at::Tensor>& weights,
                                       int64_t world_size, c10::string_view dist_type,
                                       const std::optional<at::Tensor>& block_sizes) {
  const DistType dist = parse_dist_type(dist_type);
  const int64_t batch = check_bucketize(lengths, values, weights, world_size, dist, block_sizes);
  return Bucketize(lengths, values, weights, world_size, dist, block_sizes, batch);
}

}  // namespace demb
