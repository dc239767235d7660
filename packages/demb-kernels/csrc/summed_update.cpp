// summed_update: a table module's rows wired to its fused update, as one autograd node written in
// C++. The forward is the identity on `out` (`out` itself comes back, as from the Python node it
// replaces: not a view, so in-place ops on it stay allowed); its backward sums each
// unique key's gradient rows in the dedup's order (segment_sum_rows), checks them for NaN/inf
// when asked, and updates the tables in place (optimizer_update). A key of one unscaled entry
// is only checked: the update reads its gradient row where it is (segment_single_rows; on the
// direct CUDA path written by the sums' finish pass). Unchecked on CUDA (float32 rows of at most
// 128 floats), the update sums each key of at most kSegmentChunk entries itself and only the
// longer keys are summed before it (summing_update.h).
// Autograd runs a CUDA backward on its device thread: here that thread runs no Python and takes
// no GIL, so the update's first launch follows the node's start by a few calls, and what the
// sums need that does not need the gradients (the zeroed NaN/inf flag) is made in the forward.
// The slots are split per table in the backward, behind the sums' launches (whose GPU work
// hides it), not in the forward, whose host work after its read-back can outlast its last
// kernel. The flag comes back to the host in the thread's pinned scratch (PinnedScratch): no
// allocation, address query or event per step. On the CPU the sums go into a tensor the module
// keeps (sum_segments_into).
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <exception>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/lookup_cpu.h"
#include "lookup_checks.h"
#include "lookup_rule.h"
#ifdef DEMB_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "cuda/host_copy.h"
#include "cuda/segment_sums.h"
#include "cuda/summing_update.h"
#endif

namespace demb {
namespace {

constexpr size_t kHyperParameters = 9;  // optimizer_update's floats, in its order

// What the backward needs: the forward's dedup, slots and tables, and the update's settings.
struct SummedUpdateState : torch::CustomClassHolder {
  at::Tensor out;                    // the forward's output, until the forward returns it
  at::Tensor order;                  // (N,) int64 positions sorted by (table, key)
  at::Tensor starts;                 // (U,) int64 each key's first entry in order
  std::optional<at::Tensor> plan;    // segment_plan(starts, N), made ahead (CUDA, D > 128)
  std::optional<at::Tensor> rows;    // (N,) int64 the gradient row of each entry (pooled)
  std::optional<at::Tensor> scale;   // (N,) float32 each entry's factor (pooled)
  std::vector<int64_t> table_sizes;  // T: unique keys per table, in order
  at::Tensor slots;                  // (U,) int64 slot of each unique key (-1: none)
  std::vector<at::Tensor> values;    // T value buffers (updated in place)
  std::vector<int64_t> dims;         // T embedding widths
  at::Tensor steps;                  // (T,) int64 CPU updates so far, advanced on success
  std::string optimizer;
  std::vector<double> hyper;         // optimizer_update's nine floats
  std::optional<double> clip;        // clamp each entry's gradient to [-clip, clip] first
  bool check = true;                 // reject NaN/inf sums: no row changes, ValueError
  int64_t dim = 0;                   // the gradient rows' width
  // CPU: the tensor the sums go into, kept by the module across steps (sum_segments_into).
  std::optional<at::Tensor> workspace;
  // CUDA, unscaled: the sums' NaN/inf flag, zeroed in the forward, for a backward that
  // launches the sums straight away (segment_sums_launch); used once (undefined after). Made in
  // the forward: autograd runs a CUDA backward on its device thread, whose
  // core is often cold, and each call there before the update's launch can leave the GPU idle.
  at::Tensor nonfinite;
};

using OptionalTensor = std::optional<at::Tensor>;
using SumOp = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, const OptionalTensor&,
                                                 const OptionalTensor&, const OptionalTensor&,
                                                 bool);
using SingleOp = at::Tensor(const at::Tensor&, const at::Tensor&);
using UpdateOp = void(at::TensorList, at::TensorList, at::TensorList, at::IntArrayRef,
                      at::IntArrayRef, c10::string_view, double, double, double, double, double,
                      double, double, double, double, const OptionalTensor&,
                      const OptionalTensor&, const OptionalTensor&);

// The gradient rows the sums skipped: (U,) each one-entry key's row of `grads`, -1 elsewhere.
struct Direct {
  OptionalTensor rows;
  OptionalTensor grads;
};

void update(const SummedUpdateState& s, const std::vector<at::Tensor>& table_slots,
            const std::vector<at::Tensor>& sums, const std::vector<int64_t>& steps,
            const OptionalTensor& skip, const Direct& direct) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("demb::optimizer_update", "")
                             .typed<UpdateOp>();
  const std::vector<double>& h = s.hyper;
  op.call(s.values, table_slots, sums, s.dims, steps, s.optimizer, h[0], h[1], h[2], h[3], h[4],
          h[5], h[6], h[7], h[8], skip, direct.rows, direct.grads);
}

