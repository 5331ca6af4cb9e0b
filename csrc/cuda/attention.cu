// Causal attention without the (T, T) matrix, the twin of csrc/attention.cpp: the forward keeps
// the output and the row log-sum-exp (float32), the backward recomputes the probabilities.
// Storage float32/float16/bfloat16, math float32. One thread per query row (forward, dq) or key
// row (dk, dv), keys/queries staged through shared memory 32 rows at a time; the row's vectors
// live in per-thread arrays of the head size (at most 128). Simple rather than fast: the
// contract and the linear memory are the point (compiled in CI; run only where a GPU is lent).
#include "common.cuh"
#include "kernels_cuda.h"

namespace pympar_cuda {
namespace {

constexpr int kRows = 64;   // threads per block: rows of one (batch, head)
constexpr int kStage = 32;  // rows staged in shared memory at once

// qkv (B, T, 3, H, D): row t of part p (0 q, 1 k, 2 v) of head h
template <typename T>
__device__ __forceinline__ const T* row(const T* qkv, int64_t b, int64_t t, int p, int64_t h, int64_t T_, int64_t H,
                                        int64_t D) {
  return qkv + ((b * T_ + t) * 3 + p) * H * D + h * D;
}

// the block's threads load keys and values s0 .. s0 + kStage - 1 (zeros past T) into shared memory
template <typename T, int MAXD>
__device__ __forceinline__ void stage_kv(const T* qkv, int64_t b, int64_t h, int64_t s0, int64_t T_, int64_t H,
                                         int64_t D, float (*ks)[MAXD], float (*vs)[MAXD]) {
  for (int64_t i = threadIdx.x; i < kStage * D; i += blockDim.x) {
    int64_t c = i / D, d = i % D, s = s0 + c;
    ks[c][d] = s < T_ ? to_f(row(qkv, b, s, 1, h, T_, H, D)[d]) : 0.f;
    vs[c][d] = s < T_ ? to_f(row(qkv, b, s, 2, h, T_, H, D)[d]) : 0.f;
  }
}

template <typename T, int MAXD>
__global__ void attn_fwd_k(const T* qkv, T* o, float* lse, int64_t T_, int64_t H, int64_t D, float scale) {
  __shared__ float ks[kStage][MAXD], vs[kStage][MAXD];
  const int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
  const int64_t t = blockIdx.y * kRows + threadIdx.x;
  const bool live = t < T_;
  float q[MAXD], acc[MAXD];
  for (int d = 0; d < D; ++d) {
    q[d] = live ? to_f(row(qkv, b, t, 0, h, T_, H, D)[d]) * scale : 0.f;
    acc[d] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  const int64_t last = min(T_, (int64_t)(blockIdx.y + 1) * kRows);  // keys any row of this block sees
  for (int64_t s0 = 0; s0 < last; s0 += kStage) {
    __syncthreads();
    stage_kv(qkv, b, h, s0, T_, H, D, ks, vs);
    __syncthreads();
    if (!live) continue;
    for (int c = 0; c < kStage && s0 + c <= t; ++c) {
      float sc = 0.f;
      for (int d = 0; d < D; ++d) sc += q[d] * ks[c][d];
      float mn = fmaxf(m, sc);
      float a = m == -INFINITY ? 0.f : __expf(m - mn), p = __expf(sc - mn);
      l = l * a + p;
      for (int d = 0; d < D; ++d) acc[d] = acc[d] * a + p * vs[c][d];
      m = mn;
    }
  }
  if (!live) return;
  T* orow = o + (b * T_ + t) * H * D + h * D;
  for (int d = 0; d < D; ++d) orow[d] = from_f<T>(acc[d] / l);
  lse[bh * T_ + t] = m + logf(l);
}

// Dv[bh, t] = sum_d dout * o (the softmax backward's row term)
template <typename T>
__global__ void attn_rowdot_k(const T* o, const T* dout, float* dv, int64_t B, int64_t T_, int64_t H, int64_t D) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= B * H * T_) return;
  int64_t bh = i / T_, t = i % T_, b = bh / H, h = bh % H;
  const T *orow = o + (b * T_ + t) * H * D + h * D, *drow = dout + (b * T_ + t) * H * D + h * D;
  float s = 0.f;
  for (int d = 0; d < D; ++d) s += to_f(orow[d]) * to_f(drow[d]);
  dv[i] = s;
}

// one thread per key row: dk, dv over the queries that see it
template <typename T, int MAXD>
__global__ void attn_dkdv_k(const T* qkv, const T* dout, const float* lse, const float* dvec, T* dqkv, int64_t T_,
                            int64_t H, int64_t D, float scale) {
  __shared__ float qs[kStage][MAXD], dos[kStage][MAXD], ls[kStage], ds_[kStage];
  const int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
  const int64_t c = blockIdx.y * kRows + threadIdx.x;
  const bool live = c < T_;
  float k[MAXD], v[MAXD], dk[MAXD], dv[MAXD];
  for (int d = 0; d < D; ++d) {
    k[d] = live ? to_f(row(qkv, b, c, 1, h, T_, H, D)[d]) : 0.f;
    v[d] = live ? to_f(row(qkv, b, c, 2, h, T_, H, D)[d]) : 0.f;
    dk[d] = dv[d] = 0.f;
  }
  for (int64_t t0 = (int64_t)blockIdx.y * kRows; t0 < T_; t0 += kStage) {
    __syncthreads();
    for (int64_t i = threadIdx.x; i < kStage * D; i += blockDim.x) {
      int64_t r = i / D, d = i % D, t = t0 + r;
      qs[r][d] = t < T_ ? to_f(row(qkv, b, t, 0, h, T_, H, D)[d]) * scale : 0.f;
      dos[r][d] = t < T_ ? to_f(dout[(b * T_ + t) * H * D + h * D + d]) : 0.f;
    }
    for (int64_t r = threadIdx.x; r < kStage; r += blockDim.x) {
      ls[r] = t0 + r < T_ ? lse[bh * T_ + t0 + r] : 0.f;
      ds_[r] = t0 + r < T_ ? dvec[bh * T_ + t0 + r] : 0.f;
    }
    __syncthreads();
    if (!live) continue;
    for (int r = 0; r < kStage && t0 + r < T_; ++r) {
      if (t0 + r < c) continue;  // query t0 + r does not see key c
      float s = 0.f, dp = 0.f;
      for (int d = 0; d < D; ++d) {
        s += qs[r][d] * k[d];
        dp += dos[r][d] * v[d];
      }
      float p = __expf(s - ls[r]), dsc = p * (dp - ds_[r]);
      for (int d = 0; d < D; ++d) {
        dv[d] += p * dos[r][d];
        dk[d] += dsc * qs[r][d];
      }
    }
  }
  if (!live) return;
  T* dkr = dqkv + ((b * T_ + c) * 3 + 1) * H * D + h * D;
  T* dvr = dqkv + ((b * T_ + c) * 3 + 2) * H * D + h * D;
  for (int d = 0; d < D; ++d) {
    dkr[d] = from_f<T>(dk[d]);
    dvr[d] = from_f<T>(dv[d]);
  }
}

// one thread per query row: dq over the keys it sees
template <typename T, int MAXD>
__global__ void attn_dq_k(const T* qkv, const T* dout, const float* lse, const float* dvec, T* dqkv, int64_t T_,
                          int64_t H, int64_t D, float scale) {
  __shared__ float ks[kStage][MAXD], vs[kStage][MAXD];
  const int64_t bh = blockIdx.x, b = bh / H, h = bh % H;
  const int64_t t = blockIdx.y * kRows + threadIdx.x;
  const bool live = t < T_;
  float q[MAXD], dq[MAXD], dor[MAXD];
  for (int d = 0; d < D; ++d) {
    q[d] = live ? to_f(row(qkv, b, t, 0, h, T_, H, D)[d]) * scale : 0.f;
    dor[d] = live ? to_f(dout[(b * T_ + t) * H * D + h * D + d]) : 0.f;
    dq[d] = 0.f;
  }
  const float lt = live ? lse[bh * T_ + t] : 0.f, dt = live ? dvec[bh * T_ + t] : 0.f;
  const int64_t last = min(T_, (int64_t)(blockIdx.y + 1) * kRows);
  for (int64_t s0 = 0; s0 < last; s0 += kStage) {
    __syncthreads();
    stage_kv(qkv, b, h, s0, T_, H, D, ks, vs);
    __syncthreads();
    if (!live) continue;
    for (int c = 0; c < kStage && s0 + c <= t; ++c) {
      float s = 0.f, dp = 0.f;
      for (int d = 0; d < D; ++d) {
        s += q[d] * ks[c][d];
        dp += dor[d] * vs[c][d];
      }
      float p = __expf(s - lt), dsc = p * (dp - dt);
      for (int d = 0; d < D; ++d) dq[d] += dsc * ks[c][d];
    }
  }
  if (!live) return;
  T* dqr = dqkv + ((b * T_ + t) * 3 + 0) * H * D + h * D;
  for (int d = 0; d < D; ++d) dqr[d] = from_f<T>(dq[d] * scale);
}

}  // namespace

