// The counter-based row initializer of init_rows, shared by the CPU and CUDA kernels: plain C++
// (no torch headers), callable from host and device code. demb_kernels/init_reference.py is an
// independent Python implementation that the tests compare against.
//
// Element j of the row of `key` under `seed` (both uint64 bit patterns) draws
//   x0..x3 = Philox4x32-10(counter (low32(key), high32(key), j, 0),
//                          key (low32(seed), high32(seed)))
// and is computed in double from u(x) = ((x >> 8) + 0.5) / 2^24, in (0, 1):
//   uniform:          lower + (upper - lower) * u(x0)
//   normal:           mean + std_dev * sqrt(-2 log u(x0)) * cos(2 pi u(x1))
//   truncated_normal: clamp(mean + std_dev * Phi^-1(pa + (pb - pa) * u(x0)), lower, upper),
//                     pa / pb = Phi of the standardized bounds (computed once on the host)
//   constant:         value
//   debug:            key mod 65536 + j / 256
// The kernels round it to float (nearest even), then to the row dtype (nearest even). Only
// IEEE arithmetic and double libm calls (log, cos, sqrt, erf, erfc, exp) are used, with no
// multiply-add contraction (setup.py), so the CPU and the GPU agree on virtually every float.
#pragma once

#include <cmath>
#include <cstdint>

#include "ownership.h"  // DEMB_HD
#include "table_rule.h"  // InsertStatus

namespace demb {

// The init modes, numbered 0 to 4 in this order: init_new_rows' mode codes (demb_kernels.init_rows'
// INIT_MODES order).
enum class InitMode : int32_t { kUniform, kNormal, kTruncatedNormal, kConstant, kDebug };

struct InitParams {
  InitMode mode;
  uint64_t seed;
  double mean;
  double std_dev;
  double lower;
  double upper;
  double value;
  double pa;  // truncated_normal: Phi((lower - mean) / std_dev)
  double pb;  // truncated_normal: Phi((upper - mean) / std_dev)
};

struct Philox4 {
  uint32_t x[4];
};

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

// Philox4x32-10 (Salmon, Moraes, Dror, Shaw: "Parallel random numbers: as easy as 1, 2, 3",
// SC'11) of counter (c0, c1, c2, c3) under key (k0, k1).
DEMB_HD Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                              uint32_t k1) {
  for (int r = 0; r < kPhiloxRounds; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c0;
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c2;
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c1 = static_cast<uint32_t>(p1);
    c3 = static_cast<uint32_t>(p0);
    c0 = n0;
    c2 = n2;
    k0 += kPhiloxW0;
    k1 += kPhiloxW1;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The top 24 bits of x as a double in (0, 1).
DEMB_HD double unit_double(uint32_t x) { return ((x >> 8) + 0.5) / 16777216.0; }

constexpr double kPi = 3.14159265358979323846;
constexpr double kSqrt2 = 1.41421356237309504880;
constexpr double kSqrt2Pi = 2.50662827463100050242;

// The standard normal CDF.
DEMB_HD double normal_cdf(double z) { return 0.5 * erfc(-z / kSqrt2); }

// Acklam's rational approximation of the standard normal quantile (relative error < 1.15e-9),
// around the median (q = p - 0.5, |q| <= 0.5 - kAcklamLow) and in the lower tail (0 < t <
// kAcklamLow). The coefficients are literals so that device code needs no constant arrays.
constexpr double kAcklamLow = 0.02425;

DEMB_HD double acklam_central(double q) {
  const double r = q * q;
  const double num = (((((-3.969683028665376e+01 * r + 2.209460984245205e+02) * r +
                         -2.759285104469687e+02) * r + 1.383577518672690e+02) * r +
                       -3.066479806614716e+01) * r + 2.506628277459239e+00) * q;
  const double den = ((((-5.447609879822406e+01 * r + 1.615858368580409e+02) * r +
                        -1.556989798598866e+02) * r + 6.680131188771972e+01) * r +
                      -1.328068155288572e+01) * r + 1.0;
  return num / den;
}

DEMB_HD double acklam_lower_tail(double t) {
  const double s = sqrt(-2.0 * log(t));
  const double num = ((((-7.784894002430293e-03 * s + -3.223964580411365e-01) * s +
                        -2.400758277161838e+00) * s + -2.549732539343734e+00) * s +
                      4.374664141464968e+00) * s + 2.938163982698783e+00;
  const double den = (((7.784695709041462e-03 * s + 3.224671290700398e-01) * s +
                       2.445134137142996e+00) * s + 3.754408661907416e+00) * s + 1.0;
  return num / den;
}

// One Halley step towards Phi(x) = target, given the residual e = Phi(x) - target.
DEMB_HD double halley_step(double x, double e) {
  const double u = e * kSqrt2Pi * exp(0.5 * x * x);
  return x - u / (1.0 + 0.5 * x * u);
}

// The standard normal quantile Phi^-1(p): Acklam's approximation refined by one Halley step
// (about full double precision). p <= 0 gives -inf, p >= 1 gives +inf. The residual is taken
// where it is accurate relative to the result: around the median as 0.5 erf(x / sqrt 2) -
// (p - 0.5), in the tails (mirrored to the lower one) as 0.5 erfc(-x / sqrt 2) - p.
DEMB_HD double normal_quantile(double p) {
  if (!(p > 0.0)) return -INFINITY;
  if (!(p < 1.0)) return INFINITY;
  if (p >= kAcklamLow && p <= 1.0 - kAcklamLow) {
    const double q = p - 0.5;  // exact (Sterbenz)
    const double x = acklam_central(q);
    return halley_step(x, 0.5 * erf(x / kSqrt2) - q);
  }
  const double t = p < 0.5 ? p : 1.0 - p;  // the lower tail; 1 - p is exact for p > 0.5
  double x = acklam_lower_tail(t);          // < 0
  // Past -37, exp(x^2 / 2) overflows; there t is below 1e-300 and Acklam's value stands.
  if (x > -37.0) x = halley_step(x, normal_cdf(x) - t);
  return p < 0.5 ? x : -x;
}

// Element j of the row of key `key_bits` (the key's uint64 pattern), in double.
DEMB_HD double init_element(const InitParams& o, uint64_t key_bits, int64_t j) {
  if (o.mode == InitMode::kConstant) return o.value;
  if (o.mode == InitMode::kDebug) {
    return static_cast<double>(key_bits % 65536u) + static_cast<double>(j) / 256.0;
  }
  const Philox4 r = philox4x32_10(static_cast<uint32_t>(key_bits),
                                  static_cast<uint32_t>(key_bits >> 32),
                                  static_cast<uint32_t>(j), 0u, static_cast<uint32_t>(o.seed),
                                  static_cast<uint32_t>(o.seed >> 32));
  const double u0 = unit_double(r.x[0]);
  if (o.mode == InitMode::kUniform) return o.lower + (o.upper - o.lower) * u0;
  if (o.mode == InitMode::kNormal) {
    const double radius = sqrt(-2.0 * log(u0));
    return o.mean + o.std_dev * radius * cos(2.0 * kPi * unit_double(r.x[1]));
  }
  const double z = normal_quantile(o.pa + (o.pb - o.pa) * u0);
  const double v = o.mean + o.std_dev * z;
  return v < o.lower ? o.lower : (v > o.upper ? o.upper : v);
}

// Whether find_or_insert gave an entry a new row, one init_new_rows initializes.
DEMB_HD bool new_row_status(int64_t status) {
  return status == static_cast<int64_t>(InsertStatus::kInserted) ||
         status == static_cast<int64_t>(InsertStatus::kEvicted);
}

}  // namespace demb
