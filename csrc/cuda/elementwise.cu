// Elementwise kernels: GELU forward/backward, AdamW, casts, in-place reductions and scaling.
// Grid-stride loops; float16/bfloat16 are computed in float32 and rounded to nearest even.
#include "common.cuh"
#include "kernels_cuda.h"

namespace pympar_cuda {

#define GRID_STRIDE(i, n) \
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

constexpr float kGeluC = 0.7978845608028654f;

template <typename T>
__global__ void gelu_fwd_k(const T* x, T* y, int64_t n) {
  GRID_STRIDE(i, n) {
    float v = to_f(x[i]);
    y[i] = from_f<T>(0.5f * v * (1.f + tanhf(kGeluC * (v + 0.044715f * v * v * v))));
  }
}

template <typename T>
__global__ void gelu_bwd_k(const T* x, const T* dy, T* dx, int64_t n) {
  GRID_STRIDE(i, n) {
    float v = to_f(x[i]);
    float t = tanhf(kGeluC * (v + 0.044715f * v * v * v));
    float du = kGeluC * (1.f + 3.f * 0.044715f * v * v);
    dx[i] = from_f<T>((0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du) * to_f(dy[i]));
  }
}

void gelu_fwd(ptr x, ptr y, int dt, int64_t n, ptr stream) {
  if (n == 0) return;
  PYMPAR_DISPATCH_FLOAT(dt, "gelu_forward",
    gelu_fwd_k<T><<<blocks_for(n, 256), 256, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(x), reinterpret_cast<T*>(y), n));
  check_launch("gelu_forward");
}

void gelu_bwd(ptr x, ptr dy, ptr dx, int dt, int64_t n, ptr stream) {
  if (n == 0) return;
  PYMPAR_DISPATCH_FLOAT(dt, "gelu_backward",
    gelu_bwd_k<T><<<blocks_for(n, 256), 256, 0, as_stream(stream)>>>(
        reinterpret_cast<const T*>(x), reinterpret_cast<const T*>(dy), reinterpret_cast<T*>(dx), n));
  check_launch("gelu_backward");
}

