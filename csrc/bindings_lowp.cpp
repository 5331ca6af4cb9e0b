// pympar._C's bfloat16 face: the elementwise kernels of lowp.cpp on bf16 activations (parameters
// and statistics float32) and the bf16 GEMM driver, which runs MKL's cblas_gemm_bf16bf16f32 (or its
// packed-operand twin, _compute) located by kernels/gemm.py, on the kernel threads without the GIL.
#include <algorithm>
#include <vector>

#include "pyarrays.h"
#include "threadpool.h"
#if defined(PYMPAR_AMX)
#include "amx.h"
#endif

namespace pympar::bind {
namespace {

constexpr unsigned BF = 1u << BF16;
constexpr unsigned F = 1u << F32;

const uint16_t* cb(const py::array& a) { return static_cast<const uint16_t*>(a.data()); }
uint16_t* mb(py::array& a) { return static_cast<uint16_t*>(a.mutable_data()); }

// float32 rows of the output tile, per thread (a tile of the bf16 GEMM before its epilogue)
float* tile_scratch(int64_t n) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

// rows of one output tile: its float32 products fit in a quarter of a 2 MiB L2 (MKL's AMX kernels
// fill 16-row tiles, so multiples of 16), at least 16 and at most 256 rows
int64_t tile_rows(int64_t N) {
  int64_t r = (131072 / std::max<int64_t>(N, 1)) / 16 * 16;
  return std::min<int64_t>(256, std::max<int64_t>(16, r));
}

}  // namespace

void bind_lowp(py::module_& m) {
  m.def("layernorm_forward_bf16", [](const py::array& x, const py::array& w, const py::array& b, py::array& y,
                                     py::array& mean, py::array& rstd, double eps) {
    int64_t C = last_dim(x), N = C ? x.size() / C : 0;
    check(x, "x", BF), check(y, "y", BF, x.size());
    check(w, "w", F, C), check(b, "b", F, C), check(mean, "mean", F, N), check(rstd, "rstd", F, N);
    py::gil_scoped_release g;
    K->layernorm_fwd_bf16(cb(x), ct<float>(w), ct<float>(b), mb(y), mt<float>(mean), mt<float>(rstd), N, C, eps);
  });
  m.def("add_layernorm_forward_bf16", [](py::array& x, const py::array& res, const py::array& w, const py::array& b,
                                         py::array& y, py::array& mean, py::array& rstd, double eps) {
    int64_t C = last_dim(x), N = C ? x.size() / C : 0;
    check(x, "x", BF), check(res, "res", BF, x.size()), check(y, "y", BF, x.size());
    check(w, "w", F, C), check(b, "b", F, C), check(mean, "mean", F, N), check(rstd, "rstd", F, N);
    py::gil_scoped_release g;
    K->add_layernorm_fwd_bf16(mb(x), cb(res), ct<float>(w), ct<float>(b), mb(y), mt<float>(mean), mt<float>(rstd), N,
                              C, eps);
  });
  m.def("layernorm_backward_bf16", [](const py::array& dy, const py::array& x, const py::array& w,
                                      const py::array& mean, const py::array& rstd, py::array& dx, py::array& dw,
                                      py::array& db, py::object res) {
    int64_t C = last_dim(x), N = C ? x.size() / C : 0;
    check(x, "x", BF), check(dy, "dy", BF, x.size()), check(dx, "dx", BF, x.size());
    check(w, "w", F, C), check(mean, "mean", F, N), check(rstd, "rstd", F, N), check(dw, "dw", F, C);
    check(db, "db", F, C);
    py::array r;
    if (!res.is_none()) {
      r = res.cast<py::array>();
      check(r, "res", BF, x.size());
    }
    const uint16_t* rp = res.is_none() ? nullptr : cb(r);
    py::gil_scoped_release g;
    K->layernorm_bwd_bf16(cb(dy), cb(x), ct<float>(w), ct<float>(mean), ct<float>(rstd), rp, mb(dx), mt<float>(dw),
                          mt<float>(db), N, C);
  });
  m.def("gelu_forward_bf16", [](const py::array& x, py::array& y) {
    check(x, "x", BF), check(y, "y", BF, x.size());
    py::gil_scoped_release g;
    K->gelu_fwd_bf16(cb(x), mb(y), x.size());
  });
  m.def("gelu_backward_bf16", [](const py::array& x, const py::array& dy, py::array& dx) {
    check(x, "x", BF), check(dy, "dy", BF, x.size()), check(dx, "dx", BF, x.size());
    py::gil_scoped_release g;
    K->gelu_bwd_bf16(cb(x), cb(dy), mb(dx), x.size());
  });
  m.def("bias_gelu_forward_bf16", [](py::array& h, const py::array& b, py::array& y) {
    int64_t Fd = last_dim(h), N = Fd ? h.size() / Fd : 0;
    check(h, "h", BF), check(b, "b", F, Fd), check(y, "y", BF, h.size());
    py::gil_scoped_release g;
    K->bias_gelu_fwd_bf16(mb(h), ct<float>(b), mb(y), N, Fd);
  });
  m.def("bias_add_bf16", [](py::array& y, const py::array& b) {
    int64_t Fd = last_dim(y), N = Fd ? y.size() / Fd : 0;
    check(y, "y", BF), check(b, "b", F, Fd);
    py::gil_scoped_release g;
    K->bias_add_bf16(mb(y), ct<float>(b), N, Fd);
  });
  m.def("column_sum_bf16", [](const py::array& x, py::array& out) {
    int64_t Fd = last_dim(x), N = Fd ? x.size() / Fd : 0;
    check(x, "x", BF), check(out, "out", F, Fd);
    py::gil_scoped_release g;
    K->column_sum_bf16(cb(x), mt<float>(out), N, Fd);
  });

  // C (M, N) = A (M, K) B (K, N) with bf16 A and B and float32 accumulation, by MKL's
  // cblas_gemm_bf16bf16f32 (packed = false) or cblas_gemm_bf16bf16f32_compute with B packed by
  // cblas_gemm_bf16bf16f32_pack (packed = true: pb is the packed buffer, tb and ldb unused), both
  // at address fn, sequential, on the kernel threads: `parts` blocks of output rows side by side.
  // c_bf16 = false: C float32 (row stride ldc), C = A B + beta C. c_bf16 = true: each block runs in
  // tiles of rows whose float32 products land in a per-thread scratch and leave through the
  // epilogue: C = round(A B + bias) in bf16, and G = round(GELU(C)) when pg is set (bias pbias and
  // G nullable; beta must be 0). The caller (kernels/gemm.py) checked every layout and address.
  m.def("gemm_bf16", [](uintptr_t fn, bool packed, int ta, int tb, int64_t M, int64_t N, int64_t Kd, uintptr_t pa,
                        int64_t lda, uintptr_t pb, int64_t ldb, double beta, uintptr_t pc, int64_t ldc, bool c_bf16,
                        uintptr_t pbias, uintptr_t pg, int64_t ldg, int parts) {
    if (fn == 0 || parts < 1 || M < 0 || N < 0 || Kd < 0)
      throw py::value_error("gemm_bf16: need a function, parts >= 1 and non-negative sizes");
    if (c_bf16 && beta != 0.0) throw py::value_error("gemm_bf16: a bf16 output cannot accumulate (beta must be 0)");
    using GF = void (*)(int, int, int, int, int, int, float, const void*, int, const void*, int, float, float*, int);
    auto gemm = reinterpret_cast<GF>(fn);
    const int tbx = packed ? 151 : tb;  // CblasPacked
    parts = static_cast<int>(std::min<int64_t>(parts, std::max<int64_t>(M, 1)));
    const int64_t item_a = 2;
    // A's unit from one output row to the next: a row of A (NoTrans) or a column (Trans)
    const int64_t da = (ta == 111 ? lda : 1) * item_a;
    const KernelTable* k = K;
    auto block = [&](int64_t i0, int64_t i1) {
      if (i1 <= i0) return;
      const char* a0 = reinterpret_cast<const char*>(pa) + i0 * da;
      const void* b = reinterpret_cast<const void*>(pb);
      if (!c_bf16) {
        float* c = reinterpret_cast<float*>(pc) + i0 * ldc;
        gemm(101, ta, tbx, static_cast<int>(i1 - i0), static_cast<int>(N), static_cast<int>(Kd), 1.0f, a0,
             static_cast<int>(lda), b, static_cast<int>(ldb), static_cast<float>(beta), c, static_cast<int>(ldc));
        return;
      }
      const int64_t R = tile_rows(N);
      float* s = tile_scratch(R * N);
      const float* bias = reinterpret_cast<const float*>(pbias);
      for (int64_t r0 = i0; r0 < i1; r0 += R) {
        const int64_t rows = std::min(R, i1 - r0);
        gemm(101, ta, tbx, static_cast<int>(rows), static_cast<int>(N), static_cast<int>(Kd), 1.0f,
             reinterpret_cast<const char*>(pa) + r0 * da, static_cast<int>(lda), b, static_cast<int>(ldb), 0.0f, s,
             static_cast<int>(N));
        uint16_t* h = reinterpret_cast<uint16_t*>(pc) + r0 * ldc;
        uint16_t* gout = pg ? reinterpret_cast<uint16_t*>(pg) + r0 * ldg : nullptr;
        k->gemm_epilogue_bf16(s, N, bias, h, ldc, gout, ldg, rows, N);
      }
    };
    py::gil_scoped_release g;
    if (parts == 1) {
      block(0, M);
      return;
    }
    pympar::parallel_for(parts, 1, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) block(M * p / parts, M * (p + 1) / parts);
    });
  });

  // pympar's own bf16 GEMM on AMX tiles or AVX512-BF16 dot products (amx.cpp), where the CPU has
  // AMX-BF16 or AVX512-BF16 and the build has it
