// CPU kernel of pool_table_rows (pool_checks.h's rule), parallel over bags. Every argument's
// values are checked before any output is written.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "pool_checks.h"

namespace demb {
namespace {

at::Tensor pool_table_rows_cpu(at::TensorList values, const at::Tensor& slots_in,
                               const at::Tensor& offsets_in, const at::Tensor& feature_tables_in,
                               int64_t batch_size, int64_t dim, bool mean,
                               const std::optional<at::Tensor>& weights_in) {
  const PoolShape p = check_pool_args(values, slots_in, offsets_in, feature_tables_in,
                                      batch_size, dim, weights_in);
  const GatherTables& g = p.tables;
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor offsets = offsets_in.contiguous();
  const at::Tensor feature_tables = feature_tables_in.contiguous();
  const at::Tensor weights = weights_in ? weights_in->contiguous() : at::Tensor();
  const int64_t* s = slots.const_data_ptr<int64_t>();
  const int64_t* off = offsets.const_data_ptr<int64_t>();
  const int64_t* ft = feature_tables.const_data_ptr<int64_t>();
  const float* w = weights.defined() && p.n ? weights.const_data_ptr<float>() : nullptr;
  const int64_t bags = p.features * batch_size;
  TORCH_CHECK_VALUE(off[0] == 0 && off[bags] == p.n, "offsets: must start at 0 and end at ",
                    p.n, " (the slots), got ", off[0], " and ", off[bags]);
  for (int64_t q = 0; q < bags; ++q) {
    TORCH_CHECK_VALUE(off[q] <= off[q + 1], "offsets: decrease at ", q, " (", off[q], " > ",
                      off[q + 1], ")");
  }
  for (int64_t f = 0; f < p.features; ++f) {
    TORCH_CHECK_VALUE(ft[f] >= 0 && ft[f] < g.count, "feature_tables: ", ft[f],
                      " is out of range for ", g.count, " tables");
    for (int64_t i = off[f * batch_size]; i < off[(f + 1) * batch_size]; ++i) {
      TORCH_CHECK_VALUE(s[i] >= -1 && s[i] < g.rows[ft[f]], "slots: ", s[i],
                        " is out of range for table ", ft[f], " of ", g.rows[ft[f]], " rows");
    }
  }
  at::Tensor out = at::zeros({batch_size, p.features * dim}, slots.options().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  at::parallel_for(0, bags, 256, [&](int64_t begin, int64_t end) {
    for (int64_t q = begin; q < end; ++q) {
      const int64_t f = q / batch_size;
      const int64_t b = q % batch_size;
      const auto* base = static_cast<const float*>(g.base[ft[f]]);
      const int64_t width = g.width[ft[f]];
      float* __restrict__ acc = o + b * p.features * dim + f * dim;  // zeros
      for (int64_t i = off[q]; i < off[q + 1]; ++i) {
        if (s[i] < 0) continue;
        const float* __restrict__ row = base + s[i] * width;
        if (w != nullptr) {  // the product, then the sum (no contraction: -ffp-contract=off)
          for (int64_t c = 0; c < dim; ++c) acc[c] = acc[c] + row[c] * w[i];
        } else {
          for (int64_t c = 0; c < dim; ++c) acc[c] = acc[c] + row[c];
        }
      }
      const int64_t len = off[q + 1] - off[q];
      if (mean && len > 0) {
        for (int64_t c = 0; c < dim; ++c) acc[c] = acc[c] / static_cast<float>(len);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) { m.impl("pool_table_rows", &pool_table_rows_cpu); }

}  // namespace demb
