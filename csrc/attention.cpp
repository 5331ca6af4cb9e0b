// Attention tile by tile with an online softmax (flash-attention style), float32/float64, one build
// per ISA. No (Tq, Tk) array exists at any time: the forward keeps the output and one log-sum-exp
// per row; the backward recomputes each tile's probabilities from them.
//
// One "block": queries q (B, Tq, H, D) against keys k and values v (B, Tk, H, D), causal (Tq == Tk,
// query t sees key s <= t) or not (every query sees every key). The operands are read in place
// through their batch and row strides (RowStrides; the head stride is D, the last axis
// contiguous), so packed qkv (B, T, 3, H, D) is three such views and so are the halves of a ring
// attention's key/value buffer. o and dout (B, Tq, H*D), lse (B, H, Tq); the backward reads o and
// dout through row strides too (a ring's head group: columns of them), and dq, dk, dv are strided
// outputs like the inputs (dqkv packed, or three separate arrays).
//
// The backward takes o and lse of the complete softmax of these query rows, over every key block
// (ring attention's merged result): P = exp(S - lse), Dv = rowsum(dout * o). Summed over a partition
// of the keys, the blocks' dq (and each key block's dk, dv) are the full attention's gradients.
//
// Rows of one head are strided views into those arrays; the tiles are small GEMMs on a
// register-blocked micro-kernel (below), one accumulation order per output element, so every
// thread count gives bit-identical results.
//
// Scores are held transposed, St (key c, query r), so that the GEMMs need no packed copy of k or
// v and the softmax's per-query statistics are vectors along r; with the causal mask, query t0 + r
// sees key s0 + c when s0 + c <= t0 + r (only the diagonal tile, s0 == t0, is cut).
//
// Threads: the forward splits over (batch, head, query tile); the backward over (batch, head), or,
// with fewer heads than threads, over (batch, head, key tile) then (batch, head, query tile).
// Scratch is O(Tq * D) per head being worked on: each thread copies the keys and values of the head
// it works on into contiguous rows (and, in backward, dout and the transposed q and dout, tile by
// tile), so that no tile GEMM reads rows at the packed qkv's stride; backward takes kGroup key
// tiles per pass over the query side. Neither changes an operation's order: the results are those
// of one tile pair at a time, bit for bit.
//
// Aliasing (the packed backward may write dqkv over qkv, kernels.attention_backward(overwrite=True)):
// the backward reads a head's q, k and v only while building that head's BwdHead (its copies),
// before anything of that head is written, and a head's gradients land only in that head's own
// columns. Keep it so: a change that reads q, k or v of a head after its dk, dv or dq are written
// breaks test_attention_kernel's in-place test.
#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#endif

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
constexpr int64_t kGroup = 4;  // key tiles per pass over the query side in backward

// Register blocks of the tile GEMMs: MR rows by NR columns of C held in registers. AVX-512 (32
// vector registers): 6 rows by four vectors (24 accumulators, four B vectors, the A element an
// embedded broadcast), so that a 64-wide tile of float32 is one panel; measured on 64 x 64 x 64
// products (the tiles' shape) it ran about 1.06x the rate of 8 rows by two vectors. Columns left
// over take panels of two vectors by 8 rows (MR2 x NR2), then single columns. AVX2 and SSE (16
// vector registers): 4 rows by two vectors for both.
template <typename T>
struct Micro {
  static constexpr int V = kVecBytes / static_cast<int>(sizeof(T));  // elements per vector
  static constexpr int NR = (kVecBytes >= 64 ? 4 : 2) * V;
  static constexpr int MR = kVecBytes >= 64 ? 6 : 4;
  static constexpr int NR2 = 2 * V;
  static constexpr int MR2 = kVecBytes >= 64 ? 8 : 4;
};

// C (MR x NR) = [C +] A (MR x K) . B (K x NR, row stride ldb); element (r, k) of A is at
// A[r * ars + k * aks], so A may be a matrix or its transpose (its elements are broadcast one at a
// time, any stride costs the same). The accumulators stay in registers; each C element sums its
// K products in order k = 0, 1, ..., starting from C (acc) or from 0, so that every blocking
// below (and edge) gives the same bits.
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

// the same sums for an edge block of M rows and N <= NR columns (same order of operations)
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

