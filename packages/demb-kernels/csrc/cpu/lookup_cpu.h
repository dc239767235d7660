// The CPU gather of a table module step, also the second half of the CPU table_find_rows.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

namespace demb {

// gather_table_rows on the CPU (lookup_rule.h): checks every slot, table and inverse entry.
at::Tensor gather_table_rows_cpu(at::TensorList values, const at::Tensor& slots,
                                 const at::Tensor& tables,
                                 const std::optional<at::Tensor>& inverse, int64_t dim);

}  // namespace demb
