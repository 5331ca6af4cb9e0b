// Elementwise reductions, scaling and dtype casts (the communicators' hot loops), one build per
// ISA. float16/bfloat16 are stored as uint16 and computed in float32, rounded to nearest even.
#include <cstring>
#include <type_traits>

#include "dtypes.h"
#include "isa.h"
#include "kernels.h"
#include "threadpool.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pympar {
namespace PYMPAR_ISA {

// NaN-propagating like np.maximum / np.minimum
template <typename T> inline T vmax(T a, T b) { return (a > b || a != a) ? a : b; }
template <typename T> inline T vmin(T a, T b) { return (a < b || a != a) ? a : b; }

template <int OP, typename T>
inline T apply(T a, T b) {
  if constexpr (std::is_integral<T>::value) {  // two's complement wrap-around, as NumPy does
    using U = typename std::make_unsigned<T>::type;
    if constexpr (OP == 0) return T(U(a) + U(b));
    if constexpr (OP == 3) return T(U(a) * U(b));
  } else {
    if constexpr (OP == 0) return a + b;
    if constexpr (OP == 3) return a * b;
  }
  if constexpr (OP == 1) return vmax(a, b);
  return vmin(a, b);
}

template <int OP, typename T>
static void reduce_t(T* dst, const T* src, int64_t n) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) dst[i] = apply<OP>(dst[i], src[i]);
  });
}

template <int OP>
static void reduce_bf16(uint16_t* dst, const uint16_t* src, int64_t n) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i)
      dst[i] = f32_to_bf16(apply<OP>(bf16_to_f32(dst[i]), bf16_to_f32(src[i])));
  });
}

template <int OP>
static void reduce_f16(uint16_t* dst, const uint16_t* src, int64_t n) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
#if defined(__F16C__)
    for (; i + 8 <= i1; i += 8) {
      __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dst + i)));
      __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      __m256 r;
      if constexpr (OP == 0) r = _mm256_add_ps(a, b);
      else if constexpr (OP == 3) r = _mm256_mul_ps(a, b);
      else {
        float fa[8], fb[8];
        _mm256_storeu_ps(fa, a);
        _mm256_storeu_ps(fb, b);
        for (int k = 0; k < 8; ++k) fa[k] = apply<OP>(fa[k], fb[k]);
        r = _mm256_loadu_ps(fa);
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
    }
#endif
    for (; i < i1; ++i) dst[i] = f32_to_f16(apply<OP>(f16_to_f32(dst[i]), f16_to_f32(src[i])));
  });
}

template <int OP>
static void reduce_op(void* dst, const void* src, int dt, int64_t n) {
  switch (dt) {
    case F32: return reduce_t<OP>(static_cast<float*>(dst), static_cast<const float*>(src), n);
    case F64: return reduce_t<OP>(static_cast<double*>(dst), static_cast<const double*>(src), n);
    case I32: return reduce_t<OP>(static_cast<int32_t*>(dst), static_cast<const int32_t*>(src), n);
    case I64: return reduce_t<OP>(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n);
    case F16: return reduce_f16<OP>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n);
    case BF16: return reduce_bf16<OP>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(src), n);
  }
}

void reduce(void* dst, const void* src, int dt, int op, int64_t n) {
  switch (op) {
    case 0: return reduce_op<0>(dst, src, dt, n);
    case 1: return reduce_op<1>(dst, src, dt, n);
    case 2: return reduce_op<2>(dst, src, dt, n);
    case 3: return reduce_op<3>(dst, src, dt, n);
  }
}

// --- x *= alpha, alpha first rounded to x's dtype (as np.asarray(alpha).astype(dtype)) ----
template <typename T>
static void scale_t(T* x, T a, int64_t n) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) x[i] = apply<3>(x[i], a);
  });
}

