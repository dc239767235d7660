// CUDA bindings of the ownership ops: allocation, validation and launch order. The algorithm is
// the CPU one (cpu/ownership_cpu.cpp): same rule, same stable order, identical outputs.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/ownership_kernels.cuh"
#include "op_checks.h"

namespace demb {
namespace {

at::Tensor hash64_cuda(const at::Tensor& keys_in) {
  check_keys(keys_in, "keys");
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  at::Tensor out = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  const int64_t n = keys.numel();
  if (n == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "demb::hash64", [&] {
    cuda::hash64_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(
        keys.const_data_ptr<index_t>(), n, out.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// route_keys (route_keys_op).
std::tuple<at::Tensor, at::Tensor> route_keys_cuda(const at::Tensor& keys_in, int64_t world_size,
                                                    DistType dist, int64_t block_size) {
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  at::Tensor owner = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  at::Tensor local = at::empty(keys.sizes(), keys.options().dtype(at::kLong));
  const int64_t n = keys.numel();
  if (n == 0) return {owner, local};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "demb::route_keys", [&] {
    cuda::route_keys_kernel<<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(
        keys.const_data_ptr<index_t>(), n, dist, static_cast<uint64_t>(world_size),
        static_cast<uint64_t>(block_size), owner.data_ptr<int64_t>(), local.data_ptr<int64_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {owner, local};
}

// Value checks that need the data: one device-to-host copy for all of them.
void check_bucketize_data(const at::Tensor& lengths, int64_t n, int64_t world_size,
                          const std::optional<at::Tensor>& block_sizes) {
  std::vector<at::Tensor> stats = {lengths.sum().to(at::kLong).reshape({1})};
  if (lengths.numel() > 0) stats.push_back(lengths.min().to(at::kLong).reshape({1}));
  if (block_sizes.has_value()) {
    stats.push_back(block_sizes->min().reshape({1}));
    stats.push_back(block_sizes->max().reshape({1}));
  }
  const at::Tensor host = at::cat(stats).cpu();
  const int64_t* s = host.const_data_ptr<int64_t>();
  TORCH_CHECK_VALUE(s[0] == n, "lengths sum to ", s[0], " but values has ", n, " entries");
  size_t next = 1;
  if (lengths.numel() > 0) {
    TORCH_CHECK_VALUE(s[next] >= 0, "lengths must be non-negative");
    ++next;
  }
  if (block_sizes.has_value()) {
    check_block_size(s[next], world_size);
    check_block_size(s[next + 1], world_size);
  }
}

template <typename Key, typename Weight>
void launch_scatter(const at::Tensor& order, const at::Tensor& values,
                    const std::optional<at::Tensor>& weights, at::Tensor& new_values,
                    std::optional<at::Tensor>& new_weights, at::Tensor& unbucketize,
                    cudaStream_t stream) {
  const int64_t n = values.numel();
  const auto* w_src =
      weights.has_value() ? static_cast<const Weight*>(weights->const_data_ptr()) : nullptr;
  auto* w_dst = new_weights.has_value() ? static_cast<Weight*>(new_weights->data_ptr()) : nullptr;
  cuda::bucketize_scatter_kernel<Key, Weight><<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(
      order.const_data_ptr<int64_t>(), n, values.const_data_ptr<Key>(), w_src,
      new_values.data_ptr<Key>(), w_dst, unbucketize.data_ptr<int64_t>());
}

// bucketize_by_owner (bucketize_by_owner_op).
BucketizeOutputs bucketize_by_owner_cuda(const at::Tensor& lengths_in, const at::Tensor& values_in,
                                         const std::optional<at::Tensor>& weights_in,
                                         int64_t world_size, DistType dist,
                                         const std::optional<at::Tensor>& block_sizes_in,
                                         int64_t batch) {
  check_bucketize_data(lengths_in, values_in.numel(), world_size, block_sizes_in);
  const c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor lengths = lengths_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const std::optional<at::Tensor> weights =
      weights_in.has_value() ? std::optional<at::Tensor>(weights_in->contiguous()) : std::nullopt;
  const std::optional<at::Tensor> block_sizes =
      block_sizes_in.has_value() ? std::optional<at::Tensor>(block_sizes_in->contiguous())
                                 : std::nullopt;
  const int64_t segments = lengths.numel();
  const int64_t n = values.numel();

  at::Tensor new_lengths = at::zeros({world_size * segments}, lengths.options());
  at::Tensor new_values = at::empty_like(values);
  at::Tensor unbucketize = at::empty({n}, values.options().dtype(at::kLong));
  std::optional<at::Tensor> new_weights;
  if (weights.has_value()) new_weights = at::empty_like(*weights);
  if (n == 0) return {new_lengths, new_values, new_weights, unbucketize};

  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  at::Tensor offsets = at::zeros({segments + 1}, lengths.options().dtype(at::kLong));
  offsets.narrow(0, 1, segments).copy_(at::cumsum(lengths, 0, at::kLong));
  at::Tensor owners = at::empty({n}, values.options().dtype(at::kInt));
  const int64_t* block_ptr = block_sizes.has_value() ? block_sizes->const_data_ptr<int64_t>()
                                                     : nullptr;
  AT_DISPATCH_INDEX_TYPES(lengths.scalar_type(), "demb::bucketize_by_owner", [&] {
    using Len = index_t;
    AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "demb::bucketize_by_owner", [&] {
      cuda::bucketize_count_kernel<Len, index_t>
          <<<cuda::grid_for(n), cuda::kThreads, 0, stream>>>(
              offsets.const_data_ptr<int64_t>(), segments, batch,
              values.const_data_ptr<index_t>(), n, block_ptr, dist,
              static_cast<uint64_t>(world_size), owners.data_ptr<int32_t>(),
              new_lengths.data_ptr<Len>());
    });
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // A stable sort by owner keeps each rank's values in input order (what the CPU loop does).
  const at::Tensor order = std::get<1>(at::sort(owners, /*stable=*/true, /*dim=*/0,
                                                /*descending=*/false));
  const int64_t weight_bytes = weights.has_value() ? weights->element_size() : 1;
  AT_DISPATCH_INDEX_TYPES(values.scalar_type(), "demb::bucketize_by_owner", [&] {
    const auto scatter = [&](auto word) {  // weights moved as unsigned words of their size
      launch_scatter<index_t, decltype(word)>(order, values, weights, new_values, new_weights,
                                              unbucketize, stream);
    };
    switch (weight_bytes) {
      case 1: return scatter(uint8_t{});
      case 2: return scatter(uint16_t{});
      case 4: return scatter(uint32_t{});
      case 8: return scatter(uint64_t{});
      default:
        TORCH_CHECK_TYPE(false, "weights of ", weight_bytes, "-byte elements are not supported");
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {new_lengths, new_values, new_weights, unbucketize};
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) {
  m.impl("hash64", &hash64_cuda);
  m.impl("route_keys", &route_keys_op<route_keys_cuda>);
  m.impl("bucketize_by_owner", &bucketize_by_owner_op<bucketize_by_owner_cuda>);
}

}  // namespace demb
