// Causal attention tile by tile with an online softmax (flash-attention style), float32/float64,
// one build per ISA. No (T, T) array exists at any time: the forward keeps the output and one
// log-sum-exp per row; the backward recomputes each tile's probabilities from them.
//
// Layouts (the packing of nn.attention_core): qkv (B, T, 3, H, D), o and dout (B, T, H*D),
// lse (B, H, T), dqkv like qkv. Rows of one head are strided views into those arrays; the tiles
// are small GEMMs on a register-blocked micro-kernel (below), one accumulation order per output
// element, so every thread count gives bit-identical results.
//
// Scores are held transposed, St (key c, query r), so that the GEMMs need no packed copy of k or
// v and the softmax's per-query statistics are vectors along r; query t0 + r sees key s0 + c when
// s0 + c <= t0 + r (only the diagonal tile, s0 == t0, is cut).
//
// Threads: the forward splits over (batch, head, query tile); the backward over (batch, head), or,
// with fewer heads than threads, over (batch, head, key tile) then (batch, head, query tile).
// Scratch is O(T * D) per head being worked on.
#include <algorithm>
#include <cmath>
#include <vector>

#include "fastmath.h"
#include "isa.h"
#include "kernels.h"
#include "threadpool.h"

namespace pympar {
namespace PYMPAR_ISA {
namespace {

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
#elif defined(__AVX2__)
constexpr int kVecBytes = 32;
#else
constexpr int kVecBytes = 16;
#endif
constexpr int64_t kTile = 64;  // query rows and key rows per tile

template <typename T>
struct Micro {
  static constexpr int NR = 2 * kVecBytes / static_cast<int>(sizeof(T));  // two vectors of columns
  static constexpr int MR = kVecBytes >= 64 ? 8 : 4;  // rows held in registers (2 MR of the 32 / 16 vector registers)
};

// C (MR x NR) = [C +] A (MR x K) . B (K x NR, row stride ldb); element (r, k) of A is at
// A[r * ars + k * aks], so A may be a matrix or its transpose (its elements are broadcast one at a
// time, any stride costs the same). The accumulators stay in registers; each C element sums its
// K products in order k = 0, 1, ...
template <typename T, int MR, int NR>
inline void micro(const T* A, int64_t ars, int64_t aks, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t K,
                  bool acc) {
  T c[MR][NR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma omp simd
    for (int n = 0; n < NR; ++n) c[r][n] = acc ? C[r * ldc + n] : T(0);
  for (int64_t k = 0; k < K; ++k) {
    const T* b = B + k * ldb;
    const T* a = A + k * aks;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const T ar = a[r * ars];
#pragma omp simd
      for (int n = 0; n < NR; ++n) c[r][n] = madd(ar, b[n], c[r][n]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma omp simd
    for (int n = 0; n < NR; ++n) C[r * ldc + n] = c[r][n];
}

// the same sums for an edge block of M <= MR rows and N <= NR columns (same order of operations)
template <typename T, int NR>
inline void edge(const T* A, int64_t ars, int64_t aks, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M,
                 int64_t N, int64_t K, bool acc) {
  for (int64_t r = 0; r < M; ++r) {
    T c[NR];
    for (int64_t n = 0; n < N; ++n) c[n] = acc ? C[r * ldc + n] : T(0);
    for (int64_t k = 0; k < K; ++k) {
      const T a = A[r * ars + k * aks];
      const T* b = B + k * ldb;
#pragma omp simd
      for (int64_t n = 0; n < N; ++n) c[n] = madd(a, b[n], c[n]);
    }
    for (int64_t n = 0; n < N; ++n) C[r * ldc + n] = c[n];
  }
}

// C (M x N) = [C +] A (M x K, strides ars, aks) . B (K x N, row stride ldb); C row stride ldc
template <typename T>
void gemm(const T* A, int64_t ars, int64_t aks, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M, int64_t N,
          int64_t K, bool acc) {
  constexpr int MR = Micro<T>::MR, NR = Micro<T>::NR;
  int64_t n0 = 0;
  for (; n0 + NR <= N; n0 += NR) {  // one K x NR panel of B stays in L1 over the row blocks
    int64_t m0 = 0;
    for (; m0 + MR <= M; m0 += MR)
      micro<T, MR, NR>(A + m0 * ars, ars, aks, B + n0, ldb, C + m0 * ldc + n0, ldc, K, acc);
    if (m0 < M) edge<T, NR>(A + m0 * ars, ars, aks, B + n0, ldb, C + m0 * ldc + n0, ldc, M - m0, NR, K, acc);
  }
  if (n0 < N) {
    for (int64_t m0 = 0; m0 < M; m0 += MR)
      edge<T, NR>(A + m0 * ars, ars, aks, B + n0, ldb, C + m0 * ldc + n0, ldc, std::min<int64_t>(MR, M - m0),
                  N - n0, K, acc);
  }
}

template <typename T>
struct Head {  // one (batch, head): strided row pointers into the packed arrays
  const T *q, *k, *v;
  int64_t sq;  // row stride of q, k, v (3 H D)
  Head(const T* qkv, int64_t b, int64_t h, int64_t T_, int64_t H, int64_t D)
      : q(qkv + b * T_ * 3 * H * D + h * D), k(q + H * D), v(q + 2 * H * D), sq(3 * H * D) {}
};

}  // namespace

template <typename T>
void attention_fwd(const T* qkv, T* o, T* lse, int64_t B, int64_t T_, int64_t H, int64_t D, double scale) {
  const int64_t nt = (T_ + kTile - 1) / kTile, so = H * D;
  const T sc = static_cast<T>(scale);
  // task (b, h, query tile): tile i and tile nt-1-i are neighbours in the task order, so that
  // contiguous chunks of tasks carry about equal causal work whatever their count
  parallel_for(B * H * nt, 1, 1, [&](int64_t t0_, int64_t t1_) {
    std::vector<T> QsT(D * kTile), St(kTile * kTile), Oa(kTile * D), m(kTile), l(kTile), alpha(kTile);
    for (int64_t task = t0_; task < t1_; ++task) {
      const int64_t bh = task / nt, z = task % nt;
      const int64_t i = (z % 2 == 0) ? z / 2 : nt - 1 - z / 2;
      const int64_t b = bh / H, h = bh % H;
      Head<T> hd(qkv, b, h, T_, H, D);
      const int64_t t0 = i * kTile, br = std::min(kTile, T_ - t0);
      for (int64_t r = 0; r < br; ++r) {  // QsT (D, br): the scaled queries, transposed
        const T* qr = hd.q + (t0 + r) * hd.sq;
        for (int64_t d = 0; d < D; ++d) QsT[d * kTile + r] = qr[d] * sc;
      }
      std::fill(m.begin(), m.end(), T(-INFINITY));
      std::fill(l.begin(), l.end(), T(0));
      std::fill(Oa.begin(), Oa.end(), T(0));
      for (int64_t j = 0; j <= i; ++j) {
        const int64_t s0 = j * kTile, bc = std::min(kTile, T_ - s0);
        gemm(hd.k + s0 * hd.sq, hd.sq, int64_t(1), QsT.data(), kTile, St.data(), kTile, bc, br, D, false);
        T* mx = alpha.data();  // the new row maxima first, then the rescale factors
        std::copy(m.begin(), m.begin() + br, mx);
        for (int64_t c = 0; c < bc; ++c) {
          const T* sr = St.data() + c * kTile;
          if (j < i) {
#pragma omp simd
            for (int64_t r = 0; r < br; ++r) mx[r] = sr[r] > mx[r] ? sr[r] : mx[r];
          } else {
            for (int64_t r = c; r < br; ++r) mx[r] = sr[r] > mx[r] ? sr[r] : mx[r];
          }
        }
        for (int64_t c = 0; c < bc; ++c) {
          T* sr = St.data() + c * kTile;
          const int64_t r0 = j < i ? 0 : c;  // the diagonal tile: query r sees key c when c <= r
#pragma omp simd
          for (int64_t r = r0; r < br; ++r) sr[r] = exp_approx(sr[r] - mx[r]);
          for (int64_t r = 0; r < r0; ++r) sr[r] = 0;
        }
        for (int64_t r = 0; r < br; ++r) {
          const T a = m[r] == -INFINITY ? T(0) : exp_approx(m[r] - mx[r]);
          m[r] = mx[r];
          l[r] *= a;
          alpha[r] = a;
        }
        for (int64_t c = 0; c < bc; ++c) {
          const T* sr = St.data() + c * kTile;
#pragma omp simd
          for (int64_t r = 0; r < br; ++r) l[r] += sr[r];
        }
        for (int64_t r = 0; r < br; ++r) {
          T* oa = Oa.data() + r * D;
          const T a = alpha[r];
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) oa[d] *= a;
        }
        // Oa (br, D) += P (br, bc) . V (bc, D), P read from St transposed
        gemm(St.data(), int64_t(1), kTile, hd.v + s0 * hd.sq, hd.sq, Oa.data(), D, br, D, bc, true);
      }
      T* lh = lse + (b * H + h) * T_;
      for (int64_t r = 0; r < br; ++r) {
        const T inv = T(1) / l[r];
        T* orow = o + (b * T_ + t0 + r) * so + h * D;
        const T* oa = Oa.data() + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) orow[d] = oa[d] * inv;
        lh[t0 + r] = m[r] + std::log(l[r]);
      }
    }
  });
}

// One head's backward inputs, rearranged once: Qs (T, D) the scaled queries, QsT and dOT (D, T)
// transposed copies (the B operands of the St and dPt GEMMs), Dv (T) = rowsum(dO * O), the
// softmax backward's row term (= sum_c P dP).
template <typename T>
struct BwdHead {
  Head<T> hd;
  const T *doh, *lh;
  T *dq, *dk, *dv;
  int64_t so;
  std::vector<T> Qs, QsT, dOT, Dv;
  BwdHead(const T* qkv, const T* o, const T* lse, const T* dout, T* dqkv, int64_t bh, int64_t T_, int64_t H,
          int64_t D, T sc)
      : hd(qkv, bh / H, bh % H, T_, H, D), so(H * D), Qs(T_ * D), QsT(D * T_), dOT(D * T_), Dv(T_) {
    const int64_t b = bh / H, h = bh % H;
    doh = dout + b * T_ * so + h * D;  // row stride so
    lh = lse + bh * T_;
    dq = dqkv + b * T_ * 3 * H * D + h * D;  // row stride 3 H D, like qkv
    dk = dq + H * D;
    dv = dq + 2 * H * D;
    const T* oh = o + b * T_ * so + h * D;
    for (int64_t t = 0; t < T_; ++t) {
      const T *qr = hd.q + t * hd.sq, *dr = doh + t * so, *orow = oh + t * so;
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += dr[d] * orow[d];
      Dv[t] = s;
      for (int64_t d = 0; d < D; ++d) {
        const T x = qr[d] * sc;
        Qs[t * D + d] = x;
        QsT[d * T_ + t] = x;
        dOT[d * T_ + t] = dr[d];
      }
    }
  }