// --- AdamW on float32 master weights ---------------------------------------------------
template <typename G>
__global__ void adamw_k(float* p, const G* g, float* m, float* v, int64_t n, float lr, float b1, float b2, float eps,
                        float decay, float bc1, float bc2) {
  GRID_STRIDE(i, n) {
    float gi = to_f(g[i]);
    float mi = m[i] * b1 + (1.f - b1) * gi;
    float vi = v[i] * b2 + (1.f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
  }
}

void adamw(ptr p, ptr g, ptr m, ptr v, int gdt, int64_t n, double lr, double b1, double b2, double eps, double wd,
           double bc1, double bc2, ptr stream) {
  if (n == 0) return;
  float decay = wd != 0 ? float(1 - lr * wd) : 1.f;
  PYMPAR_DISPATCH_FLOAT(gdt, "adamw_step (gradient)",
    adamw_k<T><<<blocks_for(n, 256), 256, 0, as_stream(stream)>>>(
        reinterpret_cast<float*>(p), reinterpret_cast<const T*>(g), reinterpret_cast<float*>(m),
        reinterpret_cast<float*>(v), n, float(lr), float(b1), float(b2), float(eps), decay, float(bc1), float(bc2)));
  check_launch("adamw_step");
}

// --- casts ------------------------------------------------------------------------------
template <typename S, typename D>
__global__ void cast_k(const S* s, D* d, int64_t n) {
  GRID_STRIDE(i, n) d[i] = from_f<D>(to_f(s[i]));
}

void cast(ptr src, int sdt, ptr dst, int ddt, int64_t n, ptr stream) {
  if (n == 0) return;
  cudaStream_t st = as_stream(stream);
  PYMPAR_DISPATCH_FLOAT(sdt, "cast (source)", {
    using S = T;
    PYMPAR_DISPATCH_FLOAT(ddt, "cast (destination)",
      cast_k<S, T><<<blocks_for(n, 256), 256, 0, st>>>(reinterpret_cast<const S*>(src), reinterpret_cast<T*>(dst), n));
  });
  check_launch("cast");
}

// --- in-place reductions and scaling ----------------------------------------------------
template <int OP, typename A>
__device__ __forceinline__ A apply(A a, A b) {
  if (OP == 0) return a + b;
  if (OP == 3) return a * b;
  if (OP == 1) return (a > b || a != a) ? a : b;  // NaN propagates, as np.maximum
  return (a < b || a != a) ? a : b;
}

template <int OP, typename T>
__global__ void reduce_k(T* d, const T* s, int64_t n) {
  GRID_STRIDE(i, n) d[i] = from_f<T>(apply<OP>(to_f(d[i]), to_f(s[i])));
}
template <int OP, typename T>
__global__ void reduce_native_k(T* d, const T* s, int64_t n) {  // float64 and integers in their own type
  GRID_STRIDE(i, n) d[i] = apply<OP>(d[i], s[i]);
}

template <int OP>
static void reduce_op(ptr dst, ptr src, int dt, int64_t n, cudaStream_t st) {
  unsigned g = blocks_for(n, 256);
  switch (dt) {
    case F64: reduce_native_k<OP><<<g, 256, 0, st>>>(reinterpret_cast<double*>(dst), reinterpret_cast<const double*>(src), n); break;
    case I32: reduce_native_k<OP><<<g, 256, 0, st>>>(reinterpret_cast<int32_t*>(dst), reinterpret_cast<const int32_t*>(src), n); break;
    case I64: reduce_native_k<OP><<<g, 256, 0, st>>>(reinterpret_cast<long long*>(dst), reinterpret_cast<const long long*>(src), n); break;
    default:
      PYMPAR_DISPATCH_FLOAT(dt, "reduce_inplace",
        reduce_k<OP, T><<<g, 256, 0, st>>>(reinterpret_cast<T*>(dst), reinterpret_cast<const T*>(src), n));
  }
}

void reduce(ptr dst, ptr src, int dt, int op, int64_t n, ptr stream) {
  if (n == 0) return;
  cudaStream_t st = as_stream(stream);
  switch (op) {
    case 0: reduce_op<0>(dst, src, dt, n, st); break;
    case 1: reduce_op<1>(dst, src, dt, n, st); break;
    case 2: reduce_op<2>(dst, src, dt, n, st); break;
    case 3: reduce_op<3>(dst, src, dt, n, st); break;
    default: throw std::invalid_argument("reduce_inplace: op code must be 0..3 (sum, max, min, prod)");
  }
  check_launch("reduce_inplace");
}

template <typename T>
__global__ void scale_k(T* x, float a, int64_t n) {
  GRID_STRIDE(i, n) x[i] = from_f<T>(to_f(x[i]) * a);
}
template <typename T>
__global__ void scale_native_k(T* x, T a, int64_t n) {
  GRID_STRIDE(i, n) x[i] = x[i] * a;
}

void scale(ptr x, int dt, double alpha, int64_t n, ptr stream) {
  if (n == 0) return;
  cudaStream_t st = as_stream(stream);
  unsigned g = blocks_for(n, 256);
  switch (dt) {
    case F64: scale_native_k<<<g, 256, 0, st>>>(reinterpret_cast<double*>(x), alpha, n); break;
    case I32: scale_native_k<<<g, 256, 0, st>>>(reinterpret_cast<int32_t*>(x), int32_t(alpha), n); break;
    case I64: scale_native_k<<<g, 256, 0, st>>>(reinterpret_cast<long long*>(x), (long long)(alpha), n); break;
    case F16: scale_k<<<g, 256, 0, st>>>(reinterpret_cast<__half*>(x), __half2float(__float2half_rn(float(alpha))), n); break;
    case BF16:
      scale_k<<<g, 256, 0, st>>>(reinterpret_cast<__nv_bfloat16*>(x),
                                 __bfloat162float(__float2bfloat16_rn(float(alpha))), n);
      break;
    default: scale_k<<<g, 256, 0, st>>>(reinterpret_cast<float*>(x), float(alpha), n);
  }
  check_launch("scale_inplace");
}

}  // namespace pympar_cuda
