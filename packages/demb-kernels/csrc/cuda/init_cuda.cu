// CUDA bindings of init_rows and init_new_rows: the checks of init_checks.h, then launches on the
// current stream.
// The double arithmetic is the CPU kernel's (init_rule.h); nvcc builds with --fmad=false
// (setup.py), so no multiply-add is contracted differently from the CPU build.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "cuda/init_kernels.cuh"
#include "init_checks.h"

namespace demb {
namespace {

// Blocks of a launch: enough for one thread per element, at most this many (grid-stride).
constexpr int64_t kInitMaxBlocks = int64_t{1} << 20;

void init_rows_cuda(at::Tensor values, const at::Tensor& slots_in, const at::Tensor& keys_in,
                    int64_t dim, int64_t seed, c10::string_view mode, double mean,
                    double std_dev, double lower, double upper, double value,
                    const std::optional<at::Tensor>& state_in) {
  check_init_rows(values, slots_in, keys_in, dim, state_in);
  const InitParams o = make_init_params(mode, seed, mean, std_dev, lower, upper, value);
  const int64_t n = slots_in.numel();
  const int64_t width = values.size(1);
  const int64_t cols = state_in.has_value() ? width : dim;
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(values.device());
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor keys = keys_in.contiguous();
  std::optional<at::Tensor> state;
  if (state_in.has_value()) state = state_in->contiguous();
  const float* st = state.has_value() ? state->const_data_ptr<float>() : nullptr;
  const int64_t blocks =
      std::min<int64_t>((n * cols + cuda::kInitThreads - 1) / cuda::kInitThreads, kInitMaxBlocks);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const auto launch = [&](auto zero) {
    using T = decltype(zero);
    cuda::init_rows_kernel<T><<<static_cast<unsigned>(blocks), cuda::kInitThreads, 0, stream>>>(
        o, static_cast<T*>(values.data_ptr()), values.size(0), width,
        slots.const_data_ptr<int64_t>(), keys.const_data_ptr<int64_t>(), n, dim, cols, st);
  };
  if (values.scalar_type() == at::kFloat) {
    launch(float{});
  } else if (values.scalar_type() == at::kHalf) {
    launch(__half{});
  } else {
    launch(__nv_bfloat16{});
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

static_assert(sizeof(cuda::NewRowsTables) + 64 <= 4096, "init_new_rows' tables fit a launch");

int32_t dtype_code(at::ScalarType dtype) {
  return dtype == at::kFloat ? 0 : (dtype == at::kHalf ? 1 : 2);
}

// One launch per kMaxNewRowsTables tables (a module has one, mostly); entries of other tables
// are skipped by the launch.
void init_new_rows_cuda(at::TensorList values, const std::vector<NewRowsTable>& spec,
                        const at::Tensor& slots_in, const at::Tensor& keys_in,
                        const at::Tensor& tables_in, const at::Tensor& status_in) {
  const int64_t n = slots_in.numel();
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(values[0].device());
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor tables = tables_in.contiguous();
  const at::Tensor status = status_in.contiguous();
  const auto count = static_cast<int64_t>(values.size());
  const int64_t blocks = std::min<int64_t>((n + cuda::kInitThreads - 1) / cuda::kInitThreads,
                                          1 << 16);  // a warp per 32 entries
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for (int64_t first = 0; first < count; first += cuda::kMaxNewRowsTables) {
    cuda::NewRowsTables g{};
    g.first = first;
    g.count = std::min<int64_t>(cuda::kMaxNewRowsTables, count - first);
    for (int64_t k = 0; k < g.count; ++k) {
      const NewRowsTable& table = spec[first + k];
      const at::Tensor& buf = values[first + k];
      g.o[k] = table.o;
      g.base[k] = buf.data_ptr();
      g.state[k] = table.state ? table.state->const_data_ptr<float>() : nullptr;
      g.rows[k] = buf.size(0);
      g.width[k] = static_cast<int32_t>(buf.size(1));
      g.dim[k] = static_cast<int32_t>(table.dim);
      g.cols[k] = static_cast<int32_t>(table.cols);
      g.dtype[k] = dtype_code(buf.scalar_type());
    }
    cuda::init_new_rows_kernel<<<static_cast<unsigned>(blocks), cuda::kInitThreads, 0, stream>>>(
        g, slots.const_data_ptr<int64_t>(), keys.const_data_ptr<int64_t>(),
        tables.const_data_ptr<int64_t>(), status.const_data_ptr<int64_t>(), n);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CUDA, m) {
  m.impl("init_rows", &init_rows_cuda);
  m.impl("init_new_rows", &init_new_rows_op<init_new_rows_cuda>);
}

}  // namespace demb
