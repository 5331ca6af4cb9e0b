// Softmax, layernorm, GELU, fused cross-entropy and AdamW on float32/float64, one build per ISA.
// Single-pass loops over rows with `omp simd` reductions (compiled with -fopenmp-simd: the
// vector lanes are the only reassociation, no -ffast-math).
#include <cmath>
#include <vector>

#include "dtypes.h"
#include "fastmath.h"
#include "isa.h"
#include "kernels.h"
#include "rows.h"
#include "threadpool.h"

namespace pympar {
namespace PYMPAR_ISA {

// --- causal softmax: x, y (B, T, T) ----------------------------------------------------
template <typename T>
void softmax_causal_fwd(const T* x, T* y, int64_t B, int64_t T_) {
  parallel_for(B * T_, row_grain(T_), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * T_;
      T* yr = y + r * T_;
      int64_t n = r % T_ + 1;  // visible columns
      T m = row_max(xr, n);
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < n; ++j) {
        T e = exp_approx(xr[j] - m);
        yr[j] = e;
        s += e;
      }
      T inv = T(1) / s;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) yr[j] *= inv;
      for (int64_t j = n; j < T_; ++j) yr[j] = 0;
    }
  });
}

// dx = y * (dy - sum(dy * y)); masked columns of y are 0, so only the visible ones are read
template <typename T>
void softmax_causal_bwd(const T* y, const T* dy, T* dx, int64_t B, int64_t T_) {
  parallel_for(B * T_, row_grain(T_), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T *yr = y + r * T_, *dyr = dy + r * T_;
      T* dxr = dx + r * T_;
      int64_t n = r % T_ + 1;
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t j = 0; j < n; ++j) dot += dyr[j] * yr[j];
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) dxr[j] = yr[j] * (dyr[j] - dot);
      for (int64_t j = n; j < T_; ++j) dxr[j] = 0;
    }
  });
}

// --- layernorm: x, y (N, C) ------------------------------------------------------------
template <typename T>
void layernorm_fwd(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd, int64_t N, int64_t C,
                   double eps) {
  parallel_for(N, row_grain(C), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) layernorm_row(x + r * C, w, b, y + r * C, mean + r, rstd + r, C, eps);
  });
}

// x += res (the residual add, in place), then layernorm of the sum: one pass over memory where
// the add and layernorm_fwd make two; each sum rounds as x + res does, so the result is theirs
// bit for bit
template <typename T>
void add_layernorm_fwd(T* x, const T* res, const T* w, const T* b, T* y, T* mean, T* rstd, int64_t N, int64_t C,
                       double eps) {
  parallel_for(N, row_grain(C), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* xr = x + r * C;
      const T* rr = res + r * C;
#pragma omp simd
      for (int64_t j = 0; j < C; ++j) xr[j] = xr[j] + rr[j];
      layernorm_row(xr, w, b, y + r * C, mean + r, rstd + r, C, eps);
    }
  });
}

// dw, db: partial sums over a fixed number of row slices (independent of the thread count, so
// every thread count gives bit-identical results), summed in slice order at the end.
//
// res (nullable, (N, C)): added to dx (the residual's gradient, one pass fewer than adding it after;
// each dx rounds, then the sum, as that add would)
template <typename T>
void layernorm_bwd(const T* dy, const T* x, const T* w, const T* mean, const T* rstd, const T* res, T* dx, T* dw,
                   T* db, int64_t N, int64_t C) {
  const int64_t S = N < 64 ? (N > 0 ? N : 1) : 64;
  std::vector<T> part(static_cast<size_t>(S * 2 * C), T(0));
  parallel_for(S, 1, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      T* pdw = part.data() + s * 2 * C;
      T* pdb = pdw + C;
      for (int64_t r = N * s / S; r < N * (s + 1) / S; ++r)
        layernorm_bwd_row(dy + r * C, x + r * C, w, mean[r], rstd[r], res ? res + r * C : nullptr, dx + r * C, pdw,
                          pdb, C);
    }
  });
  for (int64_t j = 0; j < C; ++j) dw[j] = db[j] = 0;
  for (int64_t s = 0; s < S; ++s) {
    const T* pdw = part.data() + s * 2 * C;
    for (int64_t j = 0; j < C; ++j) {
      dw[j] += pdw[j];
      db[j] += pdw[C + j];
    }
  }
}

