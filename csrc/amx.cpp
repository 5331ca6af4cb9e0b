// bf16 GEMM on Intel AMX tiles (TDPBF16PS: C (16 x 16 float32) += A (16 x 32 bf16) B (32 x 16 bf16)),
// float32 accumulation, or on AVX512-BF16 dot products (VDPBF16PS: 16 float32 lanes, each += the two
// products of one bf16 pair) where the CPU has those and no AMX (AMD Zen 4 and later, Intel Cooper
// Lake): the same packs, blocking and epilogue, another micro-kernel (Engine). Compiled with -mamx-tile
// -mamx-bf16 -mavx512bf16 and the AVX-512 flags; called only where available() (AMX-BF16, and the
// kernel granted this process the tile state) or dp_available() (AVX512-BF16) said yes.
//
// Layout. B (K, N) is packed into VNNI panels of 32 columns: per panel and per block of 32 k, two
// 16 x 64-byte tiles whose row r holds the pairs (B[k][n], B[k+1][n]), k = 32 kb + 2 r, for 16
// columns n; K is padded with zeros to a multiple of 32 and N to a multiple of 32. A (M, K) is packed
// per 32-row panel and 32-k block into two 16 x 32 tiles (rows of A, 32 consecutive k). A weight is
// packed once per step (kernels/gemm.py keeps the pack); activations are packed in each call.
//
// The AMX micro-kernel holds a 32 x 32 block of C in four tiles (2 A tiles x 2 B tiles: four loads per
// four TDPBF16PS, the most the 8 tile registers allow) over the whole K, then stores it to a float32
// scratch (the AVX512-BF16 one, amx_tiles.h's dp_rows: the same block as groups of 8 rows x 32
// columns in 16 zmm accumulators, only those holding A's rows) from which the epilogue writes C: float32 (=, or += for a gradient), or bf16 rounded once
// to nearest even (+ a float32 bias, + GELU of the rounded value into a second output), with the same
// formulas (rows.h) and flags as the AVX-512 build of lowp.cpp, so the fused and separate paths give
// the same bits. The sum over K runs in k order within each tile's dot products; its order is not
// MKL's or NumPy's, so products agree with them to float32 rounding, not bit for bit.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "amx.h"
#include "amx_tiles.h"
#include "dtypes.h"
#include "rows.h"
#include "threadpool.h"

namespace pympar {
namespace amx {
namespace {

constexpr int64_t kTile = 512;      // bf16 elements in one 16 x 64-byte tile
// blocking of the k-loop (gemm): k-steps of 32 per k-block, A panels per block, accumulator bytes.
// Chosen by measurement (gpt2-124m's twelve layer products, interleaved runs, 1 thread): (8, 3)
// 679 GFLOP/s against 573 for one pass over K per C block, (4, 3) 611, (8, 2) 625, (16, 2) 628.
constexpr int64_t kKcb = 8, kMcp = 3, kAccBytes = 512 << 10;
constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;

// --- packing B ------------------------------------------------------------------------------
// one 32-k block of one 16-column tile: dst row r = pairs (B[k0 + 2r][n], B[k0 + 2r + 1][n]), n in
// [n0, n0 + 16); element (k, n) at src[k sk + n sn]; zeros outside (K, N)
void pack_b_tile(const uint16_t* src, int64_t sk, int64_t sn, int64_t K, int64_t N, int64_t k0, int64_t n0,
                 uint16_t* dst) {
  const bool full = k0 + 32 <= K && n0 + 16 <= N;
  if (full && sn == 1) {  // rows of B contiguous along n: interleave two rows at a time
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int r = 0; r < 16; ++r) {
      const uint16_t* r0 = src + (k0 + 2 * r) * sk + n0;
      __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0)));
      v = _mm512_inserti64x4(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + sk)), 1);
      _mm512_storeu_si512(dst + r * 32, _mm512_permutexvar_epi16(idx, v));
    }
    return;
  }
  if (full && sk == 1 && 16 * sn < (int64_t(1) << 30)) {  // k pairs contiguous (B = W^T, W row-major)
    // each column's pair (B[k][n], B[k+1][n]) is one (unaligned) dword: gathered, 16 columns at once
    const __m512i off = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int>(sn)));   // elements
    for (int r = 0; r < 16; ++r)
      _mm512_storeu_si512(dst + r * 32, _mm512_i32gather_epi32(off, src + (k0 + 2 * r) + n0 * sn, 2));
    return;
  }
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      for (int e = 0; e < 2; ++e) {
        const int64_t k = k0 + 2 * r + e, n = n0 + c;
        dst[r * 32 + 2 * c + e] = (k < K && n < N) ? src[k * sk + n * sn] : uint16_t(0);
      }
}

