// Row functions shared by the float kernels (math.cpp) and the bfloat16 ones (lowp.cpp), which run
// the same float32 arithmetic on rows they widen into scratch: one definition of each formula.
// static: one copy per translation unit, compiled with its ISA's flags (see dtypes.h).
#pragma once
#include <cmath>
#include <cstdint>

#include "fastmath.h"

namespace pympar {

template <typename T>
static T row_max(const T* x, int64_t n) {
  T m = -INFINITY;
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

template <typename T>
static inline void layernorm_row(const T* xr, const T* w, const T* b, T* yr, T* mean, T* rstd, int64_t C,
                                 double eps) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < C; ++j) s += xr[j];
  T mu = s / T(C);
  T ss = 0;  // second pass over the centred values: no cancellation
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < C; ++j) ss += (xr[j] - mu) * (xr[j] - mu);
  T rs = T(1) / std::sqrt(ss / T(C) + T(eps));
#pragma omp simd
  for (int64_t j = 0; j < C; ++j) yr[j] = (xr[j] - mu) * rs * w[j] + b[j];
  *mean = mu;
  *rstd = rs;
}

// one row of layernorm's backward: dx = rs (dy w - mean(dy w) - xhat mean(dy w xhat)) [+ res];
// pdw += dy xhat, pdb += dy (the caller's partial sums)
template <typename T>
static inline void layernorm_bwd_row(const T* dyr, const T* xr, const T* w, T mu, T rs, const T* rr, T* dxr, T* pdw,
                                     T* pdb, int64_t C) {
  T a = 0, bsum = 0;
#pragma omp simd reduction(+ : a, bsum)
  for (int64_t j = 0; j < C; ++j) {
    T xhat = (xr[j] - mu) * rs;
    T dxhat = dyr[j] * w[j];
    a += dxhat;
    bsum += dxhat * xhat;
    pdw[j] += dyr[j] * xhat;
    pdb[j] += dyr[j];
  }
  a /= T(C);
  bsum /= T(C);
  if (rr == nullptr) {
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) {
      T xhat = (xr[j] - mu) * rs;
      dxr[j] = rs * (dyr[j] * w[j] - a - xhat * bsum);
    }
  } else {
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) {
      T xhat = (xr[j] - mu) * rs;
      T v = rs * (dyr[j] * w[j] - a - xhat * bsum);
      dxr[j] = v + rr[j];
    }
  }
}

template <typename T>
static inline T gelu_value(T xi) {
  const T c = T(0.7978845608028654);
  T u = c * (xi + T(0.044715) * xi * xi * xi);
  return xi / (T(1) + exp_approx(T(-2) * u));
}

// d GELU(x) / dx = s + 2 x s (1 - s) u',  s = sigmoid(2u)
template <typename T>
static inline T gelu_grad(T xi) {
  const T c = T(0.7978845608028654);
  T x2 = xi * xi;
  T u = c * (xi + T(0.044715) * x2 * xi);
  T du = c * (T(1) + T(3 * 0.044715) * x2);
  T s = T(1) / (T(1) + exp_approx(T(-2) * u));
  return s + T(2) * xi * s * (T(1) - s) * du;
}

}  // namespace pympar