// --- GELU, tanh form: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = c (x + 0.044715 x^3) -----
template <typename T>
void gelu_fwd(const T* x, T* y, int64_t n) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) y[i] = gelu_value(x[i]);
  });
}

// y (N, F) += b (F,): a GEMM's bias, in place, the rows split over the threads (one add per
// element, the same numbers as NumPy's y += b)
template <typename T>
void bias_add(T* y, const T* b, int64_t N, int64_t F) {
  parallel_for(N, row_grain(F), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* yr = y + r * F;
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) yr[j] += b[j];
    }
  });
}

// out (F,) = the sum of x's N rows (x (N, F)), added row after row in order: what NumPy's
// x.sum(axis=0) does, so the same numbers bit for bit at any thread count (the threads split the
// columns; each column's sum is one thread's, in row order)
template <typename T>
void column_sum(const T* x, T* out, int64_t N, int64_t F) {
  parallel_for(F, row_grain(N), kAlign, [&](int64_t j0, int64_t j1) {
    if (N == 0) {
      for (int64_t j = j0; j < j1; ++j) out[j] = 0;
      return;
    }
    for (int64_t j = j0; j < j1; ++j) out[j] = x[j];
    for (int64_t i = 1; i < N; ++i) {
      const T* xr = x + i * F;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) out[j] += xr[j];
    }
  });
}

// h (N, F) += b (F,) (the bias of the GEMM that made h, in place), y = GELU(h): one pass where the
// bias add and gelu_fwd make two, the same numbers bit for bit
template <typename T>
void bias_gelu_fwd(T* h, const T* b, T* y, int64_t N, int64_t F) {
  parallel_for(N, row_grain(F), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* hr = h + r * F;
      T* yr = y + r * F;
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) {
        const T xi = hr[j] + b[j];
        hr[j] = xi;
        yr[j] = gelu_value(xi);
      }
    }
  });
}

template <typename T>
void gelu_bwd(const T* x, const T* dy, T* dx, int64_t n) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) dx[i] = gelu_grad(x[i]) * dy[i];
  });
}

// --- fused softmax + cross-entropy: logits (N, V) ----------------------------------------
template <typename T>
void ce_fwd(const T* logits, const int64_t* targets, T* loss, T* lse, int64_t N, int64_t V) {
  parallel_for(N, row_grain(V), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* lr = logits + r * V;
      T m = row_max(lr, V);
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t j = 0; j < V; ++j) s += exp_approx(lr[j] - m);
      T l = m + std::log(s);
      lse[r] = l;
      int64_t t = targets[r];
      loss[r] = t >= 0 ? l - lr[t] : T(0);
    }
  });
}

template <typename T>
void ce_bwd(const T* logits, const T* lse, const int64_t* targets, const T* dloss, int64_t dloss_stride,
            T* dlogits, int64_t N, int64_t V) {
  parallel_for(N, row_grain(V), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* lr = logits + r * V;
      T* dr = dlogits + r * V;
      int64_t t = targets[r];
      if (t < 0) {
        for (int64_t j = 0; j < V; ++j) dr[j] = 0;
        continue;
      }
      const T l = lse[r], d = dloss[r * dloss_stride];
      const T pt = exp_approx(lr[t] - l);        // read before the row is written: dlogits may be logits
#pragma omp simd
      for (int64_t j = 0; j < V; ++j) dr[j] = exp_approx(lr[j] - l) * d;
      dr[t] = (pt - T(1)) * d;
    }
  });
}

// --- AdamW, in place; mirrors the reference's order of operations ------------------------
struct Half { uint16_t bits; };
struct BHalf { uint16_t bits; };
inline float load_f(float v) { return v; }
inline double load_f(double v) { return v; }
inline float load_f(Half h) { return f16_to_f32(h.bits); }
inline float load_f(BHalf h) { return bf16_to_f32(h.bits); }
inline void store_f(float& d, float x) { d = x; }
inline void store_f(double& d, double x) { d = x; }
inline void store_f(BHalf& d, float x) { d.bits = f32_to_bf16(x); }

