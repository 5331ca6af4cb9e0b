// The top-k selection step shared by the C++ (moe.cpp) and CUDA (cuda/moe.cu) kernels: keep the
// k best of a row seen so far, sorted; larger first, ties keep the lower index, NaN last (the
// order of the reference's stable argsort of -scores).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define PYMPAR_HD __host__ __device__
#else
#define PYMPAR_HD
#endif

namespace pympar {

template <typename T>
PYMPAR_HD inline bool ranks_before(T a, T b) {
  return a > b || (b != b && a == a);
}

// v, ix (k,): the kept values and their column indices, `have` of them valid; offer column j
template <typename T>
PYMPAR_HD inline void topk_offer(T* v, int64_t* ix, int64_t& have, int64_t k, T x, int64_t j) {
  if (have == k && !ranks_before(x, v[k - 1])) return;
  int64_t p = have < k ? have : k - 1;
  while (p > 0 && ranks_before(x, v[p - 1])) {
    v[p] = v[p - 1];
    ix[p] = ix[p - 1];
    --p;
  }
  v[p] = x;
  ix[p] = j;
  if (have < k) ++have;
}

}  // namespace pympar
