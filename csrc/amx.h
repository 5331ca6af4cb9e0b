// bf16 GEMM on AMX tiles or on AVX512-BF16 dot products (amx.cpp): the interface the bindings call.
// The tile engine only where available() is true, the dot-product one only where dp_available() is.
#pragma once
#include <cstdint>

namespace pympar {
namespace amx {

// where a product's C goes: float32 (= or +=) or bf16 (round(C + bias), and round(GELU) into g)
struct Out {
  enum Mode { F32, BF16 } mode = F32;
  void* c = nullptr;         // (M, N) with row stride ldc (elements)
  int64_t ldc = 0;
  bool accumulate = false;   // F32 only: C += A B
  const float* bias = nullptr;  // BF16 only, nullable: (N,)
  uint16_t* g = nullptr;     // BF16 only, nullable: (M, N) GELU of the rounded C, row stride ldg
  int64_t ldg = 0;
};

bool available();                                    // AMX-BF16 on this CPU and the tile state granted
bool dp_available();                                 // AVX512-BF16 (and AVX512-BW) on this CPU
enum class Engine { Tiles, DotProducts };            // TDPBF16PS on tiles, or VDPBF16PS on zmm registers
// the engine of a binding's `tiles` flag, checked: std::invalid_argument naming `what` where it cannot run here
Engine engine_for(bool tiles, const char* what);
int64_t packed_b_elems(int64_t K, int64_t N);        // bf16 elements of B's pack
// B (K, N), element (k, n) at src[k sk + n sn] -> dst (packed_b_elems(K, N)); one pack serves both engines
void pack_b(const uint16_t* src, int64_t sk, int64_t sn, int64_t K, int64_t N, uint16_t* dst);
// C (M, N) = A (M, K) B: A's element (m, k) at a[m sam + k sak]; B packed (b_packed) or at b[k sbk + n sbn]
void gemm(const uint16_t* a, int64_t sam, int64_t sak, const uint16_t* b, int64_t sbk, int64_t sbn, bool b_packed,
          int64_t M, int64_t N, int64_t K, const Out& out, Engine engine);

// causal attention on packed bf16 qkv (B, T, 3, H, D), D % 32 == 0 (amx_attention.cpp): o (B, T, H D)
// bf16 and lse (B, H, T) float32; backward: dout (B, T, H D) -> dqkv like qkv (may be qkv itself)
void attention_fwd(const uint16_t* qkv, uint16_t* o, float* lse, int64_t B, int64_t T, int64_t H, int64_t D,
                   double scale, Engine engine);
void attention_bwd(const uint16_t* qkv, const uint16_t* o, const float* lse, const uint16_t* dout, uint16_t* dqkv,
                   int64_t B, int64_t T, int64_t H, int64_t D, double scale, Engine engine);

}  // namespace amx
}  // namespace pympar
