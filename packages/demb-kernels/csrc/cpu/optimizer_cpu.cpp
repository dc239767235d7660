// CPU kernel of optimizer_update: the rows of every table updated in place, in parallel over
// rows, float32 arithmetic whatever the row dtype; an entry's gradient is its grads row, or the
// grad_source row grad_rows names.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <string_view>
#include <type_traits>
#include <vector>

#include "optimizer_checks.h"

namespace demb {
namespace {

constexpr int64_t kUpdatePrefetchAhead = 8;  // rows optimizer_update asks memory for in advance

// sum(g^2) over a row in the CUDA warp's order (optimizer_rule.h, kRowwiseLanes): lane l sums
// g[l], g[l + 32], ...; then lanes l and l + h are added for h = 16, 8, 4, 2, 1.
float rowwise_sum_sq(const float* g, int64_t dim) {
  float lanes[kRowwiseLanes] = {};
  for (int64_t j = 0; j < dim; ++j) lanes[j % kRowwiseLanes] += g[j] * g[j];
  for (int h = kRowwiseLanes / 2; h > 0; h /= 2) {
    for (int l = 0; l < h; ++l) lanes[l] += lanes[l + h];
  }
  return lanes[0];
}

// update_element over a row's float32 copy: weights w[0, dim), state s (s[j], s[dim + j]).
// Written as plain loops over arrays so that the compiler vectorizes them.
template <OptimizerKind K>
void update_elements(const OptimizerParams& o, float* w, float* s, const float* g, int64_t dim,
                     float bias1, float bias2, float rowwise_rate) {
  float unused0 = 0.0f;
  float unused1 = 0.0f;
  if constexpr (two_state_words(K)) {
    for (int64_t j = 0; j < dim; ++j) {
      update_element<K>(o, w[j], s[j], s[dim + j], g[j], bias1, bias2, rowwise_rate);
    }
  } else if constexpr (element_state(K)) {
    for (int64_t j = 0; j < dim; ++j) {
      update_element<K>(o, w[j], s[j], unused1, g[j], bias1, bias2, rowwise_rate);
    }
  } else {
    for (int64_t j = 0; j < dim; ++j) {
      update_element<K>(o, w[j], unused0, unused1, g[j], bias1, bias2, rowwise_rate);
    }
  }
}

template <OptimizerKind K, typename T>
void update_rows(const OptimizerParams& o, T* values, int64_t width, int64_t rows,
                 const int64_t* slots, const float* grads, const int64_t* grad_rows,
                 const float* source, int64_t n, int64_t dim, int64_t step) {
  const float bias1 = K == OptimizerKind::kAdam ? adam_bias(o.beta1, step) : 1.0f;
  const float bias2 = K == OptimizerKind::kAdam ? adam_bias(o.beta2, step) : 1.0f;
  const int64_t state_width = width - dim;
  const int64_t row_bytes = width * static_cast<int64_t>(sizeof(T));
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    std::vector<float> w(static_cast<size_t>(dim));
    std::vector<float> s(static_cast<size_t>(state_width));
    for (int64_t i = begin; i < end; ++i) {
      // Rows are scattered over big tables: ask for row i + kPrefetchAhead's cache lines now
      // (for writing), so that the update does not wait on memory row after row.
      if (i + kUpdatePrefetchAhead < end && slots[i + kUpdatePrefetchAhead] >= 0) {
        const auto* ahead =
            reinterpret_cast<const char*>(values + slots[i + kUpdatePrefetchAhead] * width);
        for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b, 1);
      }
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      T* row = values + slot * width;
      const int64_t r = grad_rows != nullptr ? grad_rows[i] : -1;
      const float* g = r >= 0 ? source + r * dim : grads + i * dim;
      for (int64_t j = 0; j < dim; ++j) w[j] = static_cast<float>(row[j]);
      for (int64_t k = 0; k < state_width; ++k) s[k] = static_cast<float>(row[dim + k]);
      float rowwise_rate = 0.0f;
      if constexpr (K == OptimizerKind::kRowwiseAdagrad) {
        s[0] += rowwise_sum_sq(g, dim) / static_cast<float>(dim);
        rowwise_rate = o.learning_rate / (std::sqrt(s[0]) + o.eps);
      }
      update_elements<K>(o, w.data(), s.data(), g, dim, bias1, bias2, rowwise_rate);
      for (int64_t j = 0; j < dim; ++j) row[j] = static_cast<T>(w[j]);
      for (int64_t k = 0; k < state_width; ++k) row[dim + k] = static_cast<T>(s[k]);
    }
  });
}

void optimizer_update_cpu(const OptimizerParams& o, const std::vector<int64_t>& widths,
                          at::TensorList values, at::TensorList slots, at::TensorList grads,
                          at::IntArrayRef dims, at::IntArrayRef steps,
                          const std::optional<at::Tensor>& skip, const at::Tensor& grad_rows,
                          const at::Tensor& source) {
  if (skip && skip->item<bool>()) return;  // the caller found the gradients unusable
  const int64_t* rows_of = grad_rows.defined() ? grad_rows.const_data_ptr<int64_t>() : nullptr;
  for (int64_t e = 0; rows_of && e < grad_rows.numel(); ++e) {
    TORCH_CHECK_VALUE(rows_of[e] >= -1 && rows_of[e] < source.size(0), "grad_rows: ",
                      rows_of[e], " is out of range for ", source.size(0),
                      " grad_source rows (-1 reads grads)");
  }
  for (size_t t = 0; t < values.size(); ++t) {  // every slot in range before any row changes
    const at::Tensor s = slots[t].contiguous();
    const int64_t* p = s.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < s.numel(); ++i) {
      TORCH_CHECK_VALUE(p[i] >= -1 && p[i] < values[t].size(0), "slots[", t, "]: ", p[i],
                        " is out of range for ", values[t].size(0), " rows");
    }
  }
  int64_t first = 0;  // table t's first entry in grad_rows
  for (size_t t = 0; t < values.size(); ++t) {
    const at::Tensor& table = values[t];
    const int64_t width = widths[t];
    const at::Tensor s = slots[t].contiguous();
    const at::Tensor g = grads[t].contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(
        at::kHalf, at::kBFloat16, table.scalar_type(), "demb::optimizer_update", [&] {
          with_optimizer(o.kind, [&](auto kind) {
            update_rows<decltype(kind)::value, scalar_t>(
                o, table.data_ptr<scalar_t>(), width, table.size(0), s.const_data_ptr<int64_t>(),
                g.const_data_ptr<float>(), rows_of ? rows_of + first : nullptr,
                source.defined() ? source.const_data_ptr<float>() : nullptr, s.numel(), dims[t],
                steps[t]);
          });
        });
    first += s.numel();
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) {
  m.impl("optimizer_update", &optimizer_update_op<optimizer_update_cpu>);
}

}  // namespace demb
