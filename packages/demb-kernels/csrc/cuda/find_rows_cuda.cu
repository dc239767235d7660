// CUDA kernel and bindings of table_find_rows and table_find_batch_rows: each key's slot (a
// lookup that touches no score) and its row, in one pass: table_lookup then gather_table_rows
// without the slots between them going through memory and a second launch; the batch form
// finds each index's table from its feature in the same pass. A warp takes 32 keys: each lane
// finds one (lane_find_home), then the warp copies their rows, kCopyRows at a time (the gather's
// copy).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda/dedup_cuda.h"
#include "cuda/feature_tables.cuh"
#include "cuda/gather_rows.cuh"
#include "cuda/host_copy.h"
#include "cuda/row_dispatch.cuh"
#include "cuda/table_find.cuh"
#include "dedup_checks.h"
#include "lookup_checks.h"
#include "table_checks.h"
#include "table_ops.h"

namespace demb {
namespace cuda {

// Rows a warp loads before storing them when a row is one float4 per lane: the 32 rows of its
// keys go in four such passes.
constexpr int kCopyRows = 8;

// slots[i] = the slot of keys[i] in its table or -1 (an invalid entry too); out[i] = that row's
// first dim columns as float32, zeros for -1. A warp takes 32 consecutive keys, one per lane:
// each lane's probe of its key's start slot is in flight with the 31 others, and the slots are
// stored in one coalesced write. (An earlier form took 4 keys per warp, one per 8-lane tile,
// 270 us for the reference batch on the H200: the probes' dependent loads were in flight for
// few keys at a time.)
template <typename T, bool Vec4, bool FromFeatures>
__global__ void __launch_bounds__(kLookupThreads)
    find_rows_kernel(TableView v, const __grid_constant__ GatherTables g,
                     const int64_t* __restrict__ keys, KeyTables k, int64_t n, int64_t dim,
                     bool rows4, int64_t* __restrict__ slots, float* __restrict__ out) {
  constexpr unsigned kAll = 0xffffffffu;
  __shared__ int64_t starts[FromFeatures ? kSharedFeatures : 1];
  __shared__ int64_t tables_of[FromFeatures ? kSharedFeatures : 1];
  if constexpr (FromFeatures) stage_features(k, starts, tables_of);
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t first = warp_index() * kLookupWarp;
  if (first >= n) return;  // the same for the warp's lanes
  const int64_t i = first + lane;
  int64_t slot = -1;
  int64_t t = 0;
  if (i < n) {
    const int64_t key = keys[i];
    if constexpr (FromFeatures) {
      t = feature_table(k, starts, tables_of, i);
    } else {
      t = k.tables[i];
    }
    if (valid_entry(v, key, t)) {
      const int64_t width = v.bucket_widths[t];
      const Home home = home_of(key, v.capacity(t), width);
      const int64_t offset = v.slot_offsets[t];
      const int64_t found = lane_find_home(v, offset + home.bucket_base, width, key, home);
      slot = found < 0 ? -1 : found - offset;
    }
    slots[i] = slot;
  }
  const int rows = static_cast<int>(n - first < kLookupWarp ? n - first : kLookupWarp);
  if constexpr (Vec4) {
    if (rows4) {
      for (int r0 = 0; r0 < rows; r0 += kCopyRows) {
        warp_copy_rows4<kCopyRows>(g, slot, t, r0, 1, first + r0, n, dim, lane, out);
      }
      return;
    }
  }
  for (int r = 0; r < rows; ++r) {
    const int64_t s = __shfl_sync(kAll, slot, r);
    const int64_t tr = __shfl_sync(kAll, t, r);
    warp_copy_row<T, Vec4>(g, s, tr, dim, lane, out + (first + r) * dim);
  }
}

}  // namespace cuda

namespace {

// The launch of find_rows_kernel over keys (N,) with their tables from `k`.
std::tuple<at::Tensor, at::Tensor> find_rows_launch(const IndexTensors& ix,
                                                    const GatherTables& g, at::TensorList values,
                                                    const at::Tensor& keys_in,
                                                    const cuda::KeyTables& k, int64_t dim) {
  const at::Tensor keys = keys_in.contiguous();
  const int64_t n = keys.numel();
  at::Tensor slots = at::empty({n}, keys.options());
  at::Tensor out = at::empty({n, dim}, keys.options().dtype(at::kFloat));
  if (n == 0) return {out, slots};
  const auto dtype = values[0].scalar_type();
  const bool vec4 = float4_rows(g, dtype, dim);
  const bool rows4 = vec4 && dim / 4 <= cuda::kLookupWarp;
  const int64_t warps = (n + cuda::kLookupWarp - 1) / cuda::kLookupWarp;
  const auto blocks = static_cast<unsigned>((warps * cuda::kLookupWarp + cuda::kLookupThreads - 1) /
                                            cuda::kLookupThreads);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const TableView v = make_view(ix, nullptr);
  const auto launch = [&](auto zero, auto vec) {
    const auto run = [&](auto from_features) {
      cuda::find_rows_kernel<decltype(zero), decltype(vec)::value,
                             decltype(from_features)::value>
          <<<blocks, cuda::kLookupThreads, 0, stream>>>(v, g, keys.const_data_ptr<int64_t>(), k,
                                                       n, dim, rows4, slots.data_ptr<int64_t>(),
                                                       out.data_ptr<float>());
    };
    if (k.tables == nullptr) {
      run(std::true_type{});
    } else {
      run(std::false_type{});
    }
  };
  cuda::dispatch_row_type(vec4, dtype, launch);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, slots};
}

// table_find_rows (table_find_rows_op).
std::tuple<at::Tensor, at::Tensor> find_rows_cuda(const IndexTensors& ix, const GatherTables& g,
                                                  at::TensorList values, const at::Tensor& keys,
                                                  const at::Tensor& table_ids_in, int64_t dim) {
  const c10::cuda::CUDAGuard guard(keys.device());
  const at::Tensor table_ids = table_ids_in.contiguous();
  const cuda::KeyTables k{table_ids.const_data_ptr<int64_t>(), nullptr, nullptr, 0, 0};
  return find_rows_launch(ix, g, values, keys, k, dim);
}

// The high-priority stream of `device` the batch checks run on, taken from the pool once. The
// pool hands out its streams in turn, and the caching allocator keeps a stream's freed blocks
// for that stream only: a new stream per call cost a cudaMalloc of a fresh segment on each of
// the first 32 calls (one per step, seen on the H200).
at::cuda::CUDAStream check_stream(c10::DeviceIndex device) {
  static std::mutex mutex;
  static std::vector<std::optional<at::cuda::CUDAStream>> streams(
      static_cast<size_t>(at::cuda::device_count()));
  const std::lock_guard<std::mutex> lock(mutex);
  auto& stream = streams.at(static_cast<size_t>(device));
  if (!stream) stream = at::cuda::getStreamFromPool(/*isHighPriority=*/true, device);
  return *stream;
}

// With check, the batch's checks run beside the lookup on a high-priority stream (their blocks
// go first as the lookup's retire) and the host waits for their copy only: it returns while
// the lookup runs (a bad batch changes nothing: its keys read as missing, then the error).
std::tuple<at::Tensor, at::Tensor> table_find_batch_rows_cuda(
    const at::Tensor& index_keys, const at::Tensor& digests, const at::Tensor& scores,
    const at::Tensor& slot_offsets, const at::Tensor& bucket_widths, const at::Tensor& policies,
    at::TensorList values, const at::Tensor& indices, const at::Tensor& offsets_in,
    const at::Tensor& feature_tables_in, int64_t batch_size, int64_t dim, bool check) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  check_dedup_args(indices, offsets_in, feature_tables_in, ix.num_tables(), batch_size,
                   std::nullopt, 64);
  // indices stand for the keys and their table ids here (check_dedup_args checked them).
  const GatherTables g = check_find_rows(ix, values, indices, indices, dim);
  const c10::cuda::CUDAGuard guard(indices.device());
  const at::Tensor offsets = offsets_in.contiguous();
  const at::Tensor feature_tables = feature_tables_in.contiguous();
  const at::cuda::CUDAStream stream = at::cuda::getCurrentCUDAStream();
  at::cuda::CUDAEvent inputs_ready;  // the checks read what the stream wrote before the op
  if (check) inputs_ready.record(stream);
  const cuda::KeyTables k{nullptr, offsets.const_data_ptr<int64_t>(),
                          feature_tables.const_data_ptr<int64_t>(), feature_tables.numel(),
                          batch_size};
  auto found = find_rows_launch(ix, g, values, indices, k, dim);
  if (check) {
    const at::cuda::CUDAStream side = check_stream(indices.device().index());
    inputs_ready.block(side);
    const at::cuda::CUDAStreamGuard on_side(side);
    // Allocated and freed on `side`, waited for before returning: no cross-stream reuse.
    const at::Tensor words =
        batch_checks_cuda(indices, offsets, feature_tables, ix.num_tables(), batch_size);
    const PinnedScratch host(indices.device().index(), words.nbytes());
    host.copy_from(words.const_data_ptr(), words.nbytes(), side.stream());
    host.record(side.stream());
    host.wait();
    raise_batch_checks(static_cast<const int64_t*>(host.host()), indices.numel(),
                       ix.num_tables());
  }
  return found;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) {
  m.impl("table_find_rows", &table_find_rows_op<find_rows_cuda>);
  m.impl("table_find_batch_rows", &table_find_batch_rows_cuda);
}

}  // namespace demb