  // query tile i x key tile j: Pt = P^T (bc, br) and dSt = dS^T, dS = P * (dP - Dv)
  void tile(int64_t i, int64_t j, int64_t T_, int64_t D, T* Pt, T* dSt) const {
    const int64_t t0 = i * kTile, br = std::min(kTile, T_ - t0), s0 = j * kTile, bc = std::min(kTile, T_ - s0);
    gemm(hd.k + s0 * hd.sq, hd.sq, int64_t(1), QsT.data() + t0, T_, Pt, kTile, bc, br, D, false);  // St = K Qs^T
    gemm(hd.v + s0 * hd.sq, hd.sq, int64_t(1), dOT.data() + t0, T_, dSt, kTile, bc, br, D, false);  // dPt = V dO^T
    const T* lr = lh + t0;
    const T* dvr = Dv.data() + t0;
    for (int64_t c = 0; c < bc; ++c) {
      T *pr = Pt + c * kTile, *dr = dSt + c * kTile;
      const int64_t r0 = i > j ? 0 : c;  // the diagonal tile: query r sees key c when c <= r
#pragma omp simd
      for (int64_t r = r0; r < br; ++r) {
        const T p = exp_approx(pr[r] - lr[r]);
        pr[r] = p;
        dr[r] = p * (dr[r] - dvr[r]);
      }
      for (int64_t r = 0; r < r0; ++r) pr[r] = dr[r] = 0;
    }
  }

