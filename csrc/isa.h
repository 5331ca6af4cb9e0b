// Internal to the per-instruction-set compilation units: the namespace each build of the
// arithmetic kernels lives in (PYMPAR_ISA is set by CMake: generic, avx2 or avx512), and the
// work-splitting sizes they share.
#pragma once
#include <cstdint>

#ifndef PYMPAR_ISA
#define PYMPAR_ISA generic
#endif

namespace pympar {
constexpr int64_t kElemGrain = 1 << 16;  // elements below which a kernel runs on one thread
constexpr int64_t kAlign = 64;           // chunk boundaries: whole cache lines, whole vectors

static inline int64_t row_grain(int64_t row_len) {
  return row_len >= kElemGrain ? 1 : kElemGrain / (row_len > 0 ? row_len : 1);
}
}  // namespace pympar