// --- packing A ------------------------------------------------------------------------------
// 16 x 16 transpose of 32-bit lanes held in 16 registers (in place)
void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// one tile of A: dst row r = A[m0 + r][k0 .. k0 + 32), element (m, k) at src[m sm + k sk]; zeros outside
void pack_a_tile(const uint16_t* src, int64_t sm, int64_t sk, int64_t M, int64_t K, int64_t m0, int64_t k0,
                 uint16_t* dst) {
  const bool full = m0 + 16 <= M && k0 + 32 <= K;
  if (full && sk == 1) {  // rows of A contiguous along k
    for (int r = 0; r < 16; ++r)
      _mm512_storeu_si512(dst + r * 32, _mm512_loadu_si512(src + (m0 + r) * sm + k0));
    return;
  }
  if (full && sm == 1) {  // A = D^T of a row-major D (a weight gradient's dY^T): k rows of D hold m
    // pairs of D's rows k0 + 2p, k0 + 2p + 1 interleaved give dwords (A[m][2p], A[m][2p+1]) along m;
    // a 32-bit transpose of the 16 x 16 such dwords gives the tile's rows
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512i r[16];
    for (int p = 0; p < 16; ++p) {
      const uint16_t* d0 = src + (k0 + 2 * p) * sk + m0;
      __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d0)));
      v = _mm512_inserti64x4(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d0 + sk)), 1);
      r[p] = _mm512_permutexvar_epi16(idx, v);
    }
    transpose16x16_epi32(r);
    for (int m = 0; m < 16; ++m) _mm512_storeu_si512(dst + m * 32, r[m]);
    return;
  }
  for (int r = 0; r < 16; ++r)
    for (int kk = 0; kk < 32; ++kk) {
      const int64_t m = m0 + r, k = k0 + kk;
      dst[r * 32 + kk] = (m < M && k < K) ? src[m * sm + k * sk] : uint16_t(0);
    }
}

// --- the epilogue of one 32 x 32 block ---------------------------------------------------------
void epilogue(const float* s, const Out& o, int64_t m0, int64_t n0, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* sr = s + r * 32;
    const int64_t m = m0 + r;
    if (o.mode == Out::F32) {
      float* c = static_cast<float*>(o.c) + m * o.ldc + n0;
      if (o.accumulate) {
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) c[j] += sr[j];
      } else {
        std::memcpy(c, sr, static_cast<size_t>(cols) * 4);
      }
      continue;
    }
    uint16_t* h = static_cast<uint16_t*>(o.c) + m * o.ldc + n0;
    const float* b = o.bias ? o.bias + n0 : nullptr;
    if (o.g == nullptr) {
      if (b) {
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) h[j] = f32_to_bf16(sr[j] + b[j]);
      } else {
#pragma omp simd
        for (int64_t j = 0; j < cols; ++j) h[j] = f32_to_bf16(sr[j]);
      }
      continue;
    }
    uint16_t* g = o.g + m * o.ldg + n0;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) {
      const uint16_t v = f32_to_bf16(b ? sr[j] + b[j] : sr[j]);
      h[j] = v;
      g[j] = f32_to_bf16(gelu_value(bf16_to_f32(v)));
    }
  }
}

thread_local Aligned g_apack, g_bpack;   // a caller's packs of A and (unpacked) B, reused
thread_local Aligned g_acc;              // a worker's parked accumulators

}  // namespace

bool available() {
  static const bool ok = [] {
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("amx-bf16") || !__builtin_cpu_supports("amx-tile") ||
        !__builtin_cpu_supports("avx512bw"))
      return false;
    // Linux hands out the 8 KiB tile state only to a process that asks (5.16+)
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

bool dp_available() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  }();
  return ok;
}

Engine engine_for(bool tiles, const char* what) {
  if (tiles ? !available() : !dp_available())
    throw std::invalid_argument(std::string(what) + (tiles ? ": AMX is not available here" : ": AVX512-BF16 is not available here"));
  return tiles ? Engine::Tiles : Engine::DotProducts;
}

int64_t packed_b_elems(int64_t K, int64_t N) { return round_up(std::max<int64_t>(K, 1), 32) * round_up(N, 32); }

void pack_b(const uint16_t* src, int64_t sk, int64_t sn, int64_t K, int64_t N, uint16_t* dst) {
  const int64_t KB = round_up(std::max<int64_t>(K, 1), 32) / 32, P = round_up(N, 32) / 32;
  parallel_for(P, 1, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int j = 0; j < 2; ++j)
          pack_b_tile(src, sk, sn, K, N, kb * 32, p * 32 + j * 16, dst + ((p * KB + kb) * 2 + j) * kTile);
  });
}