  // dk, dv of key tile j: sums over query tiles i = j, j+1, ... in that order
  void key_tile(int64_t j, int64_t nt, int64_t T_, int64_t D, T* Pt, T* dSt, T* dK, T* dV, T* dQs) const {
    const int64_t s0 = j * kTile, bc = std::min(kTile, T_ - s0);
    std::fill(dK, dK + kTile * D, T(0));
    std::fill(dV, dV + kTile * D, T(0));
    for (int64_t i = j; i < nt; ++i) {
      const int64_t t0 = i * kTile, br = std::min(kTile, T_ - t0);
      tile(i, j, T_, D, Pt, dSt);
      gemm(Pt, kTile, int64_t(1), doh + t0 * so, so, dV, D, bc, D, br, true);          // dV += P^T dO
      gemm(dSt, kTile, int64_t(1), Qs.data() + t0 * D, D, dK, D, bc, D, br, true);     // dK += dS^T Qs
      if (dQs != nullptr)                                                              // dQs += dS K
        gemm(dSt, int64_t(1), kTile, hd.k + s0 * hd.sq, hd.sq, dQs + t0 * D, D, br, D, bc, true);
    }
    for (int64_t c = 0; c < bc; ++c) {
      std::copy(dK + c * D, dK + (c + 1) * D, dk + (s0 + c) * hd.sq);
      std::copy(dV + c * D, dV + (c + 1) * D, dv + (s0 + c) * hd.sq);
    }
  }

