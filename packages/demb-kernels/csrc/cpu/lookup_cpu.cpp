// CPU kernels of gather_table_rows, segment_plan, segment_sum_rows and segment_single_rows
// (lookup_rule.h), parallel over rows.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu/lookup_cpu.h"
#include "lookup_checks.h"

namespace demb {
namespace {

constexpr int64_t kPrefetchAhead = 8;  // rows gather_table_rows asks memory for in advance
constexpr int64_t kSumPrefetchAhead = 8;  // entries sum_segments_into asks memory for ahead

// Whether every float of x[0, d) is finite: each one's exponent bits are not all ones. (A loop
// the compiler vectorizes, unlike a std::isfinite test and branch per value.)
bool all_finite(const float* x, int64_t d) {
  uint32_t bad = 0;
  for (int64_t j = 0; j < d; ++j) {
    uint32_t b = 0;
    std::memcpy(&b, x + j, sizeof(b));
    bad |= static_cast<uint32_t>((b & 0x7f800000u) == 0x7f800000u);
  }
  return bad == 0;
}

}  // namespace

at::Tensor gather_table_rows_cpu(at::TensorList values, const at::Tensor& slots_in,
                                 const at::Tensor& tables_in,
                                 const std::optional<at::Tensor>& inverse_in, int64_t dim) {
  const GatherTables g = check_gather_tables(values, slots_in, tables_in, inverse_in, dim);
  const at::Tensor slots = slots_in.contiguous();
  const at::Tensor tables = tables_in.contiguous();
  const at::Tensor inverse = inverse_in ? inverse_in->contiguous() : at::Tensor();
  const int64_t* s = slots.const_data_ptr<int64_t>();
  const int64_t* t = tables.const_data_ptr<int64_t>();
  const int64_t unique = slots.numel();
  const int64_t n = inverse.defined() ? inverse.numel() : unique;
  // An empty tensor's data pointer may be null: a null `inv` means "no inverse" only when
  // there is none.
  const int64_t* inv = inverse.defined() && n ? inverse.const_data_ptr<int64_t>() : nullptr;
  for (int64_t u = 0; u < unique; ++u) {
    TORCH_CHECK_VALUE(t[u] >= 0 && t[u] < g.count, "tables: ", t[u], " is out of range for ",
                      g.count, " tables");
    TORCH_CHECK_VALUE(s[u] >= -1 && s[u] < g.rows[t[u]], "slots: ", s[u],
                      " is out of range for table ", t[u], " of ", g.rows[t[u]], " rows");
  }
  for (int64_t i = 0; inv && i < n; ++i) {
    TORCH_CHECK_VALUE(inv[i] >= 0 && inv[i] < unique, "inverse: ", inv[i],
                      " is out of range for ", unique, " unique keys");
  }
  at::Tensor out = at::empty({n, dim}, slots.options().dtype(at::kFloat));
  if (n == 0) return out;
  float* o = out.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, values[0].scalar_type(), "demb::gather_table_rows", [&] {
        const auto source = [&](int64_t i) -> const scalar_t* {
          const int64_t u = inv ? inv[i] : i;
          if (s[u] < 0) return nullptr;
          return static_cast<const scalar_t*>(g.base[t[u]]) + s[u] * g.width[t[u]];
        };
        const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(scalar_t));
        at::parallel_for(0, n, 1024, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            // Rows are scattered over big tables: ask for row i + kPrefetchAhead's cache lines
            // now, so that the copy does not wait on memory row after row.
            if (i + kPrefetchAhead < end) {
              const auto* ahead = reinterpret_cast<const char*>(source(i + kPrefetchAhead));
              for (int64_t b = 0; ahead && b < row_bytes; b += 64) __builtin_prefetch(ahead + b);
            }
            const int64_t u = inv ? inv[i] : i;
            float* row = o + i * dim;
            if (s[u] < 0) {
              for (int64_t j = 0; j < dim; ++j) row[j] = 0.0f;
              continue;
            }
            const auto* src = static_cast<const scalar_t*>(g.base[t[u]]) + s[u] * g.width[t[u]];
            for (int64_t j = 0; j < dim; ++j) row[j] = static_cast<float>(src[j]);
          }
        });
      });
  return out;
}

