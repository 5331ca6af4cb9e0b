// Shared device helpers of the CUDA kernels: dtype codes, float32 load/store for
// float32/float16/bfloat16 storage, warp and block reductions, launch checks.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

namespace pympar_cuda {

enum DType : int { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5 };

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// every thread of the block gets the result; `scratch` holds 32 floats in shared memory
template <bool MAX>
__device__ float block_reduce(float v, float* scratch) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = MAX ? warp_max(v) : warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : (MAX ? -INFINITY : 0.0f);
  return MAX ? warp_max(v) : warp_sum(v);
}

inline void check_launch(const char* what) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": CUDA launch failed: " + cudaGetErrorString(e));
}

inline cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }
inline unsigned blocks_for(int64_t n, int threads) {
  int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(b < 65535 * 32 ? (b > 0 ? b : 1) : 65535 * 32);
}

// call f.template operator()<T>() with T the storage type of a float32/float16/bfloat16 code
#define PYMPAR_DISPATCH_FLOAT(dt, what, ...)                                              \
  switch (dt) {                                                                           \
    case pympar_cuda::F32: { using T = float; __VA_ARGS__; break; }                       \
    case pympar_cuda::F16: { using T = __half; __VA_ARGS__; break; }                      \
    case pympar_cuda::BF16: { using T = __nv_bfloat16; __VA_ARGS__; break; }              \
    default: throw std::invalid_argument(std::string(what) + ": dtype must be float32, float16 or bfloat16"); \
  }

}  // namespace pympar_cuda
