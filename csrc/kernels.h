// The C++ kernels: C-style functions on raw pointers and sizes. Every kernel has a pure-xp
// twin in pympar/kernels/reference.py that defines it; the shapes below use its names.
//
// The arithmetic kernels are compiled once per instruction set (generic x86-64/other, AVX2+FMA,
// AVX-512) from the same source, and one table is picked at import time by what the CPU
// supports (runtime-portable: the wheel carries no -march=native code).
#pragma once
#include <cstdint>

namespace pympar {

// a (B, T, H, D) operand read in place: element (b, t, h, d) at [b * batch + t * row + h * D + d]
// (strides in elements; the head axis has stride D and the last axis is contiguous)
struct RowStrides {
  int64_t batch, row;
};

struct KernelTable {
  const char* isa;
  // x, y (B, T, T); row i of each matrix sees columns <= i
  void (*softmax_causal_fwd_f32)(const float* x, float* y, int64_t B, int64_t T);
  void (*softmax_causal_fwd_f64)(const double* x, double* y, int64_t B, int64_t T);
  void (*softmax_causal_bwd_f32)(const float* y, const float* dy, float* dx, int64_t B, int64_t T);
  void (*softmax_causal_bwd_f64)(const double* y, const double* dy, double* dx, int64_t B, int64_t T);
  // x, y (N, C); w, b (C,); mean, rstd (N,)
  void (*layernorm_fwd_f32)(const float* x, const float* w, const float* b, float* y, float* mean,
                            float* rstd, int64_t N, int64_t C, double eps);
  void (*layernorm_fwd_f64)(const double* x, const double* w, const double* b, double* y, double* mean,
                            double* rstd, int64_t N, int64_t C, double eps);
  // dx (N, C) = [res (N, C; nullable) +]; dw, db (C,) = (not accumulated)
  void (*layernorm_bwd_f32)(const float* dy, const float* x, const float* w, const float* mean,
                            const float* rstd, const float* res, float* dx, float* dw, float* db, int64_t N,
                            int64_t C);
  void (*layernorm_bwd_f64)(const double* dy, const double* x, const double* w, const double* mean,
                            const double* rstd, const double* res, double* dx, double* dw, double* db, int64_t N,
                            int64_t C);
  void (*gelu_fwd_f32)(const float* x, float* y, int64_t n);
  void (*gelu_fwd_f64)(const double* x, double* y, int64_t n);
  void (*gelu_bwd_f32)(const float* x, const float* dy, float* dx, int64_t n);
  void (*gelu_bwd_f64)(const double* x, const double* dy, double* dx, int64_t n);
  // logits (N, V), targets (N,) (< 0: ignored) -> loss, lse (N,)
  void (*ce_fwd_f32)(const float* logits, const int64_t* targets, float* loss, float* lse, int64_t N, int64_t V);
  void (*ce_fwd_f64)(const double* logits, const int64_t* targets, double* loss, double* lse, int64_t N, int64_t V);
  // dlogits (N, V); dloss (N,) with stride 1, or one scalar with stride 0
  void (*ce_bwd_f32)(const float* logits, const float* lse, const int64_t* targets, const float* dloss,
                     int64_t dloss_stride, float* dlogits, int64_t N, int64_t V);
  void (*ce_bwd_f64)(const double* logits, const double* lse, const int64_t* targets, const double* dloss,
                     int64_t dloss_stride, double* dlogits, int64_t N, int64_t V);
  // attention of one block, tile by tile (attention.cpp): q (B, Tq, H, D), k, v (B, Tk, H, D), each read
  // through its RowStrides -> o (B, Tq, H*D), lse (B, H, Tq); causal requires Tq == Tk (query t sees keys
  // <= t), otherwise every query sees every key; q is scaled by `scale`. Backward: o, lse those of the
  // complete softmax of these rows (over every key block), dout (B, Tq, H*D), both through their RowStrides
  // (rows of H*D with head stride D) -> dq (B, Tq, H, D), dk, dv (B, Tk, H, D) through their RowStrides
  // (=, every element written). Packed qkv (B, T, 3, H, D)
  // is the causal block of the views qkv[:, :, 0], [:, :, 1], [:, :, 2].
  void (*attention_block_fwd_f32)(const float* q, RowStrides qs, const float* k, RowStrides ks, const float* v,
                                  RowStrides vs, float* o, float* lse, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                                  int64_t D, bool causal, double scale);
  void (*attention_block_fwd_f64)(const double* q, RowStrides qs, const double* k, RowStrides ks, const double* v,
                                  RowStrides vs, double* o, double* lse, int64_t B, int64_t Tq, int64_t Tk, int64_t H,
                                  int64_t D, bool causal, double scale);
  void (*attention_block_bwd_f32)(const float* q, RowStrides qs, const float* k, RowStrides ks, const float* v,
                                  RowStrides vs, const float* o, RowStrides os, const float* lse, const float* dout,
                                  RowStrides dos, float* dq, RowStrides dqs, float* dk, RowStrides dks, float* dv,
                                  RowStrides dvs, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t D, bool causal,
                                  double scale);
  void (*attention_block_bwd_f64)(const double* q, RowStrides qs, const double* k, RowStrides ks, const double* v,
                                  RowStrides vs, const double* o, RowStrides os, const double* lse, const double* dout,
                                  RowStrides dos, double* dq, RowStrides dqs, double* dk, RowStrides dks, double* dv,
                                  RowStrides dvs, int64_t B, int64_t Tq, int64_t Tk, int64_t H, int64_t D, bool causal,
                                  double scale);
  // in place on p (n,) of dtype pdt (F32 or F64), m, v of dtype mdt (pdt, or BF16 with F32 p:
  // moments stored rounded once, the update computed from the unrounded ones); g of dtype gdt (any float)
  void (*adamw)(void* p, const void* g, void* m, void* v, int pdt, int gdt, int mdt, int64_t n, double lr,
                double beta1, double beta2, double eps, double weight_decay, double bc1, double bc2);
  // dst = op(dst, src), op 0 sum, 1 max, 2 min, 3 prod; dtype any DType
  void (*reduce)(void* dst, const void* src, int dt, int op, int64_t n);
  void (*scale)(void* x, int dt, double alpha, int64_t n);
  // dst[i] = src[i] converted; dtypes any float DType
  void (*cast)(const void* src, int sdt, void* dst, int ddt, int64_t n);
  // x (N, C) += res, then layernorm_fwd of it (y, mean, rstd as there)
  void (*add_layernorm_fwd_f32)(float* x, const float* res, const float* w, const float* b, float* y, float* mean,
                                float* rstd, int64_t N, int64_t C, double eps);
  void (*add_layernorm_fwd_f64)(double* x, const double* res, const double* w, const double* b, double* y,
                                double* mean, double* rstd, int64_t N, int64_t C, double eps);
  // h (N, F) += b (F,), y (N, F) = GELU(h)
  void (*bias_gelu_fwd_f32)(float* h, const float* b, float* y, int64_t N, int64_t F);
  void (*bias_gelu_fwd_f64)(double* h, const double* b, double* y, int64_t N, int64_t F);
  // y (N, F) += b (F,)
  void (*bias_add_f32)(float* y, const float* b, int64_t N, int64_t F);
  void (*bias_add_f64)(double* y, const double* b, int64_t N, int64_t F);
  // out (F,) = sum over the N rows of x (N, F), in row order
  void (*column_sum_f32)(const float* x, float* out, int64_t N, int64_t F);
  void (*column_sum_f64)(const double* x, double* out, int64_t N, int64_t F);
  // bfloat16 activations (lowp.cpp): uint16 storage, float32 math, each output rounded once to
  // nearest even; parameters, statistics and parameter gradients float32. Shapes as above.
  void (*layernorm_fwd_bf16)(const uint16_t* x, const float* w, const float* b, uint16_t* y, float* mean,
                             float* rstd, int64_t N, int64_t C, double eps);
  void (*add_layernorm_fwd_bf16)(uint16_t* x, const uint16_t* res, const float* w, const float* b, uint16_t* y,
                                 float* mean, float* rstd, int64_t N, int64_t C, double eps);
  void (*layernorm_bwd_bf16)(const uint16_t* dy, const uint16_t* x, const float* w, const float* mean,
                             const float* rstd, const uint16_t* res, uint16_t* dx, float* dw, float* db, int64_t N,
                             int64_t C);
  void (*gelu_fwd_bf16)(const uint16_t* x, uint16_t* y, int64_t n);
  void (*gelu_bwd_bf16)(const uint16_t* x, const uint16_t* dy, uint16_t* dx, int64_t n);
  void (*bias_gelu_fwd_bf16)(uint16_t* h, const float* b, uint16_t* y, int64_t N, int64_t F);
  void (*bias_add_bf16)(uint16_t* y, const float* b, int64_t N, int64_t F);
  void (*column_sum_bf16)(const uint16_t* x, float* out, int64_t N, int64_t F);
  // one tile of the bf16 GEMM's output: c (R, N) float32 -> h = round(c + bias), g = round(GELU(h))
  // (bias, g nullable); one thread
  void (*gemm_epilogue_bf16)(const float* c, int64_t ldc, const float* bias, uint16_t* h, int64_t ldh, uint16_t* g,
                             int64_t ldg, int64_t R, int64_t N);
};

const KernelTable* table_generic();
#if defined(PYMPAR_X86)
const KernelTable* table_avx2();
const KernelTable* table_avx512();
#endif

// MoE routing (integer and memory bound; one build for all CPUs), in moe.cpp
void topk(const void* scores, int dt, int64_t N, int64_t E, int64_t k, int64_t* idx, void* vals);
void capacity_positions(const int64_t* expert, int64_t A, int64_t n_expert, int64_t capacity,
                        int64_t* pos, int64_t* counts);
// out (M, row_bytes) = x[rows]; rows already bounds-checked and non-negative
void permute_rows(const char* x, const int64_t* rows, char* out, int64_t M, int64_t row_bytes);
// out (n_rows, C) += w[i] * y[i] scattered to rows[i], in the order of i; dtype F32 or F64
void unpermute_add(const void* y, const int64_t* rows, const void* w, void* out, int dt, int64_t M, int64_t C,
                   int64_t n_rows);

}  // namespace pympar