// rows [0, M) of one NR-wide panel: blocks of MR rows, then the R < MR rows left in one block of R
template <typename T, int MR, int NR>
inline void panel(const T* A, int64_t ars, int64_t aks, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M,
                  int64_t K, bool acc) {
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR) micro<T, MR, NR>(A + m0 * ars, ars, aks, B, ldb, C + m0 * ldc, ldc, K, acc);
  if constexpr (MR > 1) {
    if (M - m0 > 0) panel<T, MR - 1, NR>(A + m0 * ars, ars, aks, B, ldb, C + m0 * ldc, ldc, M - m0, K, acc);
  }
}

// C (M x N) = [C +] A (M x K, strides ars, aks) . B (K x N, row stride ldb); C row stride ldc
template <typename T>
void gemm(const T* A, int64_t ars, int64_t aks, const T* B, int64_t ldb, T* C, int64_t ldc, int64_t M, int64_t N,
          int64_t K, bool acc) {
  using U = Micro<T>;
  int64_t n0 = 0;
  for (; n0 + U::NR <= N; n0 += U::NR)  // one K x NR panel of B stays in L1 over the row blocks
    panel<T, U::MR, U::NR>(A, ars, aks, B + n0, ldb, C + n0, ldc, M, K, acc);
  if constexpr (U::NR2 < U::NR) {
    for (; n0 + U::NR2 <= N; n0 += U::NR2) panel<T, U::MR2, U::NR2>(A, ars, aks, B + n0, ldb, C + n0, ldc, M, K, acc);
  }
  if (n0 < N) edge<T, U::NR>(A, ars, aks, B + n0, ldb, C + n0, ldc, M, N - n0, K, acc);
}

// Scratch whose every element read is written first: a vector that leaves its elements
// uninitialised (no memset of buffers the next loop overwrites; the zero sums below start from the
// GEMMs' acc = false instead of a filled buffer)
template <typename T>
struct NoInit : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = NoInit<U>;
  };
  NoInit() = default;
  template <typename U>
  NoInit(const NoInit<U>&) {}
  template <typename U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... A>
  void construct(U* p, A&&... a) {
    ::new (static_cast<void*>(p)) U(std::forward<A>(a)...);
  }
};
template <typename T>
using Buf = std::vector<T, NoInit<T>>;

