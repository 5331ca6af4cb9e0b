// Causal attention in bf16 on AMX tiles (or, where the CPU has AVX512-BF16 and no AMX, the same blocks
// on VDPBF16PS dot products: mm32's other engine), flash-attention style: q, k, v, o, dout and dqkv bf16,
// softmax statistics (lse) and every accumulator float32. Packed qkv (B, T, 3, H, D) as
// nn.attention_core passes it, D a multiple of 32 (the tiles' k-step). Nothing (T, T) exists.
//
// Per (batch, head) the thread copies what it reads into contiguous rows and VNNI panels (amx.cpp's
// pack_b), then works in 32 x 32 blocks of (queries, keys), each product a 2 x 2-tile TDPBF16PS block:
//   forward, per query block: S = Q K^T (float32), the online softmax in float32 (row max, the
//     rescale of the running output), P rounded to bf16, O += P V in float32; o = O / l rounded once,
//     lse = m + log l.
//   backward (FlashAttention-2's order: key blocks outer, query blocks inner), per pair:
//     St = K Q^T and dPt = V dO^T (keys x queries), P = exp(scale St - lse), dS = P (dPt - Dv),
//     Dv = rowsum(dO o); P and dS rounded to bf16; dV += P^T dO, dK += dS^T Q, dQ^T += K^T dS^T,
//     all float32; dk = scale dK, dq = scale dQ, dv rounded once.
// The rounding points are those of bf16 flash attention (P and dS in bf16 before their products).
// Aliasing: a head's q, k, v are read only while its copies are made, before any of its gradients
// is written, and its gradients land in its own columns only: dqkv may be qkv (as attention.cpp).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "amx.h"
#include "amx_tiles.h"
#include "dtypes.h"
#include "fastmath.h"
#include "threadpool.h"

namespace pympar {
namespace amx {
namespace {

constexpr int64_t kT = 512;    // bf16 elements per tile (16 rows x 64 bytes)
constexpr int64_t kBlk = 1024;  // a k-block of a packed panel: two tiles

// C (32 x 32 float32, row stride ldc floats) [+]= A B: A's 32 rows at a (row stride lda bf16
// elements), k-steps of 32 consecutive elements; B's k-blocks at b, b + kBlk, ... (VNNI tiles).
// kTiles: on AMX tiles; else on AVX512-BF16 dot products (amx_tiles.h's dp_rows, A's rows read in
// place); within each element the pairs are added in k order on both.
template <bool kTiles>
inline void mm32(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ksteps, float* c, int64_t ldc, bool acc) {
  if constexpr (!kTiles) {
    dp_rows(a, lda, 32, b, ksteps, acc ? c : nullptr, c, ldc, 32);
  } else {
    const int64_t sa = lda * 2, sc = ldc * 4;
    if (acc) {
      _tile_loadd(0, c, sc);
      _tile_loadd(1, c + 16, sc);
      _tile_loadd(2, c + 16 * ldc, sc);
      _tile_loadd(3, c + 16 * ldc + 16, sc);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t ks = 0; ks < ksteps; ++ks) {
      _tile_loadd(4, a + ks * 32, sa);
      _tile_loadd(6, b + ks * kBlk, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(7, b + ks * kBlk + kT, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_loadd(5, a + 16 * lda + ks * 32, sa);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c, sc);
    _tile_stored(1, c + 16, sc);
    _tile_stored(2, c + 16 * ldc, sc);
    _tile_stored(3, c + 16 * ldc + 16, sc);
  }
}

// a (32 x 32 bf16, row stride 32) as B's one k-block: rows k pairs interleaved (VNNI), two tiles of 16 columns
inline void vnni32(const uint16_t* a, uint16_t* dst) {
  const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                                       5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int j = 0; j < 2; ++j)
    for (int r = 0; r < 16; ++r) {
      const uint16_t* r0 = a + 2 * r * 32 + 16 * j;
      __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0)));
      v = _mm512_inserti64x4(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 32)), 1);
      _mm512_store_si512(dst + j * kT + r * 32, _mm512_permutexvar_epi16(idx, v));
    }
}

// rows [0, T) of one head's (T, D) operand at src (row stride ld) -> dst (Tp, D) contiguous, rows
// T .. Tp zero
inline void copy_rows(const uint16_t* src, int64_t ld, int64_t T, int64_t Tp, int64_t D, uint16_t* dst) {
  for (int64_t t = 0; t < T; ++t) std::memcpy(dst + t * D, src + t * ld, static_cast<size_t>(D) * 2);
  std::memset(dst + T * D, 0, static_cast<size_t>((Tp - T) * D) * 2);
}