// (U,) each one-entry key's row of the gradients, -1 elsewhere (segment_single_rows), off the
// direct path (on it the sums' finish pass writes them).
at::Tensor single_rows(const SummedUpdateState& s) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("demb::segment_single_rows", "")
                             .typed<SingleOp>();
  return op.call(s.order, s.starts);
}

// Whether the backward launches the sums itself (segment_sums_launch): a CUDA build, the flag
// zeroed in the forward (state.nonfinite: CUDA, unscaled, no plan or one of the right size) and
// gradient rows as segment_sum_rows checks them.
bool direct_sums(const SummedUpdateState& s, const at::Tensor& grads, const at::Tensor& flag) {
#ifdef DEMB_WITH_CUDA
  return flag.defined() && grads.scalar_type() == at::kFloat && grads.dim() == 2 &&
         grads.device() == flag.device() && grads.size(0) == s.order.numel() &&
         grads.is_contiguous();
#else
  return false;
#endif
}

// The forward's half of direct_sums: the sums' flag, zeroed (`given`, else a new one), when the
// backward may launch the sums itself (CUDA, unscaled, starts and order contiguous on one
// device, and no plan or one that segment_sum_rows would take), else undefined.
at::Tensor direct_flag(const SummedUpdateState& s, const std::optional<at::Tensor>& given) {
  if (!s.order.is_cuda() || s.rows || s.scale) return at::Tensor();
  const bool fits = s.order.is_contiguous() && s.starts.is_contiguous() &&
                    s.starts.device() == s.order.device() &&
                    (!s.plan || (s.plan->is_contiguous() &&
                                 plan_matches(*s.plan, s.starts.numel(), s.order.numel(),
                                              s.order.device())));
#ifdef DEMB_WITH_CUDA
  if (!fits) return at::Tensor();
  return given ? *given : zeroed_flag(s.order);
#else
  (void)fits;  // a CPU build has no CUDA tensors
  (void)given;
  return at::Tensor();
#endif
}

// Whether an unchecked direct backward sums its short keys in the update (summing_update.h):
// float32 tables of the gradients' width that the fused kernel takes.
bool fused_summing(const SummedUpdateState& s, const at::Tensor& grads, bool direct_path) {
#ifdef DEMB_WITH_CUDA
  return direct_path && !s.check && summing_update_fits(s.values, s.dims, grads);
#else
  (void)s;
  (void)grads;
  (void)direct_path;
  return false;
#endif
}

// Waits for the work queued on a device's current stream when an exception leaves its scope:
// the sums may still store a NaN/inf into the thread's pinned scratch, or a copy may still
// write it, and the next use of the scratch (which zeroes the byte first) must not see a late
// store. Armed where the first such store or copy is queued. On a normal exit the backward has
// waited for its own event already.
class DrainOnThrow {
 public:
  DrainOnThrow() = default;
  DrainOnThrow(const DrainOnThrow&) = delete;
  DrainOnThrow& operator=(const DrainOnThrow&) = delete;
  ~DrainOnThrow() {
    if (!device_ || std::uncaught_exceptions() <= exceptions_) return;
    try {
      const c10::impl::VirtualGuardImpl impl(device_->type());
      impl.getStream(*device_).synchronize();
    } catch (...) {  // a failing device: nothing more to wait for
    }
  }
  void arm(c10::Device device) {
    device_ = device;
    exceptions_ = std::uncaught_exceptions();
  }

 private:
  std::optional<c10::Device> device_;
  int exceptions_ = 0;
};

void check_finite(bool bad) {
  TORCH_CHECK_VALUE(!bad,
                    "grads: the embedding gradients contain NaN or infinite values; no row was "
                    "updated");
}

