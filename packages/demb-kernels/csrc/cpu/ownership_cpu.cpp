// CPU kernels of the ownership ops: hash64, route_keys, bucketize_by_owner.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "op_checks.h"
#include "ownership.h"

namespace demb {
namespace {

constexpr int64_t kGrain = 1 << 14;

at::Tensor hash64_cpu(const at::Tensor& keys_in) {
  check_keys(keys_in, "keys");
  const at::Tensor keys = keys_in.contiguous();
  at::Tensor out = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "demb::hash64", [&] {
    const index_t* src = keys.const_data_ptr<index_t>();
    at::parallel_for(0, keys.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        dst[i] = static_cast<int64_t>(fmix64(key_bits(src[i])));
      }
    });
  });
  return out;
}

// route_keys (route_keys_op).
std::tuple<at::Tensor, at::Tensor> route_keys_cpu(const at::Tensor& keys_in, int64_t world_size,
                                                   DistType dist, int64_t block_size) {
  const at::Tensor keys = keys_in.contiguous();
  at::Tensor owner = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  at::Tensor local = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  int64_t* owner_ptr = owner.data_ptr<int64_t>();
  int64_t* local_ptr = local.data_ptr<int64_t>();
  const auto world = static_cast<uint64_t>(world_size);
  const auto block = static_cast<uint64_t>(block_size);
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "demb::route_keys", [&] {
    const index_t* src = keys.const_data_ptr<index_t>();
    at::parallel_for(0, keys.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const Route r = route_key(key_bits(src[i]), dist, world, block);
        owner_ptr[i] = r.owner;
        local_ptr[i] = static_cast<int64_t>(r.local);
      }
    });
  });
  return {owner, local};
}

// Stable counting sort of the values by owner rank; see demb_kernels.ops.bucketize_by_owner.
template <typename Len, typename Key>
void bucketize_impl(const Len* lengths, int64_t segments, int64_t batch, const Key* values,
                    int64_t n, const int64_t* block_sizes, DistType dist, int64_t world_size,
                    Len* new_lengths, Key* new_values, int64_t* unbucketize,
                    const uint8_t* weights, uint8_t* new_weights, size_t weight_bytes) {
  std::vector<int32_t> owners(static_cast<size_t>(n));
  const auto world = static_cast<uint64_t>(world_size);
  int64_t j = 0;
  for (int64_t seg = 0; seg < segments; ++seg) {
    const uint64_t block =
        block_sizes == nullptr ? 0 : static_cast<uint64_t>(block_sizes[seg / batch]);
    for (Len k = 0; k < lengths[seg]; ++k, ++j) {
      const int64_t owner = route_key(key_bits(values[j]), dist, world, block).owner;
      owners[j] = static_cast<int32_t>(owner);
      ++new_lengths[owner * segments + seg];
    }
  }
  std::vector<int64_t> cursor(static_cast<size_t>(world_size), 0);
  int64_t start = 0;
  for (int64_t r = 0; r < world_size; ++r) {
    cursor[r] = start;
    for (int64_t seg = 0; seg < segments; ++seg) start += new_lengths[r * segments + seg];
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = cursor[owners[i]]++;
    new_values[pos] = values[i];
    unbucketize[i] = pos;
    if (weights != nullptr) {
      std::memcpy(new_weights + pos * weight_bytes, weights + i * weight_bytes, weight_bytes);
    }
  }
}

// bucketize_by_owner (bucketize_by_owner_op).
BucketizeOutputs bucketize_by_owner_cpu(const at::Tensor& lengths_in, const at::Tensor& values_in,
                                        const std::optional<at::Tensor>& weights_in,
                                        int64_t world_size, DistType dist,
                                        const std::optional<at::Tensor>& block_sizes_in,
                                        int64_t batch) {
  const at::Tensor lengths = lengths_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const int64_t segments = lengths.numel();
  const int64_t n = values.numel();
  TORCH_CHECK_VALUE(segments == 0 || lengths.min().item<int64_t>() >= 0,
                    "lengths must be non-negative");
  const int64_t total = lengths.sum().item<int64_t>();
  TORCH_CHECK_VALUE(total == n, "lengths sum to ", total, " but values has ", n, " entries");
  at::Tensor block_sizes;
  const int64_t* block_ptr = nullptr;
  if (block_sizes_in.has_value()) {
    block_sizes = block_sizes_in->contiguous();
    block_ptr = block_sizes.const_data_ptr<int64_t>();
    for (int64_t f = 0; f < block_sizes.numel(); ++f) check_block_size(block_ptr[f], world_size);
  }
  at::Tensor new_lengths = at::zeros({world_size * segments}, lengths.options());
  at::Tensor new_values = at::empty_like(values);
  at::Tensor unbucketize = at::empty({n}, values.options().dtype(at::kLong));
  std::optional<at::Tensor> new_weights;
  at::Tensor weights;
  const uint8_t* w_src = nullptr;
  uint8_t* w_dst = nullptr;
  size_t w_bytes = 0;
  if (weights_in.has_value()) {
    weights = weights_in->contiguous();
    new_weights = at::empty_like(weights);
    w_src = static_cast<const uint8_t*>(weights.const_data_ptr());
    w_dst = static_cast<uint8_t*>(new_weights->data_ptr());
    w_bytes = weights.element_size();
  }
  AT_DISPATCH_INDEX_TYPES(lengths.scalar_type(), "demb::bucketize_by_owner", [&] {
    using Len = index_t;
    AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "demb::bucketize_by_owner", [&] {
      bucketize_impl<Len, index_t>(lengths.const_data_ptr<Len>(), segments, batch,
                                   values.const_data_ptr<index_t>(), n, block_ptr, dist,
                                   world_size, new_lengths.data_ptr<Len>(),
                                   new_values.data_ptr<index_t>(), unbucketize.data_ptr<int64_t>(),
                                   w_src, w_dst, w_bytes);
    });
  });
  return {new_lengths, new_values, new_weights, unbucketize};
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) {
  m.impl("hash64", &hash64_cpu);
  m.impl("route_keys", &route_keys_op<route_keys_cpu>);
  m.impl("bucketize_by_owner", &bucketize_by_owner_op<bucketize_by_owner_cpu>);
}

}  // namespace demb
