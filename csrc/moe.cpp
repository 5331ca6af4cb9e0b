// MoE routing helpers: top-k selection, capacity positions, row gather and weighted scatter-add.
// Integer and memory bound, so one build serves every CPU.
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dtypes.h"
#include "kernels.h"
#include "threadpool.h"
#include "topk_insert.h"

namespace pympar {

template <typename T>
static void topk_t(const T* s, int64_t N, int64_t E, int64_t k, int64_t* idx, T* vals) {
  parallel_for(N, 1 + (1 << 14) / (E > 0 ? E : 1), 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t have = 0;
      for (int64_t j = 0; j < E; ++j) topk_offer(vals + r * k, idx + r * k, have, k, s[r * E + j], j);
    }
  });
}

void topk(const void* scores, int dt, int64_t N, int64_t E, int64_t k, int64_t* idx, void* vals) {
  if (dt == F32) topk_t(static_cast<const float*>(scores), N, E, k, idx, static_cast<float*>(vals));
  else topk_t(static_cast<const double*>(scores), N, E, k, idx, static_cast<double*>(vals));
}

// One pass in priority order: the slot of an assignment is the number of earlier assignments to
// the same expert; beyond capacity it is dropped (-1). Sequential by nature (the order is the rule).
void capacity_positions(const int64_t* expert, int64_t A, int64_t n_expert, int64_t capacity, int64_t* pos,
                        int64_t* counts) {
  std::memset(counts, 0, sizeof(int64_t) * n_expert);
  for (int64_t a = 0; a < A; ++a) {
    int64_t e = expert[a];
    if (e < 0 || e >= n_expert)
      throw std::out_of_range("capacity_positions: expert index " + std::to_string(e) + " at position " +
                              std::to_string(a) + " is outside [0, " + std::to_string(n_expert) + ")");
    int64_t slot = counts[e]++;
    pos[a] = (capacity > 0 && slot >= capacity) ? -1 : slot;
  }
}

void permute_rows(const char* x, const int64_t* rows, char* out, int64_t M, int64_t row_bytes) {
  parallel_for(M, 1 + (1 << 18) / (row_bytes > 0 ? row_bytes : 1), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) std::memcpy(out + i * row_bytes, x + rows[i] * row_bytes, row_bytes);
  });
}

// Each thread owns a range of output rows and walks all M sources in order, so every output
// element receives its additions in the order of i (the reference's order) at any thread count:
// f(i, r) adds source row i into output row r.
template <typename F>
static void for_owned_rows(const int64_t* rows, int64_t M, int64_t C, int64_t n_rows, F f) {
  parallel_for(n_rows, 1 + (1 << 16) / (C > 0 ? C : 1), 1, [&](int64_t o0, int64_t o1) {
    for (int64_t i = 0; i < M; ++i) {
      const int64_t r = rows[i];
      if (r >= o0 && r < o1) f(i, r);
    }
  });
}

template <typename T>
static void unpermute_add_t(const T* y, const int64_t* rows, const T* w, T* out, int64_t M, int64_t C,
                            int64_t n_rows) {
  for_owned_rows(rows, M, C, n_rows, [&](int64_t i, int64_t r) {
    const T* yi = y + i * C;
    T* orow = out + r * C;
    if (w) {
      const T wi = w[i];
      for (int64_t j = 0; j < C; ++j) {
        T v = yi[j] * wi;  // rounded product first, as the reference forms y * w then adds
        orow[j] += v;
      }
    } else {
      for (int64_t j = 0; j < C; ++j) orow[j] += yi[j];
    }
  });
}

// bf16 rows: each product y w and each sum rounded to bf16, where the reference (np.add.at on bf16
// arrays, the weights cast to bf16) rounds
static void unpermute_add_bf16(const uint16_t* y, const int64_t* rows, const uint16_t* w, uint16_t* out, int64_t M,
                               int64_t C, int64_t n_rows) {
  for_owned_rows(rows, M, C, n_rows, [&](int64_t i, int64_t r) {
    const uint16_t* yi = y + i * C;
    uint16_t* orow = out + r * C;
    const float wi = w ? bf16_to_f32(w[i]) : 1.0f;
    for (int64_t j = 0; j < C; ++j) {
      const float v = w ? bf16_to_f32(f32_to_bf16(bf16_to_f32(yi[j]) * wi)) : bf16_to_f32(yi[j]);
      orow[j] = f32_to_bf16(bf16_to_f32(orow[j]) + v);
    }
  });
}

void unpermute_add(const void* y, const int64_t* rows, const void* w, void* out, int dt, int64_t M, int64_t C,
                   int64_t n_rows) {
  if (dt == BF16)
    unpermute_add_bf16(static_cast<const uint16_t*>(y), rows, static_cast<const uint16_t*>(w),
                       static_cast<uint16_t*>(out), M, C, n_rows);
  else if (dt == F32)
    unpermute_add_t(static_cast<const float*>(y), rows, static_cast<const float*>(w), static_cast<float*>(out), M,
                    C, n_rows);
  else
    unpermute_add_t(static_cast<const double*>(y), rows, static_cast<const double*>(w),
                    static_cast<double*>(out), M, C, n_rows);
}

}  // namespace pympar