namespace {

void check_starts(const int64_t* st, int64_t unique, int64_t n) {
  for (int64_t u = 0; u < unique; ++u) {
    const int64_t prev = u == 0 ? 0 : st[u - 1];
    TORCH_CHECK_VALUE(st[u] >= prev && st[u] <= n && (u > 0 || st[0] == 0),
                      "starts: must begin at 0, never decrease and stay <= ", n, ", got ", st[u],
                      " at ", u);
  }
}

// The plan as the CUDA kernels write it (zeros past the last chunk).
at::Tensor segment_plan_cpu(const at::Tensor& starts_in, int64_t n) {
  check_segment_plan(starts_in, n);
  const at::Tensor starts = starts_in.contiguous();
  const int64_t unique = starts.numel();
  const int64_t* st = starts.const_data_ptr<int64_t>();
  check_starts(st, unique, n);
  const PlanLayout lay{unique, n};
  at::Tensor plan = at::zeros({lay.size()}, starts.options());
  int64_t* p = plan.data_ptr<int64_t>();
  for (int64_t u = 0; u < unique; ++u) {
    const int64_t end = u + 1 < unique ? st[u + 1] : n;
    const int64_t first = p[u];
    const int64_t chunks = segment_chunks(end - st[u]);
    p[u + 1] = first + chunks;
    for (int64_t c = first; c < first + chunks; ++c) {
      const int64_t begin = st[u] + (c - first) * kSegmentChunk;
      p[lay.begin() + c] = begin;
      p[lay.len() + c] = (begin + kSegmentChunk < end ? begin + kSegmentChunk : end) - begin;
      p[lay.dest() + c] = chunks == 1 ? u : ~c;
    }
  }
  return plan;
}

// A given plan must be the one segment_plan makes for these starts (the CUDA kernels trust it).
void check_plan_matches(const at::Tensor& plan_in, const at::Tensor& starts, int64_t n) {
  const at::Tensor plan = plan_in.contiguous();
  const at::Tensor expected = segment_plan_cpu(starts, n);
  const PlanLayout lay{starts.numel(), n};
  const int64_t* p = plan.const_data_ptr<int64_t>();
  const int64_t* e = expected.const_data_ptr<int64_t>();
  const int64_t chunks = e[lay.unique];
  bool same = std::equal(e, e + lay.begin(), p);
  for (const int64_t col : {lay.begin(), lay.len(), lay.dest()}) {
    same = same && std::equal(e + col, e + col + chunks, p + col);
  }
  TORCH_CHECK_VALUE(same, "plan: not segment_plan(starts, ", n, ") of these starts");
}

}  // namespace

