// The per-row optimizer updates of demb-optim's specs (demb_optim/specs.py), in float32, shared
// by the CPU kernels and (later) the CUDA kernels. Plain C++, no torch headers.
//
// A row is [embedding (dim) | state]; `w` and `s` are float32 copies of them, `g` the row's
// reduced gradient (already clipped per occurrence by the caller).
#pragma once

#include <cmath>
#include <cstdint>

#include "ownership.h"  // DEMB_HD

namespace demb {

enum class OptimizerKind : int32_t {
  kSgd = 0,
  kAdam = 1,
  kAdagrad = 2,
  kRowwiseAdagrad = 3,
  kFtrl = 4,
};

struct OptimizerParams {
  OptimizerKind kind;
  float learning_rate;
  float eps;
  float beta1;
  float beta2;
  float weight_decay;
  float learning_rate_power;
  float ftrl_beta;
  float l1_reg;
  float l2_reg;
};

// Elements of state after an embedding of `dim` (row-wise Adagrad: `rowwise_slots`, the 16
// reserved bytes in the row's dtype).
DEMB_HD int64_t optimizer_state_dim(OptimizerKind kind, int64_t dim, int64_t rowwise_slots) {
  switch (kind) {
    case OptimizerKind::kSgd: return 0;
    case OptimizerKind::kAdagrad: return dim;
    case OptimizerKind::kRowwiseAdagrad: return rowwise_slots;
    default: return 2 * dim;  // Adam [m | v], FTRL [z | n]
  }
}

// x^(-p) for the FTRL rate; p = -0.5 takes the square root.
DEMB_HD float ftrl_rate(float n, float p) { return p == -0.5f ? sqrtf(n) : powf(n, -p); }

// Updates element j of a row in place: `w` its weight, `s` the row's state, `g` its gradient.
// Adam: `bias1` / `bias2` are 1 - beta^step for the table's step (this update included).
// Row-wise Adagrad: `rowwise_rate` is lr / (sqrt(acc) + eps), from the row's accumulator the
// caller already increased by mean(g^2). The optimizer is a template argument so that each
// kernel's inner loop has no branch on it.
template <OptimizerKind K>
DEMB_HD void update_element(const OptimizerParams& o, float& w, float* s, int64_t dim, int64_t j,
                            float g, float bias1, float bias2, float rowwise_rate) {
  const float lr = o.learning_rate;
  if constexpr (K == OptimizerKind::kSgd) {
    w -= lr * g;
  } else if constexpr (K == OptimizerKind::kAdam) {
    float& m = s[j];
    float& v = s[dim + j];
    m = o.beta1 * m + (1 - o.beta1) * g;
    v = o.beta2 * v + (1 - o.beta2) * g * g;
    w -= lr * ((m / bias1) / (sqrtf(v / bias2) + o.eps) + o.weight_decay * w);
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    float& acc = s[j];
    acc += g * g;
    w -= lr * g / (sqrtf(acc) + o.eps);
  } else if constexpr (K == OptimizerKind::kRowwiseAdagrad) {
    w -= rowwise_rate * g;
  } else {
    float& z = s[j];
    float& n = s[dim + j];
    const float n_new = n + g * g;
    const float rate_new = ftrl_rate(n_new, o.learning_rate_power);
    z += g - (rate_new - ftrl_rate(n, o.learning_rate_power)) / lr * w;
    n = n_new;
    const float sign = z > 0 ? 1.0f : -1.0f;
    const float solved = (sign * o.l1_reg - z) / ((o.ftrl_beta + rate_new) / lr + o.l2_reg);
    w = fabsf(z) <= o.l1_reg ? 0.0f : solved;
  }
}

}  // namespace demb