#if defined(PYMPAR_AMX)
  m.def("amx_available", [] { return amx::available(); },
        "whether this CPU has AMX-BF16 and Linux granted this process the tile state");
  m.def("dp_bf16_available", [] { return amx::dp_available(); },
        "whether this CPU has AVX512-BF16 (VDPBF16PS): amx_gemm(..., tiles=False) runs there");
  m.def("amx_packed_b_size", [](int64_t K, int64_t N) { return amx::packed_b_elems(K, N); });
  // B (K, N), element (k, n) at src[k sk + n sn] (bf16, strides in elements) -> dst, a uint16/bf16
  // array of amx_packed_b_size(K, N) elements; the caller checked that src spans what it names
  m.def("amx_pack_b", [](uintptr_t src, int64_t sk, int64_t sn, int64_t K, int64_t N, py::array& dst) {
    if (K < 0 || N < 0 || dst.itemsize() != 2 || !(dst.flags() & py::array::c_style) ||
        dst.size() < amx::packed_b_elems(K, N) || !dst.writeable())
      throw py::value_error("amx_pack_b: dst must be a writeable C-contiguous 2-byte array of amx_packed_b_size elements");
    if (!amx::available() && !amx::dp_available())
      throw py::value_error("amx_pack_b: neither AMX nor AVX512-BF16 is available here");
    if (reinterpret_cast<uintptr_t>(dst.data()) % 64)
      throw py::value_error("amx_pack_b: dst must start on a 64-byte boundary (tiles load whole lines)");
    auto* d = static_cast<uint16_t*>(dst.mutable_data());
    py::gil_scoped_release g;
    amx::pack_b(reinterpret_cast<const uint16_t*>(src), sk, sn, K, N, d);
  });
  // C (M, N) = A B with A's element (m, k) at pa[m sam + k sak], B packed (b_packed) or at
  // pb[k sbk + n sbn] (bf16; strides in elements); C float32 (=, or += with accumulate) or bf16
  // (round(C + bias), and round(GELU) into pg when set), row strides ldc, ldg. The caller
  // (kernels/gemm.py) checked every layout and address. tiles: on AMX tiles, else on AVX512-BF16
  // dot products (the same packs and epilogue).
  m.def("amx_gemm", [](uintptr_t pa, int64_t sam, int64_t sak, uintptr_t pb, int64_t sbk, int64_t sbn, bool b_packed,
                       int64_t M, int64_t N, int64_t Kd, uintptr_t pc, int64_t ldc, bool c_bf16, bool accumulate,
                       uintptr_t pbias, uintptr_t pg, int64_t ldg, bool tiles) {
    const amx::Engine engine = amx::engine_for(tiles, "amx_gemm");
    if (M < 0 || N < 0 || Kd < 0 || pa == 0 || pb == 0 || pc == 0)
      throw py::value_error("amx_gemm: need operands and non-negative sizes");
    if (c_bf16 && accumulate) throw py::value_error("amx_gemm: a bf16 output cannot accumulate");
    if (b_packed && pb % 64) throw py::value_error("amx_gemm: a packed B must start on a 64-byte boundary");
    amx::Out o;
    o.mode = c_bf16 ? amx::Out::BF16 : amx::Out::F32;
    o.c = reinterpret_cast<void*>(pc);
    o.ldc = ldc;
    o.accumulate = accumulate;
    o.bias = reinterpret_cast<const float*>(pbias);
    o.g = reinterpret_cast<uint16_t*>(pg);
    o.ldg = ldg;
    py::gil_scoped_release g;
    amx::gemm(reinterpret_cast<const uint16_t*>(pa), sam, sak, reinterpret_cast<const uint16_t*>(pb), sbk, sbn,
              b_packed, M, N, Kd, o, engine);
  });
  // causal attention on AMX tiles (tiles) or AVX512-BF16 dot products: qkv (B, T, 3, H, D) bf16, D % 32 == 0 -> o (B, T, H*D) bf16,
  // lse (B, H, T) float32; backward: o, lse, dout -> dqkv like qkv (may be qkv itself)
  m.def("amx_attention_forward", [](const py::array& qkv, py::array& o, py::array& lse, double scale, bool tiles) {
    if (qkv.ndim() != 5 || qkv.shape(2) != 3 || qkv.shape(4) % 32)
      throw py::value_error("amx_attention_forward: qkv must be (B, T, 3, H, D) with D a multiple of 32");
    const amx::Engine engine = amx::engine_for(tiles, "amx_attention_forward");
    const int64_t B = qkv.shape(0), T = qkv.shape(1), H = qkv.shape(3), D = qkv.shape(4);
    check(qkv, "qkv", BF), check(o, "o", BF, B * T * H * D), check(lse, "lse", F, B * H * T);
    const uint16_t* q = cb(qkv);
    uint16_t* op = mb(o);
    float* lp = mt<float>(lse);
    py::gil_scoped_release g;
    amx::attention_fwd(q, op, lp, B, T, H, D, scale, engine);
  });
  m.def("amx_attention_backward", [](const py::array& qkv, const py::array& o, const py::array& lse,
                                     const py::array& dout, py::array& dqkv, double scale, bool tiles) {
    if (qkv.ndim() != 5 || qkv.shape(2) != 3 || qkv.shape(4) % 32)
      throw py::value_error("amx_attention_backward: qkv must be (B, T, 3, H, D) with D a multiple of 32");
    const amx::Engine engine = amx::engine_for(tiles, "amx_attention_backward");
    const int64_t B = qkv.shape(0), T = qkv.shape(1), H = qkv.shape(3), D = qkv.shape(4);
    check(qkv, "qkv", BF), check(o, "o", BF, B * T * H * D), check(lse, "lse", F, B * H * T);
    check(dout, "dout", BF, B * T * H * D), check(dqkv, "dqkv", BF, qkv.size());
    if (!dqkv.writeable()) throw py::value_error("amx_attention_backward: dqkv must be writeable");
    const uint16_t *q = cb(qkv), *op = cb(o), *dp = cb(dout);
    const float* lp = ct<float>(lse);
    uint16_t* g = mb(dqkv);
    py::gil_scoped_release rel;
    amx::attention_bwd(q, op, lp, dp, g, B, T, H, D, scale, engine);
  });
#else
  m.def("amx_available", [] { return false; }, "this build has no AMX kernels");
  m.def("dp_bf16_available", [] { return false; }, "this build has no AVX512-BF16 kernels");
#endif
}

}  // namespace pympar::bind
