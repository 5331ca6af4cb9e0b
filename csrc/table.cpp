// The kernel table of one ISA build (see kernels.h).
#include "isa.h"
#include "kernels.h"

namespace pympar {
namespace PYMPAR_ISA {
template <typename T> void softmax_causal_fwd(const T*, T*, int64_t, int64_t);
template <typename T> void softmax_causal_bwd(const T*, const T*, T*, int64_t, int64_t);
template <typename T> void layernorm_fwd(const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, double);
template <typename T>
void layernorm_bwd(const T*, const T*, const T*, const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t);
template <typename T>
void add_layernorm_fwd(T*, const T*, const T*, const T*, T*, T*, T*, int64_t, int64_t, double);
template <typename T> void bias_gelu_fwd(T*, const T*, T*, int64_t, int64_t);
template <typename T> void bias_add(T*, const T*, int64_t, int64_t);
template <typename T> void column_sum(const T*, T*, int64_t, int64_t);
template <typename T> void gelu_fwd(const T*, T*, int64_t);
template <typename T> void gelu_bwd(const T*, const T*, T*, int64_t);
template <typename T> void ce_fwd(const T*, const int64_t*, T*, T*, int64_t, int64_t);
template <typename T> void ce_bwd(const T*, const T*, const int64_t*, const T*, int64_t, T*, int64_t, int64_t);
template <typename T>
void attention_block_fwd(const T*, RowStrides, const T*, RowStrides, const T*, RowStrides, T*, T*, int64_t, int64_t,
                         int64_t, int64_t, int64_t, bool, double);
template <typename T>
void attention_block_bwd(const T*, RowStrides, const T*, RowStrides, const T*, RowStrides, const T*, RowStrides,
                         const T*, const T*, RowStrides, T*, RowStrides, T*, RowStrides, T*, RowStrides, int64_t,
                         int64_t, int64_t, int64_t, int64_t, bool, double);
void adamw(void*, const void*, void*, void*, int, int, int, int64_t, double, double, double, double, double, double,
           double);
void reduce(void*, const void*, int, int, int64_t);
void scale(void*, int, double, int64_t);
void cast(const void*, int, void*, int, int64_t);
void layernorm_fwd_bf16(const uint16_t*, const float*, const float*, uint16_t*, float*, float*, int64_t, int64_t,
                        double);
void add_layernorm_fwd_bf16(uint16_t*, const uint16_t*, const float*, const float*, uint16_t*, float*, float*, int64_t,
                            int64_t, double);
void layernorm_bwd_bf16(const uint16_t*, const uint16_t*, const float*, const float*, const float*, const uint16_t*,
                        uint16_t*, float*, float*, int64_t, int64_t);
void gelu_fwd_bf16(const uint16_t*, uint16_t*, int64_t);
void gelu_bwd_bf16(const uint16_t*, const uint16_t*, uint16_t*, int64_t);
void bias_gelu_fwd_bf16(uint16_t*, const float*, uint16_t*, int64_t, int64_t);
void bias_add_bf16(uint16_t*, const float*, int64_t, int64_t);
void column_sum_bf16(const uint16_t*, float*, int64_t, int64_t);
void gemm_epilogue_bf16(const float*, int64_t, const float*, uint16_t*, int64_t, uint16_t*, int64_t, int64_t, int64_t);
}  // namespace PYMPAR_ISA

#define PYMPAR_STR2(x) #x
#define PYMPAR_STR(x) PYMPAR_STR2(x)
#define PYMPAR_CAT2(a, b) a##b
#define PYMPAR_CAT(a, b) PYMPAR_CAT2(a, b)

const KernelTable* PYMPAR_CAT(table_, PYMPAR_ISA)() {
  namespace K = PYMPAR_ISA;
  static const KernelTable t = {
      PYMPAR_STR(PYMPAR_ISA),
      K::softmax_causal_fwd<float>, K::softmax_causal_fwd<double>,
      K::softmax_causal_bwd<float>, K::softmax_causal_bwd<double>,
      K::layernorm_fwd<float>, K::layernorm_fwd<double>,
      K::layernorm_bwd<float>, K::layernorm_bwd<double>,
      K::gelu_fwd<float>, K::gelu_fwd<double>,
      K::gelu_bwd<float>, K::gelu_bwd<double>,
      K::ce_fwd<float>, K::ce_fwd<double>,
      K::ce_bwd<float>, K::ce_bwd<double>,
      K::attention_block_fwd<float>, K::attention_block_fwd<double>,
      K::attention_block_bwd<float>, K::attention_block_bwd<double>,
      K::adamw, K::reduce, K::scale, K::cast,
      K::add_layernorm_fwd<float>, K::add_layernorm_fwd<double>,
      K::bias_gelu_fwd<float>, K::bias_gelu_fwd<double>,
      K::bias_add<float>, K::bias_add<double>,
      K::column_sum<float>, K::column_sum<double>,
      K::layernorm_fwd_bf16, K::add_layernorm_fwd_bf16, K::layernorm_bwd_bf16,
      K::gelu_fwd_bf16, K::gelu_bwd_bf16, K::bias_gelu_fwd_bf16, K::bias_add_bf16, K::column_sum_bf16,
      K::gemm_epilogue_bf16,
  };
  return &t;
}
}  // namespace pympar
