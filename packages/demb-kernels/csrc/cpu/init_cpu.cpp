// CPU kernels of init_rows and init_new_rows: the rows at slots set from their keys
// (init_rule.h), in parallel over rows; double arithmetic, rounded to float, then to the row
// dtype.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>
#include <vector>

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

template <typename T>
void init_row(const NewRowsTable& table, T* row, uint64_t key, const float* state) {
  for (int64_t j = 0; j < table.dim; ++j) {
    row[j] = to_row<T>(static_cast<float>(init_element(table.o, key, j)));
  }
  for (int64_t j = table.dim; j < table.cols; ++j) row[j] = to_row<T>(state[j - table.dim]);
}

// init_new_rows (init_new_rows_op): entries whose status is INSERTED or EVICTED get their
// table's initial row at their slot. Every such entry's table and slot are checked before any
// row changes.
void init_new_rows_cpu(at::TensorList values, const std::vector<NewRowsTable>& spec,
                       const at::Tensor& slots_in, const at::Tensor& keys_in,
                       const at::Tensor& tables_in, const at::Tensor& status_in) {
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor keys = keys_in.contiguous();
  const at::Tensor tables = tables_in.contiguous();
  const at::Tensor status = status_in.contiguous();
  const int64_t n = slots.numel();
  const int64_t* s = slots.const_data_ptr<int64_t>();
  const int64_t* k = keys.const_data_ptr<int64_t>();
  const int64_t* tb = tables.const_data_ptr<int64_t>();
  const int64_t* st = status.const_data_ptr<int64_t>();
  const auto count = static_cast<int64_t>(values.size());
  for (int64_t i = 0; i < n; ++i) {
    if (!new_row_status(st[i])) continue;
    TORCH_CHECK_VALUE(tb[i] >= 0 && tb[i] < count, "tables[", i, "]=", tb[i],
                      " is out of range for ", count, " tables");
    const int64_t rows = values[tb[i]].size(0);
    TORCH_CHECK_VALUE(s[i] >= -1 && s[i] < rows, "slots[", i, "]=", s[i],
                      " is out of range for ", rows, " rows of table ", tb[i],
                      " (-1 means none)");
  }
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      if (!new_row_status(st[i]) || s[i] < 0) continue;
      const NewRowsTable& table = spec[tb[i]];
      const at::Tensor& buf = values[tb[i]];
      const float* state = table.state ? table.state->const_data_ptr<float>() : nullptr;
      const auto key = static_cast<uint64_t>(k[i]);
      const int64_t at_row = s[i] * buf.size(1);
      if (buf.scalar_type() == at::kFloat) {
        init_row(table, static_cast<float*>(buf.data_ptr()) + at_row, key, state);
      } else if (buf.scalar_type() == at::kHalf) {
        init_row(table, static_cast<c10::Half*>(buf.data_ptr()) + at_row, key, state);
      } else {
        init_row(table, static_cast<c10::BFloat16*>(buf.data_ptr()) + at_row, key, state);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) {
  m.impl("init_rows", &init_rows_cpu);
  m.impl("init_new_rows", &init_new_rows_op<init_new_rows_cpu>);
}

}  // namespace demb
