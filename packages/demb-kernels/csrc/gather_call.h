// gather_table_rows called through the dispatcher (its CPU or CUDA kernel, by the tensors'
// device), for ops that gather as one of their steps.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace demb {

inline at::Tensor call_gather_table_rows(at::TensorList values, const at::Tensor& slots,
                                         const at::Tensor& tables,
                                         const std::optional<at::Tensor>& inverse, int64_t dim) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("demb::gather_table_rows", "")
          .typed<at::Tensor(at::TensorList, const at::Tensor&, const at::Tensor&,
                            const std::optional<at::Tensor>&, int64_t)>();
  return op.call(values, slots, tables, inverse, dim);
}

}  // namespace demb
