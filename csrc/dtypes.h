// Dtype codes shared by the bindings and the kernels, and scalar float16/bfloat16 conversions
// (bit manipulation, round-to-nearest-even; written branch-light so loops over them vectorise).
#pragma once
#include <cstdint>
#include <cstring>

// static: each translation unit keeps its own copy, compiled with its own instruction-set flags
// (the arithmetic units are built once per ISA; an inline definition shared between them would be
// one function to the linker, and an -O0 or LTO build could pick the AVX-512 one on an AVX2 machine)
namespace pympar {

enum DType : int { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5 };

static inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

// bfloat16 is the top half of a float32.
static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
static inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;  // nearest, ties to even
  uint32_t nan = (u >> 16) | 0x40u;                             // keep NaN a (quiet) NaN
  bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? nan : rounded);
}

// IEEE half <-> float32, all cases (zero, subnormal, normal, inf, NaN).
static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t em = h & 0x7FFFu;
  // normal and subnormal: shift into place and rescale by 2^112 (float arithmetic handles subnormals)
  float mag = bits_f32(em << 13) * 5.192296858534828e+33f;  // 2^112
  uint32_t bits = f32_bits(mag);
  if (em >= 0x7C00u) bits = 0x7F800000u | (em & 0x3FFu) << 13;  // inf / NaN
  return bits_f32(sign | bits);
}

static inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7FFFFFFFu;
  uint32_t out;
  if (a > 0x7F800000u) {
    out = 0x7E00u | ((a >> 13) & 0x3FFu);  // NaN stays NaN
  } else if (a >= 0x477FF000u) {
    out = 0x7C00u;  // rounds to >= 65520: overflow to inf
  } else if (a < 0x38800000u) {
    // result is subnormal (or zero): add 0.5 so the float adder rounds to a multiple of 2^-24
    float r = bits_f32(a) + 0.5f;
    out = f32_bits(r) - 0x3F000000u;
  } else {
    uint32_t mant_odd = (a >> 13) & 1u;
    a += 0xC8000FFFu + mant_odd;  // rebias exponent (-112 << 23) and round to nearest even
    out = a >> 13;
  }
  return static_cast<uint16_t>(sign | out);
}

}  // namespace pympar