  // dq of query tile i: sums over key tiles j = 0, 1, ..., i in that order (the order key_tile's
  // dQs accumulation has), then scaled
  void query_tile(int64_t i, int64_t T_, int64_t D, T sc, T* Pt, T* dSt, T* dQ) const {
    const int64_t t0 = i * kTile, br = std::min(kTile, T_ - t0);
    std::fill(dQ, dQ + kTile * D, T(0));
    for (int64_t j = 0; j <= i; ++j) {
      const int64_t s0 = j * kTile, bc = std::min(kTile, T_ - s0);
      tile(i, j, T_, D, Pt, dSt);
      gemm(dSt, int64_t(1), kTile, hd.k + s0 * hd.sq, hd.sq, dQ, D, br, D, bc, true);
    }
    write_dq(dQ, t0, br, D, sc);
  }

  void write_dq(const T* dQs, int64_t t0, int64_t rows, int64_t D, T sc) const {
    for (int64_t r = 0; r < rows; ++r) {
      T* dr = dq + (t0 + r) * hd.sq;
      const T* src = dQs + r * D;
      for (int64_t d = 0; d < D; ++d) dr[d] = src[d] * sc;
    }
  }
};

// Two ways to split the work, the same numbers either way (every sum keeps its order):
// - at least as many heads as threads: a thread per head, key tiles outer, dq accumulated as it
//   goes (5 tile GEMMs per tile pair);
// - fewer heads than threads: key tiles (dk, dv) and then query tiles (dq) as separate tasks,
//   which recomputes P and dS once more (8 tile GEMMs per pair) but keeps every thread busy.
template <typename T>
void attention_bwd(const T* qkv, const T* o, const T* lse, const T* dout, T* dqkv, int64_t B, int64_t T_, int64_t H,
                   int64_t D, double scale) {
  const int64_t nt = (T_ + kTile - 1) / kTile, BH = B * H;
  const T sc = static_cast<T>(scale);
  if (BH >= get_num_threads() || nt == 1) {
    parallel_for(BH, 1, 1, [&](int64_t h0, int64_t h1) {
      std::vector<T> dQs(T_ * D), dK(kTile * D), dV(kTile * D), Pt(kTile * kTile), dSt(kTile * kTile);
      for (int64_t bh = h0; bh < h1; ++bh) {
        BwdHead<T> w(qkv, o, lse, dout, dqkv, bh, T_, H, D, sc);
        std::fill(dQs.begin(), dQs.end(), T(0));
        for (int64_t j = 0; j < nt; ++j) w.key_tile(j, nt, T_, D, Pt.data(), dSt.data(), dK.data(), dV.data(), dQs.data());
        w.write_dq(dQs.data(), 0, T_, D, sc);
      }
    });
    return;
  }
  std::vector<BwdHead<T>> heads;
  heads.reserve(BH);
  for (int64_t bh = 0; bh < BH; ++bh) heads.emplace_back(qkv, o, lse, dout, dqkv, bh, T_, H, D, sc);
  // tasks ordered so that contiguous chunks carry about equal work (tile z and nt-1-z side by side)
  auto pick = [nt](int64_t z) { return (z % 2 == 0) ? z / 2 : nt - 1 - z / 2; };
  parallel_for(BH * nt, 1, 1, [&](int64_t t0_, int64_t t1_) {
    std::vector<T> dK(kTile * D), dV(kTile * D), Pt(kTile * kTile), dSt(kTile * kTile);
    for (int64_t task = t0_; task < t1_; ++task)
      heads[task / nt].key_tile(pick(task % nt), nt, T_, D, Pt.data(), dSt.data(), dK.data(), dV.data(), nullptr);
  });
  parallel_for(BH * nt, 1, 1, [&](int64_t t0_, int64_t t1_) {
    std::vector<T> dQ(kTile * D), Pt(kTile * kTile), dSt(kTile * kTile);
    for (int64_t task = t0_; task < t1_; ++task)
      heads[task / nt].query_tile(pick(task % nt), T_, D, sc, Pt.data(), dSt.data(), dQ.data());
  });
}

template void attention_fwd<float>(const float*, float*, float*, int64_t, int64_t, int64_t, int64_t, double);
template void attention_fwd<double>(const double*, double*, double*, int64_t, int64_t, int64_t, int64_t, double);
template void attention_bwd<float>(const float*, const float*, const float*, const float*, float*, int64_t, int64_t,
                                   int64_t, int64_t, double);
template void attention_bwd<double>(const double*, const double*, const double*, const double*, double*, int64_t,
                                    int64_t, int64_t, int64_t, double);

}  // namespace PYMPAR_ISA
}  // namespace pympar
