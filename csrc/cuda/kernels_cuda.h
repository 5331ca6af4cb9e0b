// Host entry points of the CUDA kernels (csrc/cuda/*.cu), called by bindings.cpp. Pointers are
// device pointers (CuPy's .data.ptr), `stream` a cudaStream_t as an integer (CuPy's current
// stream .ptr); `dt` a dtype code (0 f32, 1 f64, 2 f16, 3 bf16, 4 i32, 5 i64). Math is float32
// whatever the storage; statistics (mean, rstd, lse, loss) and dw/db are float32.
#pragma once
#include <cstdint>

namespace pympar_cuda {
using ptr = uintptr_t;

void softmax_causal_fwd(ptr x, ptr y, int dt, int64_t B, int64_t T, ptr stream);
void softmax_causal_bwd(ptr y, ptr dy, ptr dx, int dt, int64_t B, int64_t T, ptr stream);
// causal attention without the (T, T) matrix (attention.cu): qkv (B, T, 3, H, D) -> o (B, T, H*D),
// lse (B, H, T) float32; backward: dout -> dqkv (every element written), dvec a float32 (B, H, T)
// scratch; head size D <= 128
void attention_fwd(ptr qkv, ptr o, ptr lse, int dt, int64_t B, int64_t T, int64_t H, int64_t D, double scale,
                   ptr stream);
void attention_bwd(ptr qkv, ptr o, ptr lse, ptr dout, ptr dqkv, ptr dvec, int dt, int64_t B, int64_t T, int64_t H,
                   int64_t D, double scale, ptr stream);
// w, b of dtype dt; mean, rstd (N,) float32
void layernorm_fwd(ptr x, ptr w, ptr b, ptr y, ptr mean, ptr rstd, int dt, int64_t N, int64_t C, double eps,
                   ptr stream);
// dw, db (C,) float32; scratch: float32 (layernorm_bwd_scratch(N, C),)
int64_t layernorm_bwd_scratch(int64_t N, int64_t C);
void layernorm_bwd(ptr dy, ptr x, ptr w, ptr mean, ptr rstd, ptr dx, ptr dw, ptr db, ptr scratch, int dt, int64_t N,
                   int64_t C, ptr stream);
void gelu_fwd(ptr x, ptr y, int dt, int64_t n, ptr stream);
void gelu_bwd(ptr x, ptr dy, ptr dx, int dt, int64_t n, ptr stream);
// targets int64 (N,); loss, lse float32 (N,); dloss float32, (N,) or one value (stride 0)
void ce_fwd(ptr logits, ptr targets, ptr loss, ptr lse, int dt, int64_t N, int64_t V, ptr stream);
void ce_bwd(ptr logits, ptr lse, ptr targets, ptr dloss, int64_t dloss_stride, ptr dlogits, int dt, int64_t N,
            int64_t V, ptr stream);
// p, m, v float32 (n,); g of dtype gdt
void adamw(ptr p, ptr g, ptr m, ptr v, int gdt, int64_t n, double lr, double b1, double b2, double eps, double wd,
           double bc1, double bc2, ptr stream);
void cast(ptr src, int sdt, ptr dst, int ddt, int64_t n, ptr stream);
void reduce(ptr dst, ptr src, int dt, int op, int64_t n, ptr stream);
void scale(ptr x, int dt, double alpha, int64_t n, ptr stream);
// idx int64 (N, k), vals (N, k) of dtype dt; k <= 16
void topk(ptr scores, int dt, int64_t N, int64_t E, int64_t k, ptr idx, ptr vals, ptr stream);
// expert int64 (A,), pos int64 (A,), counts int64 (n_expert,); n_expert <= 256
void capacity_positions(ptr expert, int64_t A, int64_t n_expert, int64_t capacity, ptr pos, ptr counts, ptr stream);
void permute_rows(ptr x, ptr rows, ptr out, int64_t M, int64_t row_bytes, ptr stream);
// out (n_rows, C) = sum over i with rows[i] == r of w[i] * y[i], in the order of i; `order` the
// stable argsort of rows and `offsets` (n_rows + 1,) the segment starts, both int64
void unpermute_add(ptr y, ptr order, ptr offsets, ptr w, ptr out, int dt, int64_t n_rows, int64_t C, ptr stream);
// the device ordinal holding p (-1: host or unregistered memory), and the current device (boundary.cu)
int pointer_device(ptr p);
int current_device();
}  // namespace pympar_cuda