// The sums of segment_sum_rows into `out` (resized to (U, d) float32; only its storage is
// reused), after the op's checks; a one-entry segment's row is zeroed with `zero_singles`, else
// left as it was (skip_single: the update reads that entry's row where it is). Returns whether
// any sum, or any skipped one-entry row, is NaN or infinite.
bool sum_segments_into(at::Tensor& out, const at::Tensor& grads_in, const at::Tensor& order_in,
                       const at::Tensor& starts_in, const std::optional<at::Tensor>& plan,
                       const std::optional<at::Tensor>& rows_in,
                       const std::optional<at::Tensor>& scale_in, bool skip_single,
                       bool zero_singles) {
  check_segment_sum(grads_in, order_in, starts_in, plan, rows_in, scale_in, skip_single);
  const at::Tensor grads = grads_in.contiguous();
  const at::Tensor order = order_in.contiguous();
  const at::Tensor starts = starts_in.contiguous();
  const at::Tensor rows_t = rows_in ? rows_in->contiguous() : at::Tensor();
  const at::Tensor scale_t = scale_in ? scale_in->contiguous() : at::Tensor();
  const int64_t n = order.numel();
  const int64_t r = grads.size(0);
  const int64_t d = grads.size(1);
  const int64_t unique = starts.numel();
  const int64_t* ord = order.const_data_ptr<int64_t>();
  const int64_t* st = starts.const_data_ptr<int64_t>();
  const int64_t* row_of = rows_in ? rows_t.const_data_ptr<int64_t>() : nullptr;
  const float* scale = scale_in ? scale_t.const_data_ptr<float>() : nullptr;
  for (int64_t k = 0; k < n; ++k) {
    TORCH_CHECK_VALUE(ord[k] >= 0 && ord[k] < n, "order: ", ord[k], " is out of range for ", n,
                      " entries");
    if (row_of != nullptr) {
      TORCH_CHECK_VALUE(row_of[k] >= 0 && row_of[k] < r, "rows: ", row_of[k],
                        " is out of range for ", r, " grads rows");
    }
  }
  const bool scaled = row_of != nullptr || scale != nullptr;
  check_starts(st, unique, n);
  if (plan) check_plan_matches(*plan, starts, n);  // the chunks below are the plan's
  out.resize_({unique, d});
  const float* g = grads.const_data_ptr<float>();
  float* o = out.data_ptr<float>();
  std::atomic<bool> bad_any{false};  // some sum, or a skipped single entry's row, is NaN/inf
  const int64_t row_bytes = d * static_cast<int64_t>(sizeof(float));
  at::parallel_for(0, unique, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> partial(static_cast<size_t>(d));
    bool bad = false;
    const int64_t last = end < unique ? st[end] : n;  // this block's entries end here
    // The gradient rows are scattered: entry k + kSumPrefetchAhead's row is asked for now.
    const auto prefetch = [&](int64_t k) {
      if (k + kSumPrefetchAhead >= last) return;
      const int64_t p = ord[k + kSumPrefetchAhead];
      const auto* ahead = reinterpret_cast<const char*>(g + (row_of ? row_of[p] : p) * d);
      for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b);
    };
    for (int64_t u = begin; u < end; ++u) {
      const int64_t stop = u + 1 < unique ? st[u + 1] : n;
      float* total = o + u * d;
      if (skip_single && stop - st[u] == 1) {  // checked, not written (zeros if asked)
        prefetch(st[u]);
        bad = bad || !all_finite(g + ord[st[u]] * d, d);
        if (zero_singles) std::fill(total, total + d, 0.0f);
        continue;
      }
      const bool alone = stop - st[u] <= kSegmentChunk;  // one chunk: its sum is the total
      if (!alone || stop == st[u]) std::fill(total, total + d, 0.0f);  // (an empty one: zeros)
      for (int64_t c = st[u]; c < stop; c += kSegmentChunk) {
        float* acc = alone ? total : partial.data();
        for (int64_t j = 0; j < d; ++j) acc[j] = 0.0f;
        const int64_t chunk_end = c + kSegmentChunk < stop ? c + kSegmentChunk : stop;
        for (int64_t k = c; k < chunk_end; ++k) {
          prefetch(k);
          const int64_t p = ord[k];
          const float* row = g + (row_of != nullptr ? row_of[p] : p) * d;
          if (scaled) {  // as the CUDA kernels: the product, then the sum (no contraction)
            const float s = scale != nullptr ? scale[p] : 1.0f;
            for (int64_t j = 0; j < d; ++j) acc[j] += s * row[j];
          } else {
            for (int64_t j = 0; j < d; ++j) acc[j] += row[j];
          }
        }
        if (!alone) {
          for (int64_t j = 0; j < d; ++j) total[j] += partial[j];
        }
      }
      bad = bad || !all_finite(total, d);
    }
    if (bad) bad_any = true;
  });
  return bad_any;
}

namespace {

std::tuple<at::Tensor, at::Tensor> segment_sum_rows_cpu(
    const at::Tensor& grads, const at::Tensor& order, const at::Tensor& starts,
    const std::optional<at::Tensor>& plan, const std::optional<at::Tensor>& rows,
    const std::optional<at::Tensor>& scale, bool skip_single) {
  at::Tensor out = at::empty({0}, grads.options().dtype(at::kFloat));
  const bool nonfinite =
      sum_segments_into(out, grads, order, starts, plan, rows, scale, skip_single, true);
  return {out, at::scalar_tensor(nonfinite, grads.options().dtype(at::kBool))};
}

at::Tensor segment_single_rows_cpu(const at::Tensor& order_in, const at::Tensor& starts_in) {
  check_single_rows(order_in, starts_in);
  const at::Tensor order = order_in.contiguous();
  const at::Tensor starts = starts_in.contiguous();
  const int64_t n = order.numel();
  const int64_t unique = starts.numel();
  const int64_t* ord = order.const_data_ptr<int64_t>();
  const int64_t* st = starts.const_data_ptr<int64_t>();
  check_starts(st, unique, n);
  at::Tensor out = at::empty({unique}, starts.options());
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t u = 0; u < unique; ++u) {
    const int64_t stop = u + 1 < unique ? st[u + 1] : n;
    o[u] = stop - st[u] == 1 ? ord[st[u]] : -1;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) {
  m.impl("gather_table_rows", &gather_table_rows_cpu);
  m.impl("segment_plan", &segment_plan_cpu);
  m.impl("segment_sum_rows", &segment_sum_rows_cpu);
  m.impl("segment_single_rows", &segment_single_rows_cpu);
}

}  // namespace demb
