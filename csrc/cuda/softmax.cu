// Causal softmax forward/backward: one block per row of the (B, T, T) scores.
#include "common.cuh"
#include "kernels_cuda.h"

namespace pympar_cuda {

template <typename T>
__global__ void softmax_causal_fwd_k(const T* x, T* y, int64_t T_) {
  __shared__ float scratch[32];
  int64_t r = blockIdx.x;
  const T* xr = x + r * T_;
  T* yr = y + r * T_;
  int64_t n = r % T_ + 1;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, to_f(xr[j]));
  m = block_reduce<true>(m, scratch);
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) s += __expf(to_f(xr[j]) - m);
  float inv = 1.f / block_reduce<false>(s, scratch);
  for (int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    yr[j] = from_f<T>(j < n ? __expf(to_f(xr[j]) - m) * inv : 0.f);
}

template <typename T>
__global__ void softmax_causal_bwd_k(const T* y, const T* dy, T* dx, int64_t T_) {
  __shared__ float scratch[32];
  int64_t r = blockIdx.x;
  const T *yr = y + r * T_, *dyr = dy + r * T_;
  T* dxr = dx + r * T_;
  int64_t n = r % T_ + 1;
  float dot = 0.f;
  for (int64_t j = threadIdx.x; j < n; j += blockDim.x) dot += to_f(dyr[j]) * to_f(yr[j]);
  dot = block_reduce<false>(dot, scratch);
  for (int64_t j = threadIdx.x; j < T_; j += blockDim.x)
    dxr[j] = from_f<T>(j < n ? to_f(yr[j]) * (to_f(dyr[j]) - dot) : 0.f);
}

static int row_threads(int64_t n) { return n >= 512 ? 256 : n >= 128 ? 128 : 32; }

void softmax_causal_fwd(ptr x, ptr y, int dt, int64_t B, int64_t T_, ptr stream) {
  if (B * T_ == 0) return;
  PYMPAR_DISPATCH_FLOAT(dt, "softmax_causal_forward",
    softmax_causal_fwd_k<T><<<B * T_, row_threads(T_), 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(x), reinterpret_cast<T*>(y), T_));
  check_launch("softmax_causal_forward");
}

void softmax_causal_bwd(ptr y, ptr dy, ptr dx, int dt, int64_t B, int64_t T_, ptr stream) {
  if (B * T_ == 0) return;
  PYMPAR_DISPATCH_FLOAT(dt, "softmax_causal_backward",
    softmax_causal_bwd_k<T><<<B * T_, row_threads(T_), 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(y), reinterpret_cast<const T*>(dy), reinterpret_cast<T*>(dx), T_));
  check_launch("softmax_causal_backward");
}

}  // namespace pympar_cuda