template <bool BF>
static void scale_half(uint16_t* x, double alpha, int64_t n) {
  float a = BF ? bf16_to_f32(f32_to_bf16(float(alpha))) : f16_to_f32(f32_to_f16(float(alpha)));
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i)
      x[i] = BF ? f32_to_bf16(bf16_to_f32(x[i]) * a) : f32_to_f16(f16_to_f32(x[i]) * a);
  });
}

void scale(void* x, int dt, double alpha, int64_t n) {
  switch (dt) {
    case F32: return scale_t(static_cast<float*>(x), float(alpha), n);
    case F64: return scale_t(static_cast<double*>(x), alpha, n);
    case I32: return scale_t(static_cast<int32_t*>(x), int32_t(alpha), n);
    case I64: return scale_t(static_cast<int64_t*>(x), int64_t(alpha), n);
    case F16: return scale_half<false>(static_cast<uint16_t*>(x), alpha, n);
    case BF16: return scale_half<true>(static_cast<uint16_t*>(x), alpha, n);
  }
}

// --- casts between float32/float64/float16/bfloat16 -------------------------------------
// Every path rounds once: float16/bfloat16 -> float32 is exact, so X -> float32 -> Y rounds
// only at the end. (float64 -> float16/bfloat16 would round twice: not offered here.)
template <typename S, typename D, typename F>
static void convert(const S* s, D* d, int64_t n, F f) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
#pragma omp simd
    for (int64_t i = i0; i < i1; ++i) d[i] = f(s[i]);
  });
}

static void f32_to_f16_array(const float* s, uint16_t* d, int64_t n) {
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
#if defined(__F16C__)
    for (; i + 8 <= i1; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < i1; ++i) d[i] = f32_to_f16(s[i]);
  });
}

void cast(const void* src, int sdt, void* dst, int ddt, int64_t n) {
  auto* u16 = static_cast<uint16_t*>(dst);
  auto* s16 = static_cast<const uint16_t*>(src);
  if (sdt == F32 && ddt == F16) return f32_to_f16_array(static_cast<const float*>(src), u16, n);
  if (sdt == F32 && ddt == BF16)
    return convert(static_cast<const float*>(src), u16, n, [](float v) { return f32_to_bf16(v); });
  if (sdt == F16 && ddt == F32)
    return convert(s16, static_cast<float*>(dst), n, [](uint16_t h) { return f16_to_f32(h); });
  if (sdt == BF16 && ddt == F32)
    return convert(s16, static_cast<float*>(dst), n, [](uint16_t h) { return bf16_to_f32(h); });
  if (sdt == F32 && ddt == F64)
    return convert(static_cast<const float*>(src), static_cast<double*>(dst), n, [](float v) { return double(v); });
  if (sdt == F64 && ddt == F32)
    return convert(static_cast<const double*>(src), static_cast<float*>(dst), n, [](double v) { return float(v); });
  if (sdt == BF16 && ddt == F64)
    return convert(s16, static_cast<double*>(dst), n, [](uint16_t h) { return double(bf16_to_f32(h)); });
  if (sdt == F16 && ddt == F64)
    return convert(s16, static_cast<double*>(dst), n, [](uint16_t h) { return double(f16_to_f32(h)); });
  if (sdt == F16 && ddt == BF16)
    return convert(s16, u16, n, [](uint16_t h) { return f32_to_bf16(f16_to_f32(h)); });
  if (sdt == BF16 && ddt == F16)
    return convert(s16, u16, n, [](uint16_t h) { return f32_to_f16(bf16_to_f32(h)); });
  // same dtype: a copy
  size_t item = (sdt == F64 || sdt == I64) ? 8 : (sdt == F32 || sdt == I32) ? 4 : 2;
  parallel_for(n, kElemGrain, kAlign, [&](int64_t i0, int64_t i1) {
    std::memcpy(static_cast<char*>(dst) + i0 * item, static_cast<const char*>(src) + i0 * item, (i1 - i0) * item);
  });
}

}  // namespace PYMPAR_ISA
}  // namespace pympar
