// CPU kernels of the value-row ops: rows of a value buffer read or written by slot.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "rows_checks.h"

namespace demb {
namespace {

// A scatter of more bytes than a core's cache holds stores around the caches (streaming
// stores): each destination line is then written without being read first, which otherwise
// costs a third of the memory traffic of copying rows into places that are not cached. (A
// gather's output is read next, and comes fresh from the allocator: streaming it measured
// slower.)
constexpr int64_t kStreamBytes = int64_t{1} << 20;

// Copy one row; streamed when `stream` and the destination and size allow 16-byte stores.
inline void copy_row(char* dst, const char* src, int64_t bytes, bool stream) {
#if defined(__SSE2__)
  if (stream && (reinterpret_cast<std::uintptr_t>(dst) & 15) == 0 && (bytes & 15) == 0) {
    auto* d = reinterpret_cast<__m128i*>(dst);
    const auto* s = reinterpret_cast<const __m128i*>(src);
    for (int64_t k = 0; k < bytes / 16; ++k) {
      _mm_stream_si128(d + k, _mm_loadu_si128(s + k));
    }
    return;
  }
#endif
  std::memcpy(dst, src, static_cast<size_t>(bytes));
}

// Order a chunk's streaming stores before whatever follows the parallel region.
inline void store_fence(bool stream) {
#if defined(__SSE2__)
  if (stream) {
    _mm_sfence();
  }
#else
  (void)stream;
#endif
}

// A gather asks for the first line of the row kAhead entries on (rows lie at random places:
// each one's first read misses the TLB and the caches; the lines after it stream).
constexpr int64_t kAhead = 4;

void check_slot_range(const int64_t* slots, int64_t n, int64_t rows) {
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(slots[i] >= -1 && slots[i] < rows, "slots[", i, "]=", slots[i],
                      " is out of range for ", rows, " rows (-1 means none)");
  }
}

// Raw views of one buffer's part of a many-buffer copy (read once, before the parallel loop).
struct RowsPart {
  char* values;
  const int64_t* slots;
  char* rows;  // the batch's rows: the gather's output, the scatter's input
  int64_t row_bytes;
  bool stream;
  int64_t count;  // entries
};

// Runs copy(part, i) for entry i of every part, the entries of all parts split evenly over
// the threads (one parallel region for the whole batch); each thread runs finish() after its
// entries.
template <typename Copy, typename Finish>
void for_each_entry(const std::vector<RowsPart>& parts, const std::vector<int64_t>& starts,
                    const Copy& copy, const Finish& finish) {
  at::parallel_for(0, starts.back(), 1024, [&](int64_t begin, int64_t end) {
    size_t t = std::upper_bound(starts.begin(), starts.end(), begin) - starts.begin() - 1;
    for (int64_t e = begin; e < end; ++e) {
      while (e >= starts[t + 1]) ++t;
      copy(parts[t], e - starts[t]);
    }
    finish();
  });
}

std::vector<at::Tensor> gather_rows_many_cpu(at::TensorList values, at::TensorList slots_in) {
  TORCH_CHECK_VALUE(values.size() == slots_in.size(), "values and slots differ in length");
  std::vector<at::Tensor> slots;
  std::vector<at::Tensor> out;
  std::vector<RowsPart> parts;
  std::vector<int64_t> starts{0};
  for (size_t t = 0; t < values.size(); ++t) {
    check_rows_args(values[t], slots_in[t]);
    slots.push_back(slots_in[t].contiguous());
    const int64_t n = slots[t].numel();
    check_slot_range(slots[t].const_data_ptr<int64_t>(), n, values[t].size(0));
    out.push_back(at::empty({n, values[t].size(1)}, values[t].options()));
    parts.push_back({const_cast<char*>(static_cast<const char*>(values[t].const_data_ptr())),
                     slots[t].const_data_ptr<int64_t>(), static_cast<char*>(out[t].data_ptr()),
                     values[t].size(1) * values[t].element_size(), false, n});
    starts.push_back(starts.back() + n);
  }
  for_each_entry(
      parts, starts,
      [](const RowsPart& p, int64_t i) {
        if (i + kAhead < p.count && p.slots[i + kAhead] >= 0) {
          __builtin_prefetch(p.values + p.slots[i + kAhead] * p.row_bytes);
        }
        char* dst = p.rows + i * p.row_bytes;
        if (p.slots[i] < 0) {
          std::memset(dst, 0, static_cast<size_t>(p.row_bytes));
        } else {
          std::memcpy(dst, p.values + p.slots[i] * p.row_bytes, static_cast<size_t>(p.row_bytes));
        }
      },
      [] {});
  return out;
}

void scatter_rows_many_cpu(at::TensorList values, at::TensorList slots_in,
                           at::TensorList rows_in) {
  TORCH_CHECK_VALUE(values.size() == slots_in.size() && values.size() == rows_in.size(),
                    "values, slots and rows differ in length");
  std::vector<at::Tensor> slots;
  std::vector<at::Tensor> rows;
  std::vector<RowsPart> parts;
  std::vector<int64_t> starts{0};
  for (size_t t = 0; t < values.size(); ++t) {
    check_scatter_rows(values[t], slots_in[t], rows_in[t]);
    slots.push_back(slots_in[t].contiguous());
    rows.push_back(rows_in[t].contiguous());
    const int64_t n = slots[t].numel();
    check_slot_range(slots[t].const_data_ptr<int64_t>(), n, values[t].size(0));
    const int64_t row_bytes = values[t].size(1) * values[t].element_size();
    parts.push_back({static_cast<char*>(values[t].data_ptr()), slots[t].const_data_ptr<int64_t>(),
                     const_cast<char*>(static_cast<const char*>(rows[t].const_data_ptr())),
                     row_bytes, n * row_bytes > kStreamBytes, n});
    starts.push_back(starts.back() + n);
  }
  for_each_entry(
      parts, starts,
      [](const RowsPart& p, int64_t i) {
        if (p.slots[i] >= 0) {
          copy_row(p.values + p.slots[i] * p.row_bytes, p.rows + i * p.row_bytes, p.row_bytes,
                   p.stream);
        }
      },
      [] { store_fence(true); });
}

// The one-buffer ops: the many-buffer ops of one buffer.
at::Tensor gather_rows_cpu(const at::Tensor& values, const at::Tensor& slots) {
  return gather_rows_many_cpu({values}, {slots})[0];
}

void scatter_rows_cpu(at::Tensor values, const at::Tensor& slots, const at::Tensor& rows) {
  scatter_rows_many_cpu({values}, {slots}, {rows});
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, CPU, m) {
  m.impl("gather_rows", &gather_rows_cpu);
  m.impl("scatter_rows", &scatter_rows_cpu);
  m.impl("gather_rows_many", &gather_rows_many_cpu);
  m.impl("scatter_rows_many", &scatter_rows_many_cpu);
}

}  // namespace demb
