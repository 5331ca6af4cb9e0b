// MoE routing on the GPU: top-k per row, capacity positions (order-preserving, one block),
// row gather, and the deterministic segmented scatter-add back to token order.
#include "common.cuh"
#include "kernels_cuda.h"
#include "topk_insert.h"

namespace pympar_cuda {

constexpr int kMaxK = 16;
constexpr int kMaxExperts = 256;

// one thread per row (topk_insert.h: larger first, ties keep the lower index, NaN last)
template <typename T>
__global__ void topk_k(const T* s, int64_t N, int64_t E, int k, int64_t* idx, T* vals) {
  int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (r >= N) return;
  float v[kMaxK];
  int64_t ix[kMaxK];
  int64_t have = 0;
  const T* row = s + r * E;
  for (int64_t j = 0; j < E; ++j) pympar::topk_offer(v, ix, have, int64_t(k), to_f(row[j]), j);
  for (int q = 0; q < k; ++q) {
    idx[r * k + q] = ix[q];
    vals[r * k + q] = row[ix[q]];
  }
}

void topk(ptr scores, int dt, int64_t N, int64_t E, int64_t k, ptr idx, ptr vals, ptr stream) {
  if (k < 1 || k > kMaxK || k > E) throw std::invalid_argument("topk: k must be in [1, min(16, E)] on the GPU");
  if (N == 0) return;
  PYMPAR_DISPATCH_FLOAT(dt, "topk",
    topk_k<T><<<blocks_for(N, 128), 128, 0, as_stream(stream)>>>(reinterpret_cast<const T*>(scores), N, E, int(k),
        reinterpret_cast<int64_t*>(idx), reinterpret_cast<T*>(vals)));
  check_launch("topk");
}

// One block of 1024 threads walks the assignments in tiles of 1024, in order. Inside a tile an
// assignment's slot = running count of its expert + same-expert assignments in earlier warps of
// the tile + same-expert lanes before it in its warp (__match_any_sync).
__global__ void capacity_positions_k(const int64_t* expert, int64_t A, int n_expert, int64_t capacity, int64_t* pos,
                                     int64_t* counts) {
  __shared__ int warp_count[32][kMaxExperts];
  __shared__ long long base[kMaxExperts];
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x) base[e] = 0;
  for (int64_t t0 = 0; t0 < A; t0 += blockDim.x) {
    for (int i = threadIdx.x; i < 32 * n_expert; i += blockDim.x) warp_count[i / n_expert][i % n_expert] = 0;
    __syncthreads();
    int64_t a = t0 + threadIdx.x;
    bool live = a < A;
    int e = live ? int(expert[a]) : -1;
    unsigned same = __match_any_sync(0xffffffffu, e);
    int rank = __popc(same & ((1u << lane) - 1u));
    if (live && rank == 0) warp_count[warp][e] = __popc(same);
    __syncthreads();
    if (live) {
      long long slot = base[e] + rank;
      for (int w = 0; w < warp; ++w) slot += warp_count[w][e];
      pos[a] = (capacity > 0 && slot >= capacity) ? -1 : slot;
    }
    __syncthreads();
    for (int x = threadIdx.x; x < n_expert; x += blockDim.x) {
      long long add = 0;
      for (int w = 0; w < 32; ++w) add += warp_count[w][x];
      base[x] += add;
    }
    __syncthreads();
  }
  for (int e = threadIdx.x; e < n_expert; e += blockDim.x) counts[e] = base[e];
}

void capacity_positions(ptr expert, int64_t A, int64_t n_expert, int64_t capacity, ptr pos, ptr counts, ptr stream) {
  if (n_expert < 1 || n_expert > kMaxExperts)
    throw std::invalid_argument("capacity_positions: n_expert must be in [1, 256] on the GPU");
  capacity_positions_k<<<1, 1024, 0, as_stream(stream)>>>(reinterpret_cast<const int64_t*>(expert), A, int(n_expert),
                                                          capacity, reinterpret_cast<int64_t*>(pos),
                                                          reinterpret_cast<int64_t*>(counts));
  check_launch("capacity_positions");
}

template <typename W>
__global__ void permute_k(const W* x, const int64_t* rows, W* out, int64_t M, int64_t row_words) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < M * row_words;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t m = i / row_words, c = i % row_words;
    out[i] = x[rows[m] * row_words + c];
  }
}

void permute_rows(ptr x, ptr rows, ptr out, int64_t M, int64_t row_bytes, ptr stream) {
  if (M == 0 || row_bytes == 0) return;
  cudaStream_t s = as_stream(stream);
  const int64_t* r = reinterpret_cast<const int64_t*>(rows);
  if (row_bytes % 4 == 0 && x % 4 == 0 && out % 4 == 0)
    permute_k<<<blocks_for(M * row_bytes / 4, 256), 256, 0, s>>>(reinterpret_cast<const uint32_t*>(x), r,
                                                                  reinterpret_cast<uint32_t*>(out), M, row_bytes / 4);
  else
    permute_k<<<blocks_for(M * row_bytes, 256), 256, 0, s>>>(reinterpret_cast<const uint8_t*>(x), r,
                                                              reinterpret_cast<uint8_t*>(out), M, row_bytes);
  check_launch("permute");
}

// grid over (output row, column): sums its segment of sources in order, float32 accumulation
template <typename T>
__global__ void unpermute_add_k(const T* y, const int64_t* order, const int64_t* offsets, const T* w, T* out,
                                int64_t n_rows, int64_t C) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n_rows * C;
       i += (int64_t)gridDim.x * blockDim.x) {
    int64_t r = i / C, c = i % C;
    float acc = 0.f;
    for (int64_t s = offsets[r]; s < offsets[r + 1]; ++s) {
      int64_t src = order[s];
      acc += (w ? to_f(w[src]) : 1.f) * to_f(y[src * C + c]);
    }
    out[i] = from_f<T>(acc);
  }
}

void unpermute_add(ptr y, ptr order, ptr offsets, ptr w, ptr out, int dt, int64_t n_rows, int64_t C, ptr stream) {
  if (n_rows * C == 0) return;
  PYMPAR_DISPATCH_FLOAT(dt, "unpermute_add",
    unpermute_add_k<T><<<blocks_for(n_rows * C, 256), 256, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(y), reinterpret_cast<const int64_t*>(order),
        reinterpret_cast<const int64_t*>(offsets), reinterpret_cast<const T*>(w), reinterpret_cast<T*>(out),
        n_rows, C));
  check_launch("unpermute_add");
}

}  // namespace pympar_cuda