struct SummedUpdate : torch::autograd::Function<SummedUpdate> {
  // `out` rides in `state`, not as an input: an input comes back as a view of itself.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& trigger,
                            c10::intrusive_ptr<SummedUpdateState> state) {
    at::Tensor out = std::move(state->out);
    ctx->saved_data["state"] = c10::IValue::make_capsule(std::move(state));
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto s = c10::static_intrusive_pointer_cast<SummedUpdateState>(
        ctx->saved_data["state"].toCapsule());
    static const auto sum_op = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("demb::segment_sum_rows", "")
                                   .typed<SumOp>();
    at::Tensor grads = grad_out[0];
    if (grads.dim() != 2 || grads.size(1) != s->dim) grads = grads.reshape({-1, s->dim});
    if (s->clip) grads = grads.clamp(-*s->clip, *s->clip);
    // Unscaled sums skip the keys of one entry (most keys of a power-law batch): the update
    // reads their gradient rows in place, so their sums are neither written nor read back.
    const bool skip_single = !s->rows && !s->scale;
    if (skip_single) grads = grads.contiguous();
    at::Tensor summed;
    at::Tensor single;  // the direct path's single rows, from its sums
    bool flagged_on_host = false;  // the sums store a NaN/inf into the host flag themselves
    at::Tensor bad = std::exchange(s->nonfinite, at::Tensor());
    const bool direct_path = direct_sums(*s, grads, bad);
    const bool summing = fused_summing(*s, grads, direct_path);  // implies skip_single
#ifdef DEMB_WITH_CUDA
    // Checked on CUDA: the pinned byte the flag comes back in (zeroed here), held until the
    // backward returns; declared before `drain`, whose wait on a throw comes first.
    std::optional<PinnedScratch> host_flag;
#endif
    DrainOnThrow drain;
    if (direct_path) {  // the first launch a few calls after the node's start
#ifdef DEMB_WITH_CUDA
      bool* host_bad = nullptr;
      if (s->check) {
        host_flag.emplace(grads.device().index(), sizeof(bool));
        *static_cast<bool*>(host_flag->host()) = false;
        host_bad = static_cast<bool*>(host_flag->device());  // null: not mapped, copied below
        if (host_bad != nullptr) drain.arm(grads.device());
      }
      DirectSums sums = segment_sums_launch(grads, s->order, s->starts, s->plan, skip_single,
                                            summing, bad.data_ptr<bool>(), host_bad);
      summed = std::move(sums.sums);
      single = std::move(sums.single);
      flagged_on_host = host_bad != nullptr;
#endif
    } else if (s->workspace && grads.device().is_cpu()) {  // no fresh pages for the sums
      summed = *s->workspace;
      const bool nonfinite = sum_segments_into(summed, grads, s->order, s->starts, s->plan,
                                               s->rows, s->scale, skip_single, false);
      bad = at::scalar_tensor(nonfinite, at::kBool);
    } else {
      std::tie(summed, bad) =
          sum_op.call(grads, s->order, s->starts, s->plan, s->rows, s->scale, skip_single);
    }
    Direct direct;
    if (skip_single && !summing) direct = {single.defined() ? single : single_rows(*s), grads};
    const std::vector<at::Tensor> sums = summed.split_with_sizes(s->table_sizes);
    const std::vector<at::Tensor> table_slots = s->slots.split_with_sizes(s->table_sizes);
    std::vector<int64_t> steps(s->steps.const_data_ptr<int64_t>(),
                               s->steps.const_data_ptr<int64_t>() + s->steps.numel());
    for (int64_t& step : steps) ++step;
    if (summing) {
#ifdef DEMB_WITH_CUDA
      summing_update_launch(s->values, table_slots, sums, s->dims, steps, s->optimizer,
                            s->hyper, grads, s->order, s->starts);
#endif
    } else if (!s->check) {
      update(*s, table_slots, sums, steps, std::nullopt, direct);
    } else if (!bad.is_cuda()) {  // CPU kernels run in order: the flag first
      check_finite(bad.item<bool>());
      update(*s, table_slots, sums, steps, std::nullopt, direct);
    } else {
#ifdef DEMB_WITH_CUDA
      // The flag goes to the host behind the sums (stored there by the sums themselves, or
      // copied) and the update is queued behind it, skipped on the device when set; the host
      // waits for the sums and the flag only.
      if (!host_flag) {
        host_flag.emplace(bad.device().index(), sizeof(bool));
        *static_cast<bool*>(host_flag->host()) = false;
      }
      drain.arm(bad.device());
      const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(bad.device().index()).stream();
      if (!flagged_on_host) host_flag->copy_from(bad.const_data_ptr(), sizeof(bool), stream);
      host_flag->record(stream);
      update(*s, table_slots, sums, steps, bad, direct);
      host_flag->wait();
      check_finite(*static_cast<const bool*>(host_flag->host()));
#else
      TORCH_CHECK(false, "summed_update: a CUDA flag in a build without CUDA");
#endif
    }
    std::copy(steps.begin(), steps.end(), s->steps.data_ptr<int64_t>());
    return {at::Tensor(), at::Tensor()};
  }
};

