// Choosing the row type of a gather-like kernel from the values' dtype (host side).
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace demb {
namespace cuda {

// Calls launch(T{}, std::bool_constant<Vec4>{}): float rows moved 16 bytes at a time when
// `vec4`, else float, half or bfloat16 rows element by element.
template <typename Launch>
void dispatch_row_type(bool vec4, at::ScalarType dtype, Launch launch) {
  if (vec4) {
    launch(float{}, std::true_type{});
  } else if (dtype == at::kFloat) {
    launch(float{}, std::false_type{});
  } else if (dtype == at::kHalf) {
    launch(__half{}, std::false_type{});
  } else {
    launch(__nv_bfloat16{}, std::false_type{});
  }
}

}  // namespace cuda
}  // namespace demb