// exp of 16 floats: fastmath.h's exp_approx (the same range reduction and polynomial), vectorised
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 shifter = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), shifter);
  const __m512 n = _mm512_sub_ps(t, shifter);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_sub_epi32(_mm512_castps_si512(t), _mm512_castps_si512(shifter)), _mm512_set1_epi32(127)),
      23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// 16 floats -> 16 bf16, to nearest even (dtypes.h's f32_to_bf16, NaN kept quiet), and back
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)),
                                                _mm512_set1_epi32(0x7F800000));
  r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}
inline __m512 from_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

inline __mmask16 first(int64_t n) {   // lanes [0, n) of 16
  return n <= 0 ? __mmask16(0) : n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

struct Scratch {
  Aligned qc, kc, vc, dc, kt, p0, p1, p2, p3, p4, acc, dqt, blk;
};
thread_local Scratch g_s;

template <bool kTiles>
void fwd(const uint16_t* qkv, uint16_t* o, float* lse, int64_t B, int64_t T, int64_t H, int64_t D, double scale) {
  const int64_t row = 3 * H * D, so = H * D, Tp = round_up(T, 32), NQ = Tp / 32, KD = D / 32;
  const float sc = static_cast<float>(scale);
  parallel_for(B * H, 1, 1, [&](int64_t h0, int64_t h1) {
    if (kTiles) configure_tiles();
    Scratch& S = g_s;
    uint16_t* qc = S.qc.get<uint16_t>(Tp * D);
    uint16_t* kp = S.p0.get<uint16_t>(packed_b_elems(D, Tp));   // (d, key): B of S = Q K^T
    uint16_t* vp = S.p1.get<uint16_t>(packed_b_elems(Tp, D));   // (key, d): B of O += P V
    float* s = S.blk.get<float>(32 * 32);
    uint16_t* pb = S.kt.get<uint16_t>(32 * 32);
    float* oa = S.acc.get<float>(32 * D + 64);
    float* m = oa + 32 * D;
    float* l = m + 32;
    for (int64_t bh = h0; bh < h1; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const uint16_t* q = qkv + b * T * row + h * D;
      copy_rows(q, row, T, Tp, D, qc);
      pack_b(q + H * D, 1, row, D, T, kp);
      pack_b(q + 2 * H * D, row, 1, T, D, vp);
      for (int64_t i = 0; i < NQ; ++i) {
        std::fill(m, m + 32, -INFINITY);
        std::fill(l, l + 32, 0.0f);
        std::fill(oa, oa + 32 * D, 0.0f);
        for (int64_t j = 0; j <= i; ++j) {                 // causal: key blocks up to the diagonal
          mm32<kTiles>(qc + i * 32 * D, D, kp + j * KD * kBlk, KD, s, 32, false);
          const __m512 vsc = _mm512_set1_ps(sc), ninf = _mm512_set1_ps(-INFINITY);
          for (int64_t r = 0; r < 32; ++r) {
            const float* sr = s + r * 32;
            const int64_t lim = std::min<int64_t>(j == i ? r + 1 : 32, T - j * 32);   // keys this row sees
            const __mmask16 k0 = first(lim), k1 = first(lim - 16);
            const __m512 x0 = _mm512_mask_mul_ps(ninf, k0, _mm512_loadu_ps(sr), vsc);
            const __m512 x1 = _mm512_mask_mul_ps(ninf, k1, _mm512_loadu_ps(sr + 16), vsc);
            const float mx = std::max(m[r], _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
            const float alpha = m[r] == -INFINITY ? 0.0f : exp_approx(m[r] - mx);
            const __m512 vm = _mm512_set1_ps(mx);
            const __m256i p0 = to_bf16(_mm512_maskz_mov_ps(k0, exp16(_mm512_sub_ps(x0, vm))));
            const __m256i p1 = to_bf16(_mm512_maskz_mov_ps(k1, exp16(_mm512_sub_ps(x1, vm))));
            _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * 32), p0);
            _mm256_store_si256(reinterpret_cast<__m256i*>(pb + r * 32 + 16), p1);
            // l sums what O sums: the rounded P
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(_mm512_add_ps(from_bf16(p0), from_bf16(p1)));
            m[r] = mx;
            if (alpha != 1.0f) {
              float* orow = oa + r * D;
              const __m512 va = _mm512_set1_ps(alpha);
              for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(orow + d, _mm512_mul_ps(_mm512_loadu_ps(orow + d), va));
            }
          }
          for (int64_t dp = 0; dp < KD; ++dp)              // O (32 x D) += P (32 x 32) V (32 x D)
            mm32<kTiles>(pb, 32, vp + (dp * NQ + j) * kBlk, 1, oa + dp * 32, D, true);
        }
        const int64_t rows = std::min<int64_t>(32, T - i * 32);
        float* lh = lse + bh * T + i * 32;
        for (int64_t r = 0; r < rows; ++r) {
          const float inv = 1.0f / l[r];
          uint16_t* orow = o + (b * T + i * 32 + r) * so + h * D;
          const float* src = oa + r * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) orow[d] = f32_to_bf16(src[d] * inv);
          lh[r] = m[r] + std::log(l[r]);
        }
      }
    }
    if (kTiles) _tile_release();
  });
}

