// Argument checks of the value-row ops (gather_rows / scatter_rows), shared by the CPU and CUDA
// bindings, and the copy unit both use: the widest of 16/8/4/2/1 bytes dividing a row.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace demb {

inline void check_rows_args(const at::Tensor& values, const at::Tensor& slots) {
  TORCH_CHECK_VALUE(values.dim() == 2, "values must be 2-D (rows, width), got ", values.sizes());
  TORCH_CHECK_VALUE(values.is_contiguous(), "values must be contiguous");
  TORCH_CHECK_TYPE(slots.scalar_type() == at::kLong, "slots must be int64, got ",
                   slots.scalar_type());
  TORCH_CHECK_VALUE(slots.dim() == 1, "slots must be 1-D, got ", slots.sizes());
  TORCH_CHECK_VALUE(slots.device() == values.device(), "slots is on ", slots.device(),
                    ", values on ", values.device());
}

inline void check_scatter_rows(const at::Tensor& values, const at::Tensor& slots,
                               const at::Tensor& rows) {
  check_rows_args(values, slots);
  TORCH_CHECK_TYPE(rows.scalar_type() == values.scalar_type(), "rows must be ",
                   values.scalar_type(), " like values, got ", rows.scalar_type());
  TORCH_CHECK_VALUE(rows.dim() == 2 && rows.size(0) == slots.numel() &&
                        rows.size(1) == values.size(1),
                    "rows must be (", slots.numel(), ", ", values.size(1), "), got ",
                    rows.sizes());
  TORCH_CHECK_VALUE(rows.device() == values.device(), "rows is on ", rows.device(),
                    ", values on ", values.device());
}

// Bytes per copy unit for rows of `row_bytes` starting at `base` (contiguous rows).
inline int64_t copy_unit(int64_t row_bytes, const void* base, const void* other) {
  const auto addr = reinterpret_cast<uintptr_t>(base) | reinterpret_cast<uintptr_t>(other);
  for (int64_t unit = 16; unit > 1; unit /= 2) {
    if (row_bytes % unit == 0 && addr % static_cast<uintptr_t>(unit) == 0) return unit;
  }
  return 1;
}

}  // namespace demb
