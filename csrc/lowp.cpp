// bfloat16 activations, float32 arithmetic: layernorm, GELU, bias adds, column sums and the bf16
// GEMM's epilogue, one build per ISA. Storage is uint16 (the top half of a float32); each kernel
// widens its inputs exactly, runs the float kernel's own formula (rows.h) in float32 and rounds
// each output once, to nearest even -- where the reference (kernels/reference.py) rounds. So a
// bf16 kernel gives the float32 kernel's result on the widened inputs, rounded: the tests compare
// them bit for bit. Parameters (layernorm's w, b; biases) and statistics stay float32.
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "isa.h"
#include "kernels.h"
#include "rows.h"
#include "threadpool.h"

namespace pympar {
namespace PYMPAR_ISA {

static inline void widen(const uint16_t* s, float* d, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
}

static inline void narrow(const float* s, uint16_t* d, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
}

// rounds x to bfloat16 and back: the value a bf16 array holds
static inline float rnd(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// per-thread float rows (the pool's threads live as long as the process)
static float* scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

void layernorm_fwd_bf16(const uint16_t* x, const float* w, const float* b, uint16_t* y, float* mean, float* rstd,
                        int64_t N, int64_t C, double eps) {
  parallel_for(N, row_grain(C), 1, [&](int64_t r0, int64_t r1) {
    float* xf = scratch(2 * C);
    float* yf = xf + C;
    for (int64_t r = r0; r < r1; ++r) {
      widen(x + r * C, xf, C);
      layernorm_row(xf, w, b, yf, mean + r, rstd + r, C, eps);
      narrow(yf, y + r * C, C);
    }
  });
}

// x = round(x + res) in place (the residual sum the caller keeps), then layernorm of that sum
void add_layernorm_fwd_bf16(uint16_t* x, const uint16_t* res, const float* w, const float* b, uint16_t* y,
                            float* mean, float* rstd, int64_t N, int64_t C, double eps) {
  parallel_for(N, row_grain(C), 1, [&](int64_t r0, int64_t r1) {
    float* xf = scratch(2 * C);
    float* yf = xf + C;
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* xr = x + r * C;
      const uint16_t* rr = res + r * C;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) {
        const uint16_t s = f32_to_bf16(bf16_to_f32(xr[j]) + bf16_to_f32(rr[j]));
        xr[j] = s;
        xf[j] = bf16_to_f32(s);
      }
      layernorm_row(xf, w, b, yf, mean + r, rstd + r, C, eps);
      narrow(yf, y + r * C, C);
    }
  });
}

// dx = round(round(layernorm's dx) + res): the residual is added after dx is rounded, as an add
// after the call would (the reference's order); dw, db float32 over the same fixed row slices as
// the float kernel (thread-count independent)
void layernorm_bwd_bf16(const uint16_t* dy, const uint16_t* x, const float* w, const float* mean, const float* rstd,
                        const uint16_t* res, uint16_t* dx, float* dw, float* db, int64_t N, int64_t C) {
  const int64_t S = N < 64 ? (N > 0 ? N : 1) : 64;
  std::vector<float> part(static_cast<size_t>(S * 2 * C), 0.0f);
  parallel_for(S, 1, 1, [&](int64_t s0, int64_t s1) {
    float* dyf = scratch(3 * C);
    float* xf = dyf + C;
    float* dxf = xf + C;
    for (int64_t s = s0; s < s1; ++s) {
      float* pdw = part.data() + s * 2 * C;
      float* pdb = pdw + C;
      for (int64_t r = N * s / S; r < N * (s + 1) / S; ++r) {
        widen(dy + r * C, dyf, C);
        widen(x + r * C, xf, C);
        layernorm_bwd_row<float>(dyf, xf, w, mean[r], rstd[r], nullptr, dxf, pdw, pdb, C);
        uint16_t* dxr = dx + r * C;
        if (res == nullptr) {
          narrow(dxf, dxr, C);
        } else {
          const uint16_t* rr = res + r * C;
#pragma omp simd
          for (int64_t j = 0; j < C; ++j) dxr[j] = f32_to_bf16(rnd(dxf[j]) + bf16_to_f32(rr[j]));
        }
      }
    }
  });
  for (int64_t j = 0; j < C; ++j) dw[j] = db[j] = 0;
  for (int64_t s = 0; s < S; ++s) {
    const float* pdw = part.data() + s * 2 * C;
    for (int64_t j = 0; j < C; ++j) {
      dw[j] += pdw[j];
      db[j] += pdw[C + j];
    }
  }
}

void gelu_fwd_bf16(const uint16_t* x, uint16_t* y, int64_t n) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) y[i] = f32_to_bf16(gelu_value(bf16_to_f32(x[i])));
  });
}

