// Fused softmax + cross-entropy forward/backward: one block per row of the (N, V) logits.
#include "common.cuh"
#include "kernels_cuda.h"

namespace pympar_cuda {

template <typename T>
__global__ void ce_fwd_k(const T* logits, const int64_t* targets, float* loss, float* lse, int64_t V) {
  __shared__ float scratch[32];
  int64_t r = blockIdx.x;
  const T* lr = logits + r * V;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, to_f(lr[j]));
  m = block_reduce<true>(m, scratch);
  float s = 0.f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) s += expf(to_f(lr[j]) - m);
  s = block_reduce<false>(s, scratch);
  if (threadIdx.x == 0) {
    float l = m + logf(s);
    int64_t t = targets[r];
    lse[r] = l;
    // a target >= V cannot be raised from the device: it poisons the row's loss with NaN
    loss[r] = t >= V ? NAN : t >= 0 ? l - to_f(lr[t]) : 0.f;
  }
}

template <typename T>
__global__ void ce_bwd_k(const T* logits, const float* lse, const int64_t* targets, const float* dloss,
                         int64_t dloss_stride, T* dlogits, int64_t V) {
  int64_t r = blockIdx.x;
  const T* lr = logits + r * V;
  T* dr = dlogits + r * V;
  int64_t t = targets[r];
  float l = lse[r], d = t >= V ? NAN : t >= 0 ? dloss[r * dloss_stride] : 0.f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x)
    dr[j] = from_f<T>((expf(to_f(lr[j]) - l) - (j == t ? 1.f : 0.f)) * d);
}

void ce_fwd(ptr logits, ptr targets, ptr loss, ptr lse, int dt, int64_t N, int64_t V, ptr stream) {
  if (N == 0) return;
  PYMPAR_DISPATCH_FLOAT(dt, "cross_entropy_forward",
    ce_fwd_k<T><<<N, 256, 0, as_stream(stream)>>>(reinterpret_cast<const T*>(logits),
        reinterpret_cast<const int64_t*>(targets), reinterpret_cast<float*>(loss), reinterpret_cast<float*>(lse), V));
  check_launch("cross_entropy_forward");
}

void ce_bwd(ptr logits, ptr lse, ptr targets, ptr dloss, int64_t dloss_stride, ptr dlogits, int dt, int64_t N,
            int64_t V, ptr stream) {
  if (N == 0) return;
  PYMPAR_DISPATCH_FLOAT(dt, "cross_entropy_backward",
    ce_bwd_k<T><<<N, 256, 0, as_stream(stream)>>>(reinterpret_cast<const T*>(logits),
        reinterpret_cast<const float*>(lse), reinterpret_cast<const int64_t*>(targets),
        reinterpret_cast<const float*>(dloss), dloss_stride, reinterpret_cast<T*>(dlogits), V));
  check_launch("cross_entropy_backward");
}

}  // namespace pympar_cuda
