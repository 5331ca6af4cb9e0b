// Shared by the AMX kernels (amx.cpp, amx_attention.cpp), compiled with the AMX flags only.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace pympar {
namespace amx {

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// every tile 16 rows x 64 bytes (0-3: C, 4-5: A, 6-7: B by convention); per thread, before its tiles
static inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Tile loads and stores must start on 64-byte lines: a tile row that straddles two lines costs about
// twice (measured: an L1-resident 2x2 micro-kernel at 0.2-0.4 of its rate with rows 16 bytes off).
// So every buffer the tiles touch is 64-byte aligned: these scratch buffers, and B's packs (their
// callers, kernels/gemm.py, align them).
struct Aligned {                          // grow-only, 64-byte aligned scratch
  std::vector<char> raw;
  template <typename T>
  T* get(int64_t n) {
    const size_t need = static_cast<size_t>(n) * sizeof(T) + 64;
    if (raw.size() < need) raw.resize(need);
    uintptr_t p = reinterpret_cast<uintptr_t>(raw.data());
    return reinterpret_cast<T*>((p + 63) & ~uintptr_t(63));
  }
};

// The AVX512-BF16 micro-kernel of both kernels (amx.cpp's products, amx_attention.cpp's blocks): C's
// first `rows` rows (at most 32) of 32 columns = [from +] A B over `ksteps` k-steps of 32. A: row r at
// a + r lda, k-step s at + s astep (32 consecutive k); B: k-step s at b + 1024 s, two 16 x 64-byte
// VNNI tiles (row p of tile j = the pairs (B[2p][n], B[2p+1][n]) of columns 16 j .. 16 j + 15). C rows
// in groups of 8 x 32 (16 zmm accumulators), each k pair one broadcast of A's pair and VDPBF16PS
// against B's two rows: within each element the pairs are added in k order. from == nullptr: from
// zero; from may be to. Rows beyond `rows` (to the group of 8) hold padding, and the rest none.
static inline void dp_rows(const uint16_t* a, int64_t lda, int64_t astep, const uint16_t* b, int64_t ksteps,
                           const float* from, float* to, int64_t ldc, int64_t rows) {
  const int groups = static_cast<int>(std::min<int64_t>(4, (rows + 7) / 8));
  for (int g = 0; g < groups; ++g) {
    __m512 x[8][2];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      x[r][0] = from ? _mm512_loadu_ps(from + (8 * g + r) * ldc) : _mm512_setzero_ps();
      x[r][1] = from ? _mm512_loadu_ps(from + (8 * g + r) * ldc + 16) : _mm512_setzero_ps();
    }
    for (int64_t ks = 0; ks < ksteps; ++ks) {
      const uint16_t* ar = a + 8 * g * lda + ks * astep;
      const uint16_t* bt = b + ks * 1024;
      for (int p = 0; p < 16; ++p) {
        const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bt + p * 32);
        const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bt + 512 + p * 32);
#pragma GCC unroll 8
        for (int r = 0; r < 8; ++r) {
          int32_t pair;
          std::memcpy(&pair, ar + r * lda + 2 * p, 4);
          const __m512bh av = (__m512bh)_mm512_set1_epi32(pair);
          x[r][0] = _mm512_dpbf16_ps(x[r][0], av, b0);
          x[r][1] = _mm512_dpbf16_ps(x[r][1], av, b1);
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      _mm512_storeu_ps(to + (8 * g + r) * ldc, x[r][0]);
      _mm512_storeu_ps(to + (8 * g + r) * ldc + 16, x[r][1]);
    }
  }
}

}  // namespace amx
}  // namespace pympar
