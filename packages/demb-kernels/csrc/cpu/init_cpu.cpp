// CPU kernel of init_rows: the rows at slots set from their keys (init_rule.h), in parallel over
// rows; double arithmetic, rounded to float, then to the row dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>

#include "init_checks.h"

namespace demb {
namespace {

// float -> row dtype, round to nearest even (c10::Half / c10::BFloat16 round that way).
template <typename T>
T to_row(float x) {
  return static_cast<T>(x);
}

template <typename T>
void init_rows_typed(const InitParams& o, T* values, int64_t width, const int64_t* slots,
                     const int64_t* keys, int64_t n, int64_t dim, const float* state) {
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (slots[i] < 0) continue;
      T* row = values + slots[i] * width;
      const auto key = static_cast<uint64_t>(keys[i]);
      for (int64_t j = 0; j < dim; ++j) {
        row[j] = to_row<T>(static_cast<float>(init_element(o, key, j)));
      }
      if (state != nullptr) {
        for (int64_t k = 0; k < width - dim; ++k) row[dim + k] = to_row<T>(state[k]);
      }
    }
  });
}

void init_rows_cpu(at::Tensor values, const at::Tensor& slots_in, const at::Tensor& keys_in,
                   int64_t dim, int64_t seed, c10::string_view mode, double mean, double std_dev,
                   double lower, double upper, double value,
                   const std::optional<at::Tensor>& state_in) {
  check_init_rows(values, slots_in, keys_in, dim, state_in);
  const InitParams o = make_init_params(mode, seed, mean, std_dev, lower, upper, value);
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor keys = keys_in.contiguous();
  const int64_t n = slots.numel();
  const int64_t rows = values.size(0);
  const int64_t* s = slots.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {  // every slot in range before any row changes
    TORCH_CHECK_VALUE(s[i] >= -1 && s[i] < rows, "slots[", i, "]=", s[i],
                      " is out of range for ", rows, " rows (-1 means none)");
  }
  if (n == 0) return;
  std::optional<at::Tensor> state;
  if (state_in.has_value()) state = state_in->contiguous();
  const float* st = state.has_value() ? state->const_data_ptr<float>() : nullptr;
  const auto run = [&](auto zero) {
    using T = decltype(zero);
    init_rows_typed<T>(o, static_cast<T*>(values.data_ptr()), values.size(1), s,
                       keys.const_data_ptr<int64_t>(), n, dim, st);
  };
  if (values.scalar_type() == at::kFloat) {
    run(float{});
  } else if (values.scalar_type() == at::kHalf) {
    run(c10::Half{});
  } else {
    run(c10::BFloat16{});
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) { m.impl("init_rows", &init_rows_cpu); }

}  // namespace demb