// dst (cols x rows, row stride ld) = the transpose of src (rows x cols, row stride ls): the tiles'
// B operands (queries and dO, transposed). Exact (a copy), so any order gives the same bits; with
// AVX, 8 x 8 blocks in registers (the scalar walk down a column took ~8% of a T=128 forward).
#if defined(__AVX__)
inline void t8x8(const float* s, int64_t ls, float* d, int64_t ld) {
  __m256 r0 = _mm256_loadu_ps(s), r1 = _mm256_loadu_ps(s + ls), r2 = _mm256_loadu_ps(s + 2 * ls),
         r3 = _mm256_loadu_ps(s + 3 * ls), r4 = _mm256_loadu_ps(s + 4 * ls), r5 = _mm256_loadu_ps(s + 5 * ls),
         r6 = _mm256_loadu_ps(s + 6 * ls), r7 = _mm256_loadu_ps(s + 7 * ls);
  __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
         t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
         t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE), u2 = _mm256_shuffle_ps(t1, t3, 0x44),
         u3 = _mm256_shuffle_ps(t1, t3, 0xEE), u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
         u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  _mm256_storeu_ps(d, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(d + ld, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(d + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(d + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(d + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(d + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(d + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(d + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
}
#endif

template <typename T>
inline void transpose(const T* src, int64_t ls, T* dst, int64_t ld, int64_t rows, int64_t cols) {
  int64_t r0 = 0;
#if defined(__AVX__)
  if constexpr (sizeof(T) == 4) {
    const int64_t c0 = cols - cols % 8;
    for (r0 = 0; r0 + 8 <= rows; r0 += 8)
      for (int64_t c = 0; c < c0; c += 8)
        t8x8(reinterpret_cast<const float*>(src + r0 * ls + c), ls, reinterpret_cast<float*>(dst + c * ld + r0), ld);
    for (int64_t r = 0; r < r0; ++r)  // the columns right of the 8 x 8 blocks
      for (int64_t c = c0; c < cols; ++c) dst[c * ld + r] = src[r * ls + c];
  }
#endif
  for (int64_t r = r0; r < rows; ++r)  // the rows below them (all rows without AVX)
    for (int64_t c = 0; c < cols; ++c) dst[c * ld + r] = src[r * ls + c];
}

// task z of n tiles -> the tile: 0, n-1, 1, n-2, ..., so that contiguous chunks of tasks carry
// about equal causal work whatever their count (without the mask every tile has the same work)
inline int64_t balanced(int64_t z, int64_t n) { return z % 2 == 0 ? z / 2 : n - 1 - z / 2; }

inline int64_t tiles(int64_t n) { return (n + kTile - 1) / kTile; }

template <typename T>
struct Head {  // one (batch, head): row pointers into q, k, v and their row strides
  const T *q, *k, *v;
  int64_t sq, sk, sv;
  Head(const T* q_, RowStrides qs, const T* k_, RowStrides ks, const T* v_, RowStrides vs, int64_t b, int64_t h,
       int64_t D)
      : q(q_ + b * qs.batch + h * D), k(k_ + b * ks.batch + h * D), v(v_ + b * vs.batch + h * D), sq(qs.row),
        sk(ks.row), sv(vs.row) {}
};

// Contiguous copies (rows of D) of one head's keys and values: the tile GEMMs read them at a row
// stride of D rather than the packed qkv's 3 H D (whose multiples of 64 bytes put a tile's rows in
// a few L1 sets, each re-read by every row block of the product). cover() copies the rows up to
// `rows` of head bh, starting over when the head changes: a thread's consecutive tasks are mostly
// one head's query tiles, so each head is copied about once per thread.
template <typename T>
struct Packed {
  Buf<T> k, v;
  int64_t D, bh = -1, rows = 0;
  Packed(int64_t Tk, int64_t D_) : k(Tk * D_), v(Tk * D_), D(D_) {}
  void cover(const Head<T>& hd, int64_t bh_, int64_t upto) {
    if (bh_ != bh) bh = bh_, rows = 0;
    for (; rows < upto; ++rows) {
      std::copy(hd.k + rows * hd.sk, hd.k + rows * hd.sk + D, k.data() + rows * D);
      std::copy(hd.v + rows * hd.sv, hd.v + rows * hd.sv + D, v.data() + rows * D);
    }
  }
};

}  // namespace

template <typename T>
void attention_block_fwd(const T* q, RowStrides qs, const T* k, RowStrides ks, const T* v, RowStrides vs, T* o,
                         T* lse, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t D, bool causal, double scale) {
  const int64_t nq = tiles(Tq), nk = tiles(Tk), so = H * D;
  const T sc = static_cast<T>(scale);
  parallel_for(B * H * nq, 1, 1, [&](int64_t t0_, int64_t t1_) {
    Buf<T> Qc(kTile * D), QsT(D * kTile), St(kTile * kTile), Oa(kTile * D), m(kTile), l(kTile), alpha(kTile), mxv(kTile);
    Packed<T> kv(Tk, D);
    for (int64_t task = t0_; task < t1_; ++task) {
      const int64_t bh = task / nq, i = balanced(task % nq, nq);
      const int64_t b = bh / H, h = bh % H;
      Head<T> hd(q, qs, k, ks, v, vs, b, h, D);
      const int64_t t0 = i * kTile, br = std::min(kTile, Tq - t0);
      kv.cover(hd, bh, causal ? std::min(Tk, t0 + br) : Tk);
      // QsT (D, br): the scaled queries, transposed, from a contiguous copy of the tile's rows (read
      // down a column at the packed qkv's row stride, whose multiples of 1 KiB fall in a few L1
      // sets, the 64 rows would not stay in L1 over the D columns)
      for (int64_t r = 0; r < br; ++r) {
        const T* qr = hd.q + (t0 + r) * hd.sq;
        T* dst = Qc.data() + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) dst[d] = qr[d] * sc;
      }
      transpose(Qc.data(), D, QsT.data(), kTile, br, D);
      std::fill(m.begin(), m.end(), T(-INFINITY));
      std::fill(l.begin(), l.end(), T(0));
      std::fill(Oa.begin(), Oa.end(), T(0));
      const int64_t nj = causal ? i + 1 : nk;
      for (int64_t j = 0; j < nj; ++j) {
        const int64_t s0 = j * kTile, bc = std::min(kTile, Tk - s0);
        const bool cut = causal && j == i;  // the diagonal tile: query r sees key c when c <= r
        gemm(kv.k.data() + s0 * D, D, int64_t(1), QsT.data(), kTile, St.data(), kTile, bc, br, D, false);
        T* mx = mxv.data();  // the new row maxima
        std::copy(m.begin(), m.begin() + br, mx);
        for (int64_t c = 0; c < bc; ++c) {
          const T* sr = St.data() + c * kTile;
          if (!cut) {
#pragma omp simd
            for (int64_t r = 0; r < br; ++r) mx[r] = sr[r] > mx[r] ? sr[r] : mx[r];
          } else {
            for (int64_t r = c; r < br; ++r) mx[r] = sr[r] > mx[r] ? sr[r] : mx[r];
          }
        }
        for (int64_t r = 0; r < br; ++r) {
          const T a = m[r] == -INFINITY ? T(0) : exp_approx(m[r] - mx[r]);  // exactly 1 when
          m[r] = mx[r];                                                     // the max stays
          l[r] *= a;
          alpha[r] = a;
        }
        // P = exp(S - m) and the row sums l, key by key (one pass over the tile)
        for (int64_t c = 0; c < bc; ++c) {
          T* sr = St.data() + c * kTile;
          const int64_t r0 = cut ? c : 0;
#pragma omp simd
          for (int64_t r = r0; r < br; ++r) {
            const T p = exp_approx(sr[r] - mx[r]);
            sr[r] = p;
            l[r] += p;
          }
          for (int64_t r = 0; r < r0; ++r) sr[r] = 0;
        }
        for (int64_t r = 0; r < br; ++r) {
          const T a = alpha[r];
          if (a == T(1)) continue;  // (x * 1 == x: skipping it changes no bit)
          T* oa = Oa.data() + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) oa[d] *= a;
        }
        // Oa (br, D) += P (br, bc) . V (bc, D), P read from St transposed
        gemm(St.data(), int64_t(1), kTile, kv.v.data() + s0 * D, D, Oa.data(), D, br, D, bc, true);
      }
      T* lh = lse + (b * H + h) * Tq;
      for (int64_t r = 0; r < br; ++r) {
        const T inv = T(1) / l[r];
        T* orow = o + (b * Tq + t0 + r) * so + h * D;
        const T* oa = Oa.data() + r * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) orow[d] = oa[d] * inv;
        lh[t0 + r] = m[r] + std::log(l[r]);
      }
    }
  });
}

// One head's backward inputs, rearranged once: Qs (Tq, D) the scaled queries, QsT and dOT their
// and dO's transposes tile by tile (query tile i is the contiguous (D, kTile) block at i * D *
// kTile: the B operands of the St and dPt GEMMs, read at a row stride of kTile, not Tq, whose
// multiples of 4 KiB would put every row of a panel in the same L1 sets), Dv (Tq) = rowsum(dO * O),
// the softmax backward's row term (= sum over all keys of P dP: O is the complete softmax's output).
template <typename T>
struct BwdHead {
  Head<T> hd;
  const T *doh, *lh;
  T *dq, *dk, *dv;  // row strides sdq, sdk, sdv
  int64_t sdo, sdq, sdk, sdv, Tq, Tk;
  bool causal;
  Buf<T> Qs, QsT, dOT, dOc, Dv;
  Packed<T> kv;
  BwdHead(const Head<T>& hd_, const T* o, RowStrides os, const T* lse, const T* dout, RowStrides dos, T* dq_,
          RowStrides dqs, T* dk_, RowStrides dks, T* dv_, RowStrides dvs, int64_t bh, int64_t Tq_, int64_t Tk_,
          int64_t H, int64_t D, bool causal_, T sc)
      : hd(hd_), sdo(dos.row), sdq(dqs.row), sdk(dks.row), sdv(dvs.row), Tq(Tq_), Tk(Tk_), causal(causal_),
        Qs(Tq_ * D), QsT(D * tiles(Tq_) * kTile), dOT(D * tiles(Tq_) * kTile), dOc(Tq_ * D), Dv(Tq_), kv(Tk_, D) {
    const int64_t b = bh / H, h = bh % H;
    doh = dout + b * dos.batch + h * D;  // row stride sdo
    lh = lse + bh * Tq;
    dq = dq_ + b * dqs.batch + h * D;
    dk = dk_ + b * dks.batch + h * D;
    dv = dv_ + b * dvs.batch + h * D;
    const T* oh = o + b * os.batch + h * D;
    for (int64_t t = 0; t < Tq; ++t) {
      const T *qr = hd.q + t * hd.sq, *dr = doh + t * sdo, *orow = oh + t * os.row;
      T s = 0;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += dr[d] * orow[d];
      Dv[t] = s;
      for (int64_t d = 0; d < D; ++d) Qs[t * D + d] = qr[d] * sc;
      std::copy(dr, dr + D, dOc.data() + t * D);
    }
    for (int64_t t0 = 0; t0 < Tq; t0 += kTile) {  // the transposes, tile by tile, from the copies
      const int64_t br = std::min(kTile, Tq - t0);
      T *qt = QsT.data() + t0 * D, *dt = dOT.data() + t0 * D;  // tile t0 / kTile: (D, kTile) at t0 * D
      transpose(Qs.data() + t0 * D, D, qt, kTile, br, D);
      transpose(dOc.data() + t0 * D, D, dt, kTile, br, D);
    }
    kv.cover(hd, bh, Tk_);
  }

  // query tile i x key tile j: Pt = P^T (bc, br) and dSt = dS^T, dS = P * (dP - Dv)
  void tile(int64_t i, int64_t j, int64_t D, T* Pt, T* dSt) const {
    const int64_t t0 = i * kTile, br = std::min(kTile, Tq - t0), s0 = j * kTile, bc = std::min(kTile, Tk - s0);
    const int64_t qt = i * D * kTile;  // query tile i's (D, kTile) block
    gemm(kv.k.data() + s0 * D, D, int64_t(1), QsT.data() + qt, kTile, Pt, kTile, bc, br, D, false);  // St = K Qs^T
    gemm(kv.v.data() + s0 * D, D, int64_t(1), dOT.data() + qt, kTile, dSt, kTile, bc, br, D, false);  // dPt = V dO^T
    const T* lr = lh + t0;
    const T* dvr = Dv.data() + t0;
    const bool cut = causal && i == j;  // the diagonal tile: query r sees key c when c <= r
    for (int64_t c = 0; c < bc; ++c) {
      T *pr = Pt + c * kTile, *dr = dSt + c * kTile;
      const int64_t r0 = cut ? c : 0;
#pragma omp simd
      for (int64_t r = r0; r < br; ++r) {
        const T p = exp_approx(pr[r] - lr[r]);
        pr[r] = p;
        dr[r] = p * (dr[r] - dvr[r]);
      }
      for (int64_t r = 0; r < r0; ++r) pr[r] = dr[r] = 0;
    }
  }

  // dk, dv of key tiles j0 .. j0+G-1: each sums over the query tiles that see it (i = j, j+1, ...
  // causal; all otherwise) in that order; dQs (when given) gets each query tile's terms in key
  // order. G key tiles share one pass over the query side (Qs, its and dO's transposes, dO, dQs:
  // 5 T D numbers that outgrow L2 at long T), and every sum keeps its order, whatever G.
  void key_tiles(int64_t j0, int64_t G, int64_t D, T* Pt, T* dSt, T* dK, T* dV, T* dQs) const {
    const int64_t nq = tiles(Tq), nk = tiles(Tk);
    G = std::min(G, nk - j0);
    for (int64_t i = causal ? j0 : 0; i < nq; ++i) {
      const int64_t t0 = i * kTile, br = std::min(kTile, Tq - t0);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t j = j0 + g, s0 = j * kTile, bc = std::min(kTile, Tk - s0);
        if (causal && i < j) break;
        T *dKg = dK + g * kTile * D, *dVg = dV + g * kTile * D;
        const bool more = i > (causal ? j : 0);  // key tile j's first query tile writes, the rest add
        tile(i, j, D, Pt, dSt);
        gemm(Pt, kTile, int64_t(1), dOc.data() + t0 * D, D, dVg, D, bc, D, br, more);    // dV += P^T dO
        gemm(dSt, kTile, int64_t(1), Qs.data() + t0 * D, D, dKg, D, bc, D, br, more);    // dK += dS^T Qs
        if (dQs != nullptr)                                          // dQs += dS K (key tile 0 writes)
          gemm(dSt, int64_t(1), kTile, kv.k.data() + s0 * D, D, dQs + t0 * D, D, br, D, bc, j > 0);
      }
    }
    for (int64_t c = 0; c < std::min(G * kTile, Tk - j0 * kTile); ++c) {
      std::copy(dK + c * D, dK + (c + 1) * D, dk + (j0 * kTile + c) * sdk);
      std::copy(dV + c * D, dV + (c + 1) * D, dv + (j0 * kTile + c) * sdv);
    }
  }

  // dq of query tile i: sums over the key tiles it sees (j = 0, 1, ..., i causal; all otherwise)
  // in that order (the order key_tiles's dQs accumulation has), then scaled
  void query_tile(int64_t i, int64_t D, T sc, T* Pt, T* dSt, T* dQ) const {
    const int64_t t0 = i * kTile, br = std::min(kTile, Tq - t0), nj = causal ? i + 1 : tiles(Tk);
    for (int64_t j = 0; j < nj; ++j) {
      const int64_t s0 = j * kTile, bc = std::min(kTile, Tk - s0);
      tile(i, j, D, Pt, dSt);
      gemm(dSt, int64_t(1), kTile, kv.k.data() + s0 * D, D, dQ, D, br, D, bc, j > 0);
    }
    write_dq(dQ, t0, br, D, sc);
  }

  void write_dq(const T* dQs, int64_t t0, int64_t rows, int64_t D, T sc) const {
    for (int64_t r = 0; r < rows; ++r) {
      T* dr = dq + (t0 + r) * sdq;
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
void attention_block_bwd(const T* q, RowStrides qs, const T* k, RowStrides ks, const T* v, RowStrides vs, const T* o,
                         RowStrides os, const T* lse, const T* dout, RowStrides dos, T* dq, RowStrides dqs, T* dk,
                         RowStrides dks, T* dv, RowStrides dvs, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t D,
                         bool causal, double scale) {
  const int64_t nq = tiles(Tq), nk = tiles(Tk), BH = B * H;
  const T sc = static_cast<T>(scale);
  auto head = [&](int64_t bh) {
    return BwdHead<T>(Head<T>(q, qs, k, ks, v, vs, bh / H, bh % H, D), o, os, lse, dout, dos, dq, dqs, dk, dks, dv,
                      dvs, bh, Tq, Tk, H, D, causal, sc);
  };
  if (BH >= get_num_threads() || std::max(nq, nk) <= 1) {
    parallel_for(BH, 1, 1, [&](int64_t h0, int64_t h1) {
      Buf<T> dQs(Tq * D), dK(kGroup * kTile * D), dV(kGroup * kTile * D), Pt(kTile * kTile),
          dSt(kTile * kTile);
      for (int64_t bh = h0; bh < h1; ++bh) {
        const BwdHead<T> w = head(bh);
        for (int64_t j = 0; j < nk; j += kGroup)
          w.key_tiles(j, kGroup, D, Pt.data(), dSt.data(), dK.data(), dV.data(), dQs.data());
        w.write_dq(dQs.data(), 0, Tq, D, sc);
      }
    });
    return;
  }
  std::vector<BwdHead<T>> heads;
  heads.reserve(BH);
  for (int64_t bh = 0; bh < BH; ++bh) heads.push_back(head(bh));
  parallel_for(BH * nk, 1, 1, [&](int64_t t0_, int64_t t1_) {
    Buf<T> dK(kTile * D), dV(kTile * D), Pt(kTile * kTile), dSt(kTile * kTile);
    for (int64_t task = t0_; task < t1_; ++task)
      heads[task / nk].key_tiles(balanced(task % nk, nk), 1, D, Pt.data(), dSt.data(), dK.data(), dV.data(), nullptr);
  });
  parallel_for(BH * nq, 1, 1, [&](int64_t t0_, int64_t t1_) {
    Buf<T> dQ(kTile * D), Pt(kTile * kTile), dSt(kTile * kTile);
    for (int64_t task = t0_; task < t1_; ++task)
      heads[task / nq].query_tile(balanced(task % nq, nq), D, sc, Pt.data(), dSt.data(), dQ.data());
  });
}

#define PYMPAR_ATTENTION(T)                                                                                      \
  template void attention_block_fwd<T>(const T*, RowStrides, const T*, RowStrides, const T*, RowStrides, T*, T*, \
                                       int64_t, int64_t, int64_t, int64_t, int64_t, bool, double);               \
  template void attention_block_bwd<T>(const T*, RowStrides, const T*, RowStrides, const T*, RowStrides,         \
                                       const T*, RowStrides, const T*, const T*, RowStrides, T*, RowStrides, T*, \
                                       RowStrides, T*, RowStrides, int64_t, int64_t, int64_t, int64_t, int64_t,  \
                                       bool, double);
PYMPAR_ATTENTION(float)
PYMPAR_ATTENTION(double)
#undef PYMPAR_ATTENTION

}  // namespace PYMPAR_ISA
}  // namespace pympar