void check_args(const at::Tensor& out, const at::Tensor& order, const at::Tensor& starts,
                const at::Tensor& slots, at::IntArrayRef table_sizes, at::TensorList values,
                at::IntArrayRef dims, const at::Tensor& steps, at::ArrayRef<double> hyper,
                int64_t dim, const std::optional<at::Tensor>& workspace,
                const std::optional<at::Tensor>& nonfinite) {
  const auto index = [](const at::Tensor& t, const char* name) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, name, ": expected int64, got ",
                     t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 1, name, ": expected 1-D, got shape ", t.sizes());
  };
  index(order, "order");
  index(starts, "starts");
  index(slots, "slots");
  TORCH_CHECK_VALUE(slots.numel() == starts.numel(), "slots: ", slots.numel(),
                    " entries for ", starts.numel(), " unique keys (starts)");
  TORCH_CHECK_VALUE(dim > 0 && out.dim() == 2 && out.size(1) % dim == 0, "dim: ", dim,
                    " does not divide the rows of out, shape ", out.sizes());
  const size_t t = values.size();
  TORCH_CHECK_VALUE(t > 0 && table_sizes.size() == t && dims.size() == t, "values: ", t,
                    " tables, table_sizes ", table_sizes.size(), ", dims ", dims.size(),
                    ": expected one of each per table");
  int64_t total = 0;
  for (const int64_t n : table_sizes) {
    TORCH_CHECK_VALUE(n >= 0, "table_sizes: negative size ", n);
    total += n;
  }
  TORCH_CHECK_VALUE(total == slots.numel(), "table_sizes: sum ", total, " for ",
                    slots.numel(), " slots");
  TORCH_CHECK_VALUE(steps.device().is_cpu() && steps.scalar_type() == at::kLong &&
                        steps.dim() == 1 && steps.numel() == static_cast<int64_t>(t) &&
                        steps.is_contiguous(),
                    "steps: expected a contiguous (", t, ",) int64 CPU tensor, got ",
                    steps.scalar_type(), " ", steps.sizes(), " on ", steps.device());
  TORCH_CHECK_VALUE(hyper.size() == kHyperParameters, "hyper_parameters: expected ",
                    kHyperParameters, " floats (optimizer_update's), got ", hyper.size());
  TORCH_CHECK_VALUE(!workspace || (workspace->device().is_cpu() &&
                                   workspace->scalar_type() == at::kFloat &&
                                   !workspace->requires_grad()),
                    "workspace: expected a float32 CPU tensor that does not require grad, got ",
                    workspace->scalar_type(), " on ", workspace->device());
  TORCH_CHECK_VALUE(!nonfinite || (nonfinite->scalar_type() == at::kBool &&
                                   nonfinite->numel() == 1 &&
                                   nonfinite->device() == order.device()),
                    "nonfinite: expected a zeroed one-element bool tensor on order's device (",
                    order.device(), "), got ", nonfinite->scalar_type(), " ", nonfinite->sizes(),
                    " on ", nonfinite->device());
}

at::Tensor summed_update_autograd(const at::Tensor& trigger, const at::Tensor& out,
                                  const at::Tensor& order, const at::Tensor& starts,
                                  const std::optional<at::Tensor>& plan,
                                  const std::optional<at::Tensor>& rows,
                                  const std::optional<at::Tensor>& scale, const at::Tensor& slots,
                                  at::IntArrayRef table_sizes, at::TensorList values,
                                  at::IntArrayRef dims, const at::Tensor& steps,
                                  c10::string_view optimizer, at::ArrayRef<double> hyper,
                                  std::optional<double> clip, bool check, int64_t dim,
                                  const std::optional<at::Tensor>& workspace,
                                  const std::optional<at::Tensor>& nonfinite) {
  check_args(out, order, starts, slots, table_sizes, values, dims, steps, hyper, dim, workspace,
             nonfinite);
  auto state = c10::make_intrusive<SummedUpdateState>();
  state->out = out;
  state->order = order;
  state->starts = starts;
  state->plan = plan;
  state->rows = rows;
  state->scale = scale;
  state->table_sizes = table_sizes.vec();
  state->values = values.vec();
  state->dims = dims.vec();
  state->steps = steps;
  state->optimizer = std::string(optimizer);
  state->hyper = hyper.vec();
  state->clip = clip;
  state->check = check;
  state->dim = dim;
  state->workspace = workspace;
  state->nonfinite = direct_flag(*state, nonfinite);
  state->slots = slots;
  return SummedUpdate::apply(trigger, std::move(state));
}

}  // namespace

TORCH_LIBRARY_IMPL(demb, Autograd, m) { m.impl("summed_update", &summed_update_autograd); }

}  // namespace demb
