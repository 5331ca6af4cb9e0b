// Branch-free exp for float and double that compilers vectorise (no libm calls in hot loops).
// exp(x) = 2^n * exp(r), n = round(x / ln2), |r| <= ln2/2, exp(r) by its Taylor polynomial:
// degree 7 (float, truncation error < 1e-8 relative) or 13 (double, < 1e-17).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// static: each translation unit keeps its own copy, compiled with its own instruction-set flags
// (the arithmetic units are built once per ISA; an inline definition shared between them would be
// one function to the linker, and an -O0 or LTO build could pick the AVX-512 one on an AVX2 machine)
namespace pympar {

// a * b + c: one fused instruction where the ISA build has FMA. The kernels are compiled with
// -ffp-contract=off so that every other expression rounds like the NumPy reference does.
template <typename T>
static inline T madd(T a, T b, T c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

static inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);  // min/max, not branches: vectorises on SSE2 too
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  float t = madd(x, 1.44269504088896341f, shifter);
  float n = t - shifter;
  float r = madd(n, -0.693145751953125f, x);   // ln2 split in a high part exact in float ...
  r = madd(n, -1.428606765330187045e-06f, r);   // ... and the rest
  float p = 1.0f / 5040.0f;
  p = madd(p, r, 1.0f / 720.0f);
  p = madd(p, r, 1.0f / 120.0f);
  p = madd(p, r, 1.0f / 24.0f);
  p = madd(p, r, 1.0f / 6.0f);
  p = madd(p, r, 0.5f);
  p = madd(p, r, 1.0f);
  p = madd(p, r, 1.0f);
  int32_t ti, si;
  std::memcpy(&ti, &t, 4);
  std::memcpy(&si, &shifter, 4);
  int32_t scale_bits = (ti - si + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &scale_bits, 4);
  return p * scale;
}

static inline double exp_approx(double x) {
  x = std::min(std::max(x, -708.0), 709.0);
  const double shifter = 6755399441055744.0;  // 1.5 * 2^52
  double t = madd(x, 1.4426950408889634074, shifter);
  double n = t - shifter;
  double r = madd(n, -6.93147180369123816490e-01, x);
  r = madd(n, -1.90821492927058770002e-10, r);
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = madd(p, r, 1.0 / 479001600.0);
  p = madd(p, r, 1.0 / 39916800.0);
  p = madd(p, r, 1.0 / 3628800.0);
  p = madd(p, r, 1.0 / 362880.0);
  p = madd(p, r, 1.0 / 40320.0);
  p = madd(p, r, 1.0 / 5040.0);
  p = madd(p, r, 1.0 / 720.0);
  p = madd(p, r, 1.0 / 120.0);
  p = madd(p, r, 1.0 / 24.0);
  p = madd(p, r, 1.0 / 6.0);
  p = madd(p, r, 0.5);
  p = madd(p, r, 1.0);
  p = madd(p, r, 1.0);
  int64_t ti, si;
  std::memcpy(&ti, &t, 8);
  std::memcpy(&si, &shifter, 8);
  int64_t scale_bits = (ti - si + 1023) << 52;
  double scale;
  std::memcpy(&scale, &scale_bits, 8);
  return p * scale;
}

}  // namespace pympar