// dx = round(GELU'(x) dy); dx may be dy or x itself
void gelu_bwd_bf16(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) dx[i] = f32_to_bf16(gelu_grad(bf16_to_f32(x[i])) * bf16_to_f32(dy[i]));
  });
}

// h = round(h + b) in place, y = round(GELU(h)) of the rounded h (what backward computes again)
void bias_gelu_fwd_bf16(uint16_t* h, const float* b, uint16_t* y, int64_t N, int64_t F) {
  parallel_for(N, row_grain(F), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* hr = h + r * F;
      uint16_t* yr = y + r * F;
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) {
        const uint16_t s = f32_to_bf16(bf16_to_f32(hr[j]) + b[j]);
        hr[j] = s;
        yr[j] = f32_to_bf16(gelu_value(bf16_to_f32(s)));
      }
    }
  });
}

void bias_add_bf16(uint16_t* y, const float* b, int64_t N, int64_t F) {
  parallel_for(N, row_grain(F), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      uint16_t* yr = y + r * F;
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) yr[j] = f32_to_bf16(bf16_to_f32(yr[j]) + b[j]);
    }
  });
}

// out (F,) float32 = the sum of x's N bf16 rows, row after row in order (a bias gradient)
void column_sum_bf16(const uint16_t* x, float* out, int64_t N, int64_t F) {
  parallel_for(F, row_grain(N), kAlign, [&](int64_t j0, int64_t j1) {
    if (N == 0) {
      for (int64_t j = j0; j < j1; ++j) out[j] = 0;
      return;
    }
    for (int64_t j = j0; j < j1; ++j) out[j] = bf16_to_f32(x[j]);
    for (int64_t i = 1; i < N; ++i) {
      const uint16_t* xr = x + i * F;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) out[j] += bf16_to_f32(xr[j]);
    }
  });
}

// The bf16 GEMM's epilogue on one tile: c (R, N) float32 products (row stride ldc) ->
// h = round(c + bias) (bias nullable) into bf16 rows of stride ldh, and, when g is given,
// g = round(GELU(h)) of the rounded h (stride ldg). Single-threaded: the caller runs tiles in parallel.
void gemm_epilogue_bf16(const float* c, int64_t ldc, const float* bias, uint16_t* h, int64_t ldh, uint16_t* g,
                        int64_t ldg, int64_t R, int64_t N) {
  for (int64_t r = 0; r < R; ++r) {
    const float* cr = c + r * ldc;
    uint16_t* hr = h + r * ldh;
    if (bias == nullptr && g == nullptr) {
      narrow(cr, hr, N);
    } else if (g == nullptr) {
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) hr[j] = f32_to_bf16(cr[j] + bias[j]);
    } else {
      uint16_t* gr = g + r * ldg;
#pragma omp simd
      for (int64_t j = 0; j < N; ++j) {
        const uint16_t s = f32_to_bf16(bias ? cr[j] + bias[j] : cr[j]);
        hr[j] = s;
        gr[j] = f32_to_bf16(gelu_value(bf16_to_f32(s)));
      }
    }
  }
}

}  // namespace PYMPAR_ISA
}  // namespace pympar