// M: the moments' storage, P's own or bf16 (float32 P): loaded exactly, updated and used in P's
// precision, stored rounded once (the update reads the unrounded values)
template <typename P, typename G, typename M>
static void adamw_g(P* p, const G* g, M* m, M* v, int64_t n, double lr, double b1, double b2, double eps,
                    double wd, double bc1, double bc2) {
  const P pb1 = P(b1), pb2 = P(b2), a1 = P(1 - b1), a2 = P(1 - b2), decay = wd != 0 ? P(1 - lr * wd) : P(1);
  const P plr = P(lr), pbc1 = P(bc1), pbc2 = P(bc2), peps = P(eps);
  // p * 1 is exact, so always multiplying equals the reference's skip when weight_decay == 0
  // (and keeps the loop free of a branch GCC would not vectorise)
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) {
      P gi = P(load_f(g[i]));
      // m = b1 m + (1 - b1) g and v = b2 v + (1 - b2) g^2, as the reference's two in-place steps
      P mi = P(load_f(m[i])) * pb1 + a1 * gi;
      P vi = P(load_f(v[i])) * pb2 + a2 * gi * gi;
      store_f(m[i], mi);
      store_f(v[i], vi);
      P pi = p[i] * decay;
      p[i] = pi - plr * (mi / pbc1) / (std::sqrt(vi / pbc2) + peps);
    }
  });
}

template <typename P, typename M>
static void adamw_p(P* p, const void* g, int gdt, M* m, M* v, int64_t n, double lr, double b1, double b2,
                    double eps, double wd, double bc1, double bc2) {
  switch (gdt) {
    case F32: return adamw_g(p, static_cast<const float*>(g), m, v, n, lr, b1, b2, eps, wd, bc1, bc2);
    case F64: return adamw_g(p, static_cast<const double*>(g), m, v, n, lr, b1, b2, eps, wd, bc1, bc2);
    case F16: return adamw_g(p, static_cast<const Half*>(g), m, v, n, lr, b1, b2, eps, wd, bc1, bc2);
    case BF16: return adamw_g(p, static_cast<const BHalf*>(g), m, v, n, lr, b1, b2, eps, wd, bc1, bc2);
  }
}

void adamw(void* p, const void* g, void* m, void* v, int pdt, int gdt, int mdt, int64_t n, double lr, double b1,
           double b2, double eps, double wd, double bc1, double bc2) {
  if (pdt == F32 && mdt == BF16)
    adamw_p(static_cast<float*>(p), g, gdt, static_cast<BHalf*>(m), static_cast<BHalf*>(v), n, lr, b1, b2, eps,
            wd, bc1, bc2);
  else if (pdt == F32)
    adamw_p(static_cast<float*>(p), g, gdt, static_cast<float*>(m), static_cast<float*>(v), n, lr, b1, b2, eps,
            wd, bc1, bc2);
  else
    adamw_p(static_cast<double*>(p), g, gdt, static_cast<double*>(m), static_cast<double*>(v), n, lr, b1, b2,
            eps, wd, bc1, bc2);
}

}  // namespace PYMPAR_ISA
}  // namespace pympar

// the float/double instances the table (table.cpp) points at
namespace pympar {
namespace PYMPAR_ISA {
#define PYMPAR_INSTANTIATE(T)                                                                         \
  template void softmax_causal_fwd<T>(const T*, T*, int64_t, int64_t);                                \
  template void softmax_causal_bwd<T>(const T*, const T*, T*, int64_t, int64_t);                      \
  template void layernorm_fwd<T>(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, double); \
  template void layernorm_bwd<T>(const T*, const T*, const T*, const T*, const T*, const T*, T*, T*, T*, \
                                 int64_t, int64_t);                                                   \
  template void add_layernorm_fwd<T>(T*, const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, double); \
  template void bias_gelu_fwd<T>(T*, const T*, T*, int64_t, int64_t);                                 \
  template void bias_add<T>(T*, const T*, int64_t, int64_t);                                         \
  template void column_sum<T>(const T*, T*, int64_t, int64_t);                                       \
  template void gelu_fwd<T>(const T*, T*, int64_t);                                                   \
  template void gelu_bwd<T>(const T*, const T*, T*, int64_t);                                         \
  template void ce_fwd<T>(const T*, const int64_t*, T*, T*, int64_t, int64_t);                        \
  template void ce_bwd<T>(const T*, const T*, const int64_t*, const T*, int64_t, T*, int64_t, int64_t);
PYMPAR_INSTANTIATE(float)
PYMPAR_INSTANTIATE(double)
}  // namespace PYMPAR_ISA
}  // namespace pympar
