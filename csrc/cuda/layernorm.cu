// LayerNorm forward/backward: one block per row; dw/db by fixed row chunks into a float32
// scratch, then a column sum in chunk order (deterministic, no atomics).
#include "common.cuh"
#include "kernels_cuda.h"

namespace pympar_cuda {

constexpr int64_t kRowsPerChunk = 64;

template <typename T>
__global__ void layernorm_fwd_k(const T* x, const T* w, const T* b, T* y, float* mean, float* rstd, int64_t C,
                                float eps) {
  __shared__ float scratch[32];
  int64_t r = blockIdx.x;
  const T* xr = x + r * C;
  T* yr = y + r * C;
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) s += to_f(xr[j]);
  float mu = block_reduce<false>(s, scratch) / C;
  float ss = 0.f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    float d = to_f(xr[j]) - mu;
    ss += d * d;
  }
  float rs = rsqrtf(block_reduce<false>(ss, scratch) / C + eps);
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x)
    yr[j] = from_f<T>((to_f(xr[j]) - mu) * rs * to_f(w[j]) + to_f(b[j]));
  if (threadIdx.x == 0) {
    mean[r] = mu;
    rstd[r] = rs;
  }
}

template <typename T>
__global__ void layernorm_bwd_dx_k(const T* dy, const T* x, const T* w, const float* mean, const float* rstd, T* dx,
                                   int64_t C) {
  __shared__ float scratch[32];
  int64_t r = blockIdx.x;
  const T *xr = x + r * C, *dyr = dy + r * C;
  const float mu = mean[r], rs = rstd[r];
  float a = 0.f, bsum = 0.f;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    float dxhat = to_f(dyr[j]) * to_f(w[j]);
    a += dxhat;
    bsum += dxhat * (to_f(xr[j]) - mu) * rs;
  }
  a = block_reduce<false>(a, scratch) / C;
  bsum = block_reduce<false>(bsum, scratch) / C;
  for (int64_t j = threadIdx.x; j < C; j += blockDim.x) {
    float xhat = (to_f(xr[j]) - mu) * rs;
    dx[r * C + j] = from_f<T>(rs * (to_f(dyr[j]) * to_f(w[j]) - a - xhat * bsum));
  }
}

// grid (column blocks, chunks): partial[chunk][0|1][c] over the chunk's rows
template <typename T>
__global__ void layernorm_bwd_partial_k(const T* dy, const T* x, const float* mean, const float* rstd, float* part,
                                        int64_t N, int64_t C) {
  int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  int64_t chunk = blockIdx.y, r0 = chunk * kRowsPerChunk, r1 = min(N, r0 + kRowsPerChunk);
  float dw = 0.f, db = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    float g = to_f(dy[r * C + c]);
    dw += g * (to_f(x[r * C + c]) - mean[r]) * rstd[r];
    db += g;
  }
  part[(chunk * 2) * C + c] = dw;
  part[(chunk * 2 + 1) * C + c] = db;
}

__global__ void layernorm_bwd_sum_k(const float* part, float* dw, float* db, int64_t chunks, int64_t C) {
  int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (c >= C) return;
  float a = 0.f, b = 0.f;
  for (int64_t k = 0; k < chunks; ++k) {
    a += part[(k * 2) * C + c];
    b += part[(k * 2 + 1) * C + c];
  }
  dw[c] = a;
  db[c] = b;
}

static int row_threads(int64_t n) { return n >= 512 ? 256 : n >= 128 ? 128 : 32; }

void layernorm_fwd(ptr x, ptr w, ptr b, ptr y, ptr mean, ptr rstd, int dt, int64_t N, int64_t C, double eps,
                   ptr stream) {
  if (N == 0) return;
  PYMPAR_DISPATCH_FLOAT(dt, "layernorm_forward",
    layernorm_fwd_k<T><<<N, row_threads(C), 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(w), reinterpret_cast<const T*>(b),
        reinterpret_cast<T*>(y), reinterpret_cast<float*>(mean), reinterpret_cast<float*>(rstd), C, float(eps)));
  check_launch("layernorm_forward");
}

int64_t layernorm_bwd_scratch(int64_t N, int64_t C) {
  return ((N + kRowsPerChunk - 1) / kRowsPerChunk) * 2 * C;
}

void layernorm_bwd(ptr dy, ptr x, ptr w, ptr mean, ptr rstd, ptr dx, ptr dw, ptr db, ptr scratch, int dt, int64_t N,
                   int64_t C, ptr stream) {
  cudaStream_t s = as_stream(stream);
  int64_t chunks = (N + kRowsPerChunk - 1) / kRowsPerChunk;
  unsigned cblocks = static_cast<unsigned>((C + 127) / 128);
  if (N > 0) {
    PYMPAR_DISPATCH_FLOAT(dt, "layernorm_backward",
      layernorm_bwd_dx_k<T><<<N, row_threads(C), 0, s>>>(
          reinterpret_cast<const T*>(dy), reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(w),
          reinterpret_cast<const float*>(mean), reinterpret_cast<const float*>(rstd), reinterpret_cast<T*>(dx), C);
      layernorm_bwd_partial_k<T><<<dim3(cblocks, static_cast<unsigned>(chunks)), 128, 0, s>>>(
          reinterpret_cast<const T*>(dy), reinterpret_cast<const T*>(x), reinterpret_cast<const float*>(mean),
          reinterpret_cast<const float*>(rstd), reinterpret_cast<float*>(scratch), N, C));
  }
  if (C > 0)
    layernorm_bwd_sum_k<<<cblocks, 128, 0, s>>>(reinterpret_cast<const float*>(scratch), reinterpret_cast<float*>(dw),
                                                reinterpret_cast<float*>(db), chunks, C);
  check_launch("layernorm_backward");
}

}  // namespace pympar_cuda
