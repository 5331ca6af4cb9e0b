// Shared by the AMX kernels (amx.cpp, amx_attention.cpp), compiled with the AMX flags only.
#pragma once
#include <immintrin.h>

#include <cstdint>
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

}  // namespace amx
}  // namespace pympar