#define PYMPAR_ATTN_MAXD(D, KERNEL_LAUNCH)                  \
  if ((D) <= 64) { constexpr int MAXD = 64; KERNEL_LAUNCH; }  \
  else if ((D) <= 128) { constexpr int MAXD = 128; KERNEL_LAUNCH; } \
  else throw std::invalid_argument("attention: head size " + std::to_string(D) + " > 128 is not supported");

void attention_fwd(ptr qkv, ptr o, ptr lse, int dt, int64_t B, int64_t T_, int64_t H, int64_t D, double scale,
                   ptr stream) {
  if (B * T_ * H == 0) return;
  dim3 grid(static_cast<unsigned>(B * H), static_cast<unsigned>((T_ + kRows - 1) / kRows));
  PYMPAR_DISPATCH_FLOAT(dt, "attention_forward",
    PYMPAR_ATTN_MAXD(D, (attn_fwd_k<T, MAXD><<<grid, kRows, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(qkv), reinterpret_cast<T*>(o), reinterpret_cast<float*>(lse), T_, H, D,
        static_cast<float>(scale)))));
  check_launch("attention_forward");
}

void attention_bwd(ptr qkv, ptr o, ptr lse, ptr dout, ptr dqkv, ptr dvec, int dt, int64_t B, int64_t T_, int64_t H,
                   int64_t D, double scale, ptr stream) {
  if (B * T_ * H == 0) return;
  dim3 grid(static_cast<unsigned>(B * H), static_cast<unsigned>((T_ + kRows - 1) / kRows));
  cudaStream_t s = as_stream(stream);
  const float sc = static_cast<float>(scale);
  PYMPAR_DISPATCH_FLOAT(dt, "attention_backward", {
    attn_rowdot_k<T><<<blocks_for(B * H * T_, 256), 256, 0, s>>>(
        reinterpret_cast<const T*>(o), reinterpret_cast<const T*>(dout), reinterpret_cast<float*>(dvec), B, T_, H, D);
    PYMPAR_ATTN_MAXD(D, (attn_dkdv_k<T, MAXD><<<grid, kRows, 0, s>>>(
        reinterpret_cast<const T*>(qkv), reinterpret_cast<const T*>(dout), reinterpret_cast<const float*>(lse),
        reinterpret_cast<const float*>(dvec), reinterpret_cast<T*>(dqkv), T_, H, D, sc)));
    PYMPAR_ATTN_MAXD(D, (attn_dq_k<T, MAXD><<<grid, kRows, 0, s>>>(
        reinterpret_cast<const T*>(qkv), reinterpret_cast<const T*>(dout), reinterpret_cast<const float*>(lse),
        reinterpret_cast<const float*>(dvec), reinterpret_cast<T*>(dqkv), T_, H, D, sc)));
  });
  check_launch("attention_backward");
}

}  // namespace pympar_cuda
