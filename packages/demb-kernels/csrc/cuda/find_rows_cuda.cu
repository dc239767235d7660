// CUDA kernel and binding of table_find_rows: each key's slot (a lookup that touches no score)
// and its row, in one pass: table_lookup then gather_table_rows without the slots between them
// going through memory and a second launch. A warp takes kGatherRows keys: each of its 8-lane
// tiles finds one key (phase A's tile_find), then the warp copies the rows (the gather's copy).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>
#include <type_traits>

#include "cuda/gather_rows.cuh"
#include "cuda/row_dispatch.cuh"
#include "cuda/table_find.cuh"
#include "lookup_checks.h"
#include "table_checks.h"

namespace demb {
namespace cuda {

static_assert(kGatherRows * kFindTile == kLookupWarp, "a warp's tiles find kGatherRows keys");

// slots[i] = the slot of keys[i] in table tables[i] or -1 (an invalid entry too); out[i] = that
// row's first dim columns as float32, zeros for -1. (Measured on the H200: finding 16 keys per
// warp with their loads interleaved needs 64 registers and ran slower, 343 us against 290 us
// for the reference batch, than 4 keys per warp at 48 registers. Bounded to 6 blocks per SM:
// 40 registers and a 16-byte spill, for more warps in flight on the probes' dependent loads.)
template <typename T, bool Vec4>
__global__ void __launch_bounds__(kLookupThreads, 6)
    find_rows_kernel(TableView v, const __grid_constant__ GatherTables g,
                     const int64_t* __restrict__ keys, const int64_t* __restrict__ tables,
                     int64_t n, int64_t dim, bool rows4, int64_t* __restrict__ slots,
                     float* __restrict__ out) {
  constexpr unsigned kAll = 0xffffffffu;
  const auto tile = cg::tiled_partition<kFindTile>(cg::this_thread_block());
  const int lane = static_cast<int>(threadIdx.x % kLookupWarp);
  const int64_t first = warp_index() * kGatherRows;
  if (first >= n) return;  // the same for the warp's lanes
  const int64_t i = first + lane / kFindTile;  // the same for a tile's lanes
  int64_t slot = -1;
  int64_t t = 0;
  if (i < n) {
    const int64_t key = keys[i];
    t = tables[i];
    if (valid_entry(v, key, t)) {
      const int64_t width = v.bucket_widths[t];
      const Home home = home_of(key, v.capacity(t), width);
      const int64_t base = v.slot_offsets[t] + home.bucket_base;
      const int64_t found = tile_find(tile, v, base, width, key, home.digest);
      slot = found < 0 ? -1 : found - v.slot_offsets[t];
    }
    if (tile.thread_rank() == 0) slots[i] = slot;
  }
  if constexpr (Vec4) {
    if (rows4) {
      warp_copy_rows4(g, slot, t, kFindTile, first, n, dim, lane, out);
      return;
    }
  }
  for (int r = 0; r < kGatherRows; ++r) {
    const int64_t s = __shfl_sync(kAll, slot, r * kFindTile);
    const int64_t tr = __shfl_sync(kAll, t, r * kFindTile);
    if (first + r < n) warp_copy_row<T, Vec4>(g, s, tr, dim, lane, out + (first + r) * dim);
  }
}

}  // namespace cuda

namespace {

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

std::tuple<at::Tensor, at::Tensor> table_find_rows_cuda(
    const at::Tensor& index_keys, const at::Tensor& digests, const at::Tensor& scores,
    const at::Tensor& slot_offsets, const at::Tensor& bucket_widths, const at::Tensor& policies,
    at::TensorList values, const at::Tensor& keys_in, const at::Tensor& table_ids_in,
    int64_t dim) {
  const IndexTensors ix =
      checked_index(index_keys, digests, scores, slot_offsets, bucket_widths, policies);
  const GatherTables g = check_find_rows(ix, values, keys_in, table_ids_in, dim);
  const c10::cuda::CUDAGuard guard(keys_in.device());
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor table_ids = table_ids_in.contiguous();
  const int64_t n = keys.numel();
  at::Tensor slots = at::empty({n}, keys.options());
  at::Tensor out = at::empty({n, dim}, keys.options().dtype(at::kFloat));
  if (n == 0) return {out, slots};
  const auto dtype = values[0].scalar_type();
  bool vec4 = dtype == at::kFloat && dim % 4 == 0;
  for (int64_t t = 0; t < g.count; ++t) vec4 = vec4 && g.width[t] % 4 == 0 && aligned16(g.base[t]);
  const bool rows4 = vec4 && dim / 4 <= cuda::kLookupWarp;
  const int64_t warps = (n + cuda::kGatherRows - 1) / cuda::kGatherRows;
  const auto blocks = static_cast<unsigned>((warps * cuda::kLookupWarp + cuda::kLookupThreads - 1) /
                                            cuda::kLookupThreads);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const TableView v = make_view(ix, nullptr);
  const auto launch = [&](auto zero, auto vec) {
    cuda::find_rows_kernel<decltype(zero), decltype(vec)::value>
        <<<blocks, cuda::kLookupThreads, 0, stream>>>(
            v, g, keys.const_data_ptr<int64_t>(), table_ids.const_data_ptr<int64_t>(), n, dim,
            rows4, slots.data_ptr<int64_t>(), out.data_ptr<float>());
  };
  cuda::dispatch_row_type(vec4, dtype, launch);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {out, slots};
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) { m.impl("table_find_rows", &table_find_rows_cuda); }

}  // namespace demb
