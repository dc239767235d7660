// The per-row optimizer updates of demb-optim's specs (demb_optim/specs.py), in float32, shared
// by the CPU and CUDA kernels. Plain C++, no torch headers.
//
// A row is [embedding (dim) | state]; `w` and `s` are float32 copies of them, `g` the row's
// reduced gradient (already clipped per occurrence by the caller).
#pragma once

#include <cmath>
#include <cstdint>

#include "ownership.h"  // DEMB_HD

namespace demb {

// kFtrlSqrt: FTRL with learning_rate_power = -0.5, the rate a square root (make_params picks it).
enum class OptimizerKind : int32_t { kSgd, kAdam, kAdagrad, kRowwiseAdagrad, kFtrl, kFtrlSqrt };

DEMB_HD constexpr bool is_ftrl(OptimizerKind k) {
  return k == OptimizerKind::kFtrl || k == OptimizerKind::kFtrlSqrt;
}

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

// Adam's bias correction 1 - beta^step, computed on the host the same way for every device.
inline float adam_bias(float beta, int64_t step) {
  return static_cast<float>(1.0 - std::pow(static_cast<double>(beta), static_cast<double>(step)));
}

// n^(-p), the FTRL rate; kFtrlSqrt (p = -0.5) takes the square root. The general power goes
// through double so that the CPU's and CUDA's pow (each within an ulp or two of a double)
// round to the same float.
template <OptimizerKind K>
DEMB_HD float ftrl_rate(float n, float p) {
  if constexpr (K == OptimizerKind::kFtrlSqrt) {
    return sqrtf(n);
  } else {
    return static_cast<float>(pow(static_cast<double>(n), -static_cast<double>(p)));
  }
}

// n_new^(-p) - n^(-p) (n_new >= n >= 0): how much the FTRL rate grows, which the update
// divides by the learning rate. Taken as the difference of the two rates it would cancel most
// digits when they are close (after 3 steps at lr 0.01 a weight was 2% off the float64
// reference), so it is taken in double, accurate relative to the difference itself (the CPU's
// and CUDA's libm then round it to the same float): for the square root
// (n_new - n) / (sqrt(n_new) + sqrt(n)); for a general power
// n^(-p) * expm1(-p * log1p((n_new - n) / n)). The two agree when p is -0.5.
template <OptimizerKind K>
DEMB_HD float ftrl_rate_increase(float n_new, float n, float p) {
  const double lo = static_cast<double>(n);
  const double hi = static_cast<double>(n_new);
  if constexpr (K == OptimizerKind::kFtrlSqrt) {
    const double sum = sqrt(hi) + sqrt(lo);
    return sum > 0.0 ? static_cast<float>((hi - lo) / sum) : 0.0f;
  } else {
    const double a = -static_cast<double>(p);
    if (lo == 0.0) return static_cast<float>(pow(hi, a) - pow(lo, a));
    return static_cast<float>(pow(lo, a) * expm1(a * log1p((hi - lo) / lo)));
  }
}

// Lanes of the CUDA warp that sums a row-wise Adagrad gradient; the CPU sums in the same order
// (kRowwiseLanes lane-strided partial sums, then a halving tree) so both give the same float.
constexpr int kRowwiseLanes = 32;

// Updates one element of a row in place: `w` its weight, `g` its gradient, `s0` / `s1` its
// state words (Adam m / v, Adagrad acc / unused, FTRL z / n; SGD and row-wise Adagrad none).
// Adam: `bias1` / `bias2` are 1 - beta^step for the table's step (this update included).
// Row-wise Adagrad: `rowwise_rate` is lr / (sqrt(acc) + eps), from the row's accumulator the
// caller already increased by mean(g^2). The optimizer is a template argument so that each
// kernel's inner loop has no branch on it.
template <OptimizerKind K>
DEMB_HD void update_element(const OptimizerParams& o, float& w, float& s0, float& s1, float g,
                            float bias1, float bias2, float rowwise_rate) {
  const float lr = o.learning_rate;
  if constexpr (K == OptimizerKind::kSgd) {
    w -= lr * g;
  } else if constexpr (K == OptimizerKind::kAdam) {
    s0 = o.beta1 * s0 + (1 - o.beta1) * g;
    s1 = o.beta2 * s1 + (1 - o.beta2) * g * g;
    w -= lr * ((s0 / bias1) / (sqrtf(s1 / bias2) + o.eps) + o.weight_decay * w);
  } else if constexpr (K == OptimizerKind::kAdagrad) {
    s0 += g * g;
    w -= lr * g / (sqrtf(s0) + o.eps);
  } else if constexpr (K == OptimizerKind::kRowwiseAdagrad) {
    w -= rowwise_rate * g;
  } else {
    const float n_new = s1 + g * g;
    const float rate_new = ftrl_rate<K>(n_new, o.learning_rate_power);
    s0 += g - ftrl_rate_increase<K>(n_new, s1, o.learning_rate_power) / lr * w;
    s1 = n_new;
    const float sign = s0 > 0 ? 1.0f : -1.0f;
    const float solved = (sign * o.l1_reg - s0) / ((o.ftrl_beta + rate_new) / lr + o.l2_reg);
    w = fabsf(s0) <= o.l1_reg ? 0.0f : solved;
  }
}

// Whether element j keeps a second state word at s[dim + j] (Adam, FTRL).
DEMB_HD constexpr bool two_state_words(OptimizerKind k) {
  return k == OptimizerKind::kAdam || is_ftrl(k);
}

// Whether element j keeps a state word at s[j] (Adam, Adagrad, FTRL).
DEMB_HD constexpr bool element_state(OptimizerKind k) {
  return k == OptimizerKind::kAdam || k == OptimizerKind::kAdagrad || is_ftrl(k);
}

}  // namespace demb