template <bool kTiles>
void bwd(const uint16_t* qkv, const uint16_t* o, const float* lse, const uint16_t* dout, uint16_t* dqkv,
         int64_t B, int64_t T, int64_t H, int64_t D, double scale) {
  const int64_t row = 3 * H * D, so = H * D, Tp = round_up(T, 32), NQ = Tp / 32, KD = D / 32;
  const float sc = static_cast<float>(scale);
  parallel_for(B * H, 1, 1, [&](int64_t h0, int64_t h1) {
    if (kTiles) configure_tiles();
    Scratch& S = g_s;
    uint16_t *qc = S.qc.get<uint16_t>(Tp * D), *kc = S.kc.get<uint16_t>(Tp * D), *vc = S.vc.get<uint16_t>(Tp * D),
             *dc = S.dc.get<uint16_t>(Tp * D), *kt = S.kt.get<uint16_t>(D * Tp);
    uint16_t* qT = S.p0.get<uint16_t>(packed_b_elems(D, Tp));   // (d, query): B of St = K Q^T
    uint16_t* dT = S.p1.get<uint16_t>(packed_b_elems(D, Tp));   // (d, query): B of dPt = V dO^T
    uint16_t* dP = S.p2.get<uint16_t>(packed_b_elems(Tp, D));   // (query, d): B of dV += P^T dO
    uint16_t* qP = S.p3.get<uint16_t>(packed_b_elems(Tp, D));   // (query, d): B of dK += dS^T Q
    uint16_t* pbf = S.p4.get<uint16_t>(3 * 32 * 32);             // P^T, dS^T (keys x queries), dS^T as VNNI
    uint16_t *ptb = pbf, *dsb = pbf + 1024, *dsv = pbf + 2048;
    float* blk = S.blk.get<float>(2 * 32 * 32);
    float *st = blk, *dpt = blk + 32 * 32;                        // St, dPt (keys x queries)
    float* acc = S.acc.get<float>(2 * 32 * D + 2 * Tp);
    float *dka = acc, *dva = acc + 32 * D;                        // dK, dV of the key block
    float *dvec = dva + 32 * D, *lpad = dvec + Tp;                // Dv and lse over Tp (0 past T)
    float* dqt = S.dqt.get<float>(D * Tp);                        // dQ^T (D, Tp)
    for (int64_t bh = h0; bh < h1; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      const uint16_t* q = qkv + b * T * row + h * D;
      const uint16_t* oh = o + b * T * so + h * D;
      const uint16_t* doh = dout + b * T * so + h * D;
      const float* lh = lse + bh * T;
      copy_rows(q, row, T, Tp, D, qc);                 // every read of this head's q, k, v happens here
      copy_rows(q + H * D, row, T, Tp, D, kc);
      copy_rows(q + 2 * H * D, row, T, Tp, D, vc);
      copy_rows(doh, so, T, Tp, D, dc);
      for (int64_t d = 0; d < D; ++d)                  // K^T (D, Tp): A of dQ^T += K^T dS^T
        for (int64_t t = 0; t < Tp; ++t) kt[d * Tp + t] = kc[t * D + d];
      pack_b(qc, 1, D, D, Tp, qT);
      pack_b(dc, 1, D, D, Tp, dT);
      pack_b(dc, D, 1, Tp, D, dP);
      pack_b(qc, D, 1, Tp, D, qP);
      for (int64_t t = 0; t < Tp; ++t) {               // Dv = rowsum(dO o), the softmax backward's term
        float sum = 0.0f;
        if (t < T) {
          const uint16_t *dr = doh + t * so, *orow = oh + t * so;
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < D; ++d) sum += bf16_to_f32(dr[d]) * bf16_to_f32(orow[d]);
        }
        dvec[t] = sum;
        lpad[t] = t < T ? lh[t] : 0.0f;
      }
      std::fill(dqt, dqt + D * Tp, 0.0f);
      for (int64_t j = 0; j < NQ; ++j) {                   // key blocks
        std::fill(acc, acc + 2 * 32 * D, 0.0f);
        for (int64_t i = j; i < NQ; ++i) {                 // causal: the query blocks that see them
          mm32<kTiles>(kc + j * 32 * D, D, qT + i * KD * kBlk, KD, st, 32, false);    // St (keys x queries)
          mm32<kTiles>(vc + j * 32 * D, D, dT + i * KD * kBlk, KD, dpt, 32, false);   // dPt
          const float *lq = lpad + i * 32, *dq = dvec + i * 32;
          const __m512 vsc = _mm512_set1_ps(sc), l0 = _mm512_loadu_ps(lq), l1 = _mm512_loadu_ps(lq + 16);
          const __m512 d0 = _mm512_loadu_ps(dq), d1 = _mm512_loadu_ps(dq + 16);
          for (int64_t c = 0; c < 32; ++c) {               // key j*32 + c sees queries >= key, < T
            const int64_t key = j * 32 + c, from = key - i * 32;
            const int64_t upto = key < T ? T - i * 32 : 0;   // queries [max(from, 0), upto) of the block
            const __mmask16 k0 = first(std::min<int64_t>(upto, 16)) & ~first(from);
            const __mmask16 k1 = first(upto - 16) & ~first(from - 16);
            const float *sr = st + c * 32, *dr = dpt + c * 32;
            const __m512 p0f = _mm512_maskz_mov_ps(k0, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(sr), vsc, l0)));
            const __m512 p1f = _mm512_maskz_mov_ps(k1, exp16(_mm512_fmsub_ps(_mm512_loadu_ps(sr + 16), vsc, l1)));
            _mm256_store_si256(reinterpret_cast<__m256i*>(ptb + c * 32), to_bf16(p0f));
            _mm256_store_si256(reinterpret_cast<__m256i*>(ptb + c * 32 + 16), to_bf16(p1f));
            const __m512 s0 = _mm512_mul_ps(p0f, _mm512_sub_ps(_mm512_loadu_ps(dr), d0));
            const __m512 s1 = _mm512_mul_ps(p1f, _mm512_sub_ps(_mm512_loadu_ps(dr + 16), d1));
            _mm256_store_si256(reinterpret_cast<__m256i*>(dsb + c * 32), to_bf16(s0));
            _mm256_store_si256(reinterpret_cast<__m256i*>(dsb + c * 32 + 16), to_bf16(s1));
          }
          for (int64_t dp = 0; dp < KD; ++dp) {
            mm32<kTiles>(ptb, 32, dP + (dp * NQ + i) * kBlk, 1, dva + dp * 32, D, true);   // dV += P^T dO
            mm32<kTiles>(dsb, 32, qP + (dp * NQ + i) * kBlk, 1, dka + dp * 32, D, true);   // dK += dS^T Q
          }
          vnni32(dsb, dsv);                                // dS^T (keys x queries) as B
          for (int64_t dm = 0; dm < KD; ++dm)              // dQ^T (D x queries) += K^T dS^T
            mm32<kTiles>(kt + dm * 32 * Tp + j * 32, Tp, dsv, 1, dqt + dm * 32 * Tp + i * 32, Tp, true);
        }
        const int64_t rows = std::min<int64_t>(32, T - j * 32);
        for (int64_t c = 0; c < rows; ++c) {
          uint16_t* dkr = dqkv + (b * T + j * 32 + c) * row + H * D + h * D;
          uint16_t* dvr = dkr + H * D;
          const float *ka = dka + c * D, *va = dva + c * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) {
            dkr[d] = f32_to_bf16(ka[d] * sc);
            dvr[d] = f32_to_bf16(va[d]);
          }
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        uint16_t* dqr = dqkv + (b * T + t) * row + h * D;
        for (int64_t d = 0; d < D; ++d) dqr[d] = f32_to_bf16(dqt[d * Tp + t] * sc);
      }
    }
    if (kTiles) _tile_release();
  });
}

}  // namespace

void attention_fwd(const uint16_t* qkv, uint16_t* o, float* lse, int64_t B, int64_t T, int64_t H, int64_t D,
                   double scale, Engine engine) {
  if (engine == Engine::Tiles)
    fwd<true>(qkv, o, lse, B, T, H, D, scale);
  else
    fwd<false>(qkv, o, lse, B, T, H, D, scale);
}

void attention_bwd(const uint16_t* qkv, const uint16_t* o, const float* lse, const uint16_t* dout, uint16_t* dqkv,
                   int64_t B, int64_t T, int64_t H, int64_t D, double scale, Engine engine) {
  if (engine == Engine::Tiles)
    bwd<true>(qkv, o, lse, dout, dqkv, B, T, H, D, scale);
  else
    bwd<false>(qkv, o, lse, dout, dqkv, B, T, H, D, scale);
}

}  // namespace amx
}  // namespace pympar