void gemm(const uint16_t* a, int64_t sam, int64_t sak, const uint16_t* b, int64_t sbk, int64_t sbn, bool b_packed,
          int64_t M, int64_t N, int64_t K, const Out& out, Engine engine) {
  if (M <= 0 || N <= 0) return;
  const bool tiles = engine == Engine::Tiles;
  const int64_t KB = round_up(std::max<int64_t>(K, 1), 32) / 32, MP = round_up(M, 32) / 32, P = round_up(N, 32) / 32;
  // A packed whole, 32-row panels side by side on the threads
  uint16_t* ap = g_apack.get<uint16_t>(MP * KB * 2 * kTile);
  parallel_for(MP, 1, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t mp = i0; mp < i1; ++mp)
      for (int64_t kb = 0; kb < KB; ++kb)
        for (int i = 0; i < 2; ++i)
          pack_a_tile(a, sam, sak, M, K, mp * 32 + i * 16, kb * 32, ap + ((mp * KB + kb) * 2 + i) * kTile);
  });
  const uint16_t* bp = b;
  if (!b_packed) {
    uint16_t* buf = g_bpack.get<uint16_t>(packed_b_elems(K, N));
    pack_b(b, sbk, sbn, K, N, buf);
    bp = buf;
  }
  // Blocking (four tile loads feed four TDPBF16PS, so the operands' cache level bounds the rate; a
  // micro-kernel streaming 192 KiB panels from L2 ran at about 0.35 of its L1-resident rate here):
  // per thread, its panels of B in groups of
  // nbp, A in blocks of mcp 32-row panels, K in blocks of kcb k-steps; for each k-block the A block's
  // k-slices (mcp x 2 KiB x kcb) and one panel's B k-slice (2 KiB x kcb) stay in L1 while the panel's
  // C blocks run, their accumulators parked in an L2-resident buffer between k-blocks (the same sum,
  // in the same k order: a float32 store and load is exact, so the bits are those of one pass).
  const int64_t kcb = std::min<int64_t>(KB, kKcb), mcp = kMcp;
  parallel_for(P, 1, 1, [&](int64_t p0, int64_t p1) {
    if (tiles) configure_tiles();
    alignas(64) float s[32 * 32];
    const int64_t nbp = std::max<int64_t>(1, kAccBytes / (mcp * 4096));
    float* acc = KB > kcb ? g_acc.get<float>(mcp * std::min(nbp, p1 - p0) * 1024) : nullptr;
    for (int64_t nb = p0; nb < p1; nb += nbp) {
      const int64_t ne = std::min(p1, nb + nbp);
      for (int64_t mb = 0; mb < MP; mb += mcp) {
        const int64_t me = std::min(MP, mb + mcp);
        for (int64_t kc = 0; kc < KB; kc += kcb) {
          const int64_t ke = std::min(KB, kc + kcb);
          const bool first = kc == 0, last = ke == KB;
          for (int64_t p = nb; p < ne; ++p) {
            const uint16_t* bpan = bp + p * KB * 2 * kTile;
            for (int64_t mp = mb; mp < me; ++mp) {
              const uint16_t* apan = ap + mp * KB * 2 * kTile;
              float* c = acc ? acc + ((mp - mb) * (ne - nb) + (p - nb)) * 1024 : nullptr;
              float* dst = last ? s : c;
              if (!tiles) {
                // A packed: a k-block's 32 rows lie at row stride 32 (its two tiles back to back)
                dp_rows(apan + kc * 2 * kTile, 32, 2 * kTile, bpan + kc * 2 * kTile, ke - kc, first ? nullptr : c,
                        dst, 32, M - mp * 32);
              } else {
                if (first) {
                  _tile_zero(0);
                  _tile_zero(1);
                  _tile_zero(2);
                  _tile_zero(3);
                } else {
                  _tile_loadd(0, c, 128);
                  _tile_loadd(1, c + 16, 128);
                  _tile_loadd(2, c + 16 * 32, 128);
                  _tile_loadd(3, c + 16 * 32 + 16, 128);
                }
                for (int64_t kb = kc; kb < ke; ++kb) {
                  const uint16_t* at = apan + kb * 2 * kTile;
                  const uint16_t* bt = bpan + kb * 2 * kTile;
                  _tile_loadd(4, at, 64);
                  _tile_loadd(6, bt, 64);
                  _tile_dpbf16ps(0, 4, 6);
                  _tile_loadd(7, bt + kTile, 64);
                  _tile_dpbf16ps(1, 4, 7);
                  _tile_loadd(5, at + kTile, 64);
                  _tile_dpbf16ps(2, 5, 6);
                  _tile_dpbf16ps(3, 5, 7);
                }
                _tile_stored(0, dst, 128);
                _tile_stored(1, dst + 16, 128);
                _tile_stored(2, dst + 16 * 32, 128);
                _tile_stored(3, dst + 16 * 32 + 16, 128);
              }
              if (last) {
                const int64_t m0 = mp * 32, n0 = p * 32;
                epilogue(s, out, m0, n0, std::min<int64_t>(32, M - m0), std::min<int64_t>(32, N - n0));
              }
            }
          }
        }
      }
    }
    if (tiles) _tile_release();
  });
}

}  // namespace amx
}  // namespace pympar
