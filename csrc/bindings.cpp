// pympar._C: the pybind11 face of the C++ kernels. The Python wrapper (pympar/kernels/native.py)
// has already checked dtypes and contiguity and allocated the outputs; these bindings check
// again what would corrupt memory if wrong (dtype, C-contiguity, element counts), release the
// GIL, and call the kernel of the instruction set picked at import.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "dtypes.h"
#include "kernels.h"
#include "pyarrays.h"
#include "threadpool.h"

namespace py = pybind11;
using namespace pympar;
using namespace pympar::bind;

namespace pympar::bind {
const KernelTable* K = nullptr;
}

namespace {

// the best table the CPU supports, or the one asked for ("generic" | "avx2" | "avx512"; nullptr when
// the CPU lacks it); the environment is read by pympar.config, which calls use_isa
const KernelTable* pick_table(const std::string& w) {
#if defined(PYMPAR_X86)
  __builtin_cpu_init();
  bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (w == "generic") return table_generic();
  if (w == "avx2") return avx2 ? table_avx2() : nullptr;
  if (w == "avx512") return avx512 ? table_avx512() : nullptr;
  if (avx512) return table_avx512();
  if (avx2) return table_avx2();
#else
  if (!w.empty() && w != "generic") return nullptr;
#endif
  return table_generic();
}

// rows (int64, M of them) as a pointer, each checked to lie in [0, n): an IndexError naming the kernel
const int64_t* rows_in_bounds(const py::array& rows, int64_t M, int64_t n, const char* kernel) {
  const int64_t* r = ct<int64_t>(rows);
  for (int64_t i = 0; i < M; ++i)
    if (r[i] < 0 || r[i] >= n)
      throw py::index_error(std::string(kernel) + ": row index " + std::to_string(r[i]) + " is out of bounds for " +
                            std::to_string(n) + " rows");
  return r;
}

// out[rows[i]] += y[i] (times weights[i] when given) in the order of i, as np.add.at adds. The row
// width is out's, so a call with no rows (an expert, or a vocabulary shard, given none) is valid and
// leaves out as it was.
void add_rows(const py::array& y, const py::array& rows, py::object weights, py::array& out, const char* kernel) {
  int dt = check(out, "out", FLOATS | (1u << BF16));
  if (out.ndim() != 2) throw py::value_error(std::string(kernel) + ": out must be 2-D (rows, width)");
  int64_t n_rows = out.shape(0), C = out.shape(1), M = rows.size();
  check(rows, "rows", I64ONLY);
  check(y, "y", 1u << dt, M * C);
  const void* w = nullptr;
  py::array wa;
  if (!weights.is_none()) {
    wa = weights.cast<py::array>();
    check(wa, "weights", 1u << dt, M);
    w = wa.data();
  }
  const int64_t* r = rows_in_bounds(rows, M, n_rows, kernel);
  py::gil_scoped_release g;
  pympar::unpermute_add(y.data(), r, w, out.mutable_data(), dt, M, C, n_rows);
}

void check_targets(const int64_t* t, int64_t N, int64_t V) {
  for (int64_t i = 0; i < N; ++i)
    if (t[i] >= V)
      throw py::index_error("cross_entropy: target " + std::to_string(t[i]) + " at row " + std::to_string(i) +
                            " is >= the vocabulary size " + std::to_string(V));
}


// a (B, T, H, D) operand of the block attention kernels, read in place: checked for its shape, the
// dtype dt, an aligned start, the last axis contiguous and the head stride D; the batch and row
// strides (any, in whole elements) are returned. A stride of an axis of length 1 is never used.
RowStrides rows_of(const py::array& a, const char* fn, const char* name, int dt, int64_t B, int64_t T, int64_t H,
                   int64_t D) {
  const std::string what = std::string(fn) + ": " + name;
  if (a.ndim() != 4 || a.shape(0) != B || a.shape(1) != T || a.shape(2) != H || a.shape(3) != D)
    throw py::value_error(what + " has shape " + shape_of(a) + ", expected (B, T, H, D) = (" + std::to_string(B) +
                          ", " + std::to_string(T) + ", " + std::to_string(H) + ", " + std::to_string(D) + ")");
  if (dtype_code(a) != dt)
    throw py::value_error(what + " has dtype " + py::str(a.dtype()).cast<std::string>() +
                          ", expected the dtype of q");
  if (a.size() == 0) return {0, 0};  // nothing is read (NumPy may give such arrays any strides)
  const int64_t item = a.itemsize();
  auto stride = [&](int i) { return a.shape(i) > 1 ? int64_t(a.strides(i)) : int64_t(0); };
  if (reinterpret_cast<uintptr_t>(a.data()) % item != 0 || stride(0) % item != 0 || stride(1) % item != 0)
    throw py::value_error(what + " is not aligned to its elements (pass np.ascontiguousarray(...))");
  if (stride(3) != (a.shape(3) > 1 ? item : 0) || stride(2) != (a.shape(2) > 1 ? D * item : 0))
    throw py::value_error(what + " has strides " + py::str(py::tuple(a.attr("strides"))).cast<std::string>() +
                          ": the last axis must be contiguous and the head stride D (pass np.ascontiguousarray(...))");
  return {stride(0) / item, stride(1) / item};
}

struct BlockDims {
  int64_t B, Tq, Tk, H, D;
};

// (B, Tq, Tk, H, D) of q (B, Tq, H, D) against k (B, Tk, H, D); rows_of checks the rest
BlockDims block_dims(const char* fn, const py::array& q, const py::array& k, bool causal) {
  if (q.ndim() != 4 || k.ndim() != 4)
    throw py::value_error(std::string(fn) + ": q " + shape_of(q) + " and k " + shape_of(k) +
                          " must be (B, Tq, H, D) and (B, Tk, H, D)");
  BlockDims d{q.shape(0), q.shape(1), k.shape(1), q.shape(2), q.shape(3)};
  if (causal && d.Tq != d.Tk)
    throw py::value_error(std::string(fn) + ": causal needs Tq == Tk, got Tq=" + std::to_string(d.Tq) +
                          " Tk=" + std::to_string(d.Tk));
  return d;
}

template <typename T> const T* at(const py::array& a, int64_t offset) { return ct<T>(a) + offset; }
template <typename T> T* at(py::array& a, int64_t offset) { return mt<T>(a) + offset; }

}  // namespace

PYBIND11_MODULE(_C, m) {
  K = pick_table("");
  bind_lowp(m);
  bind_exact(m);
  bind_fastcoll(m);
  bind_grouped(m);
  m.doc() = "pympar C++ kernels (see pympar.kernels)";
  m.def("isa", [] { return std::string(K->isa); }, "the instruction-set build of the arithmetic kernels in use");
  m.def("cpu_features", [] {
    py::dict d;
#if defined(PYMPAR_X86)
    __builtin_cpu_init();
    d["avx2"] = bool(__builtin_cpu_supports("avx2"));
    d["avx512f"] = bool(__builtin_cpu_supports("avx512f"));
    d["avx512bf16"] = bool(__builtin_cpu_supports("avx512bf16"));
    d["amx_bf16"] = bool(__builtin_cpu_supports("amx-bf16"));
#endif
    return d;
  }, "the CPU features the bf16 products are chosen by (x86: avx2, avx512f, avx512bf16, amx_bf16)");
  m.def("use_isa", [](const std::string& name) {
    if (name != "generic" && name != "avx2" && name != "avx512" && !name.empty())
      throw py::value_error("use_isa: '" + name + "' is not one of generic, avx2, avx512 (or '' for the best)");
    const KernelTable* t = pick_table(name);
    if (!t) throw py::value_error("use_isa: this CPU does not support the " + name + " kernels");
    K = t;
  }, "use the kernels of one instruction-set build ('' = the best this CPU supports)");
  m.attr("max_threads") = pympar::max_threads();
  m.def("set_num_threads", [](int n) {
    if (n < 1) throw py::value_error("set_num_threads: n=" + std::to_string(n) + " must be >= 1");
    if (n > pympar::max_threads())
      throw py::value_error("set_num_threads: n=" + std::to_string(n) + " is more than the kernel pool's " +
                            std::to_string(pympar::max_threads()) + " threads");
    py::gil_scoped_release g;
    pympar::set_num_threads(n);
  });
  m.def("get_num_threads", [] { return pympar::get_num_threads(); });
  m.def("set_spin_us", [](int us) { pympar::set_spin_us(us); },
        "microseconds an idle kernel thread spins before it sleeps (PYMPAR_SPIN_US, default 200)");
  m.def("get_spin_us", [] { return pympar::get_spin_us(); });
  m.def("blas_threads_callback", [] { return reinterpret_cast<uintptr_t>(&pympar_blas_threads_callback); },
        "address of the OpenBLAS caller-managed threading hook that runs the BLAS's jobs on the kernel threads");
  m.def("blas_callback_calls", [] { return pympar::blas_callback_calls(); });
  // fn(b0, b1) for the ranges [n*i//parts, n*(i+1)//parts) side by side on the kernel threads
  // (each takes the GIL; NumPy's matmul and these kernels drop it again inside). Calls nested in
  // a range run inline (the pool is held). The first exception raised is re-raised here.
  m.def("parallel_chunks", [](int64_t n, int parts, py::function fn) {
    if (n < 0 || parts < 1) throw py::value_error("parallel_chunks: need n >= 0 and parts >= 1");
    parts = static_cast<int>(std::min<int64_t>(parts, std::max<int64_t>(n, 1)));
    py::gil_scoped_release g;
    pympar::parallel_for(parts, 1, 1, [&](int64_t i0, int64_t i1) {
      py::gil_scoped_acquire a;
      for (int64_t i = i0; i < i1; ++i) fn(n * i / parts, n * (i + 1) / parts);
    });
  });

  // One product C = alpha A B + beta C by a cblas_?gemm the caller located (kernels/gemm.py: MKL's,
  // sequential), cut into `parts` blocks of output rows (or columns, by_cols) called side by side
  // on the kernel threads without the GIL: block i covers units [n*i//parts, n*(i+1)//parts) of
  // n = M (or N), its A, B and C starting da, db, dc bytes per unit further. The addresses and
  // leading dimensions are the caller's (it checked the layouts); cblas's integers are 32-bit.
  m.def("gemm_blocks", [](uintptr_t fn, bool f64, int ta, int tb, int64_t M, int64_t N, int64_t K, uintptr_t pa,
                          int64_t lda, uintptr_t pb, int64_t ldb, double beta, uintptr_t pc, int64_t ldc, bool by_cols,
                          int64_t da, int64_t db, int64_t dc, int parts) {
    if (fn == 0 || parts < 1 || M < 0 || N < 0 || K < 0)
      throw py::value_error("gemm_blocks: need a function, parts >= 1 and non-negative sizes");
    using SF = void (*)(int, int, int, int, int, int, float, const void*, int, const void*, int, float, void*, int);
    using DF = void (*)(int, int, int, int, int, int, double, const void*, int, const void*, int, double, void*, int);
    const int64_t n = by_cols ? N : M;
    parts = static_cast<int>(std::min<int64_t>(parts, std::max<int64_t>(n, 1)));
    auto block = [&](int64_t i0, int64_t i1) {
      const int m = static_cast<int>(by_cols ? M : i1 - i0), w = static_cast<int>(by_cols ? i1 - i0 : N);
      const void* a = reinterpret_cast<const void*>(pa + i0 * da);
      const void* b = reinterpret_cast<const void*>(pb + i0 * db);
      void* c = reinterpret_cast<void*>(pc + i0 * dc);
      if (f64)
        reinterpret_cast<DF>(fn)(101, ta, tb, m, w, static_cast<int>(K), 1.0, a, static_cast<int>(lda), b,
                                 static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
      else
        reinterpret_cast<SF>(fn)(101, ta, tb, m, w, static_cast<int>(K), 1.0f, a, static_cast<int>(lda), b,
                                 static_cast<int>(ldb), static_cast<float>(beta), c, static_cast<int>(ldc));
    };
    py::gil_scoped_release g;
    if (parts == 1) {
      block(0, n);
      return;
    }
    pympar::parallel_for(parts, 1, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) block(n * p / parts, n * (p + 1) / parts);
    });
  });

  m.def("softmax_causal_forward", [](const py::array& x, py::array& y) {
    int64_t T = last_dim(x), n = x.size();
    int dt = check(x, "x", FLOATS);
    check(y, "y", 1u << dt, n);
    int64_t B = T ? n / (T * T) : 0;
    py::gil_scoped_release g;
    if (dt == F32) K->softmax_causal_fwd_f32(ct<float>(x), mt<float>(y), B, T);
    else K->softmax_causal_fwd_f64(ct<double>(x), mt<double>(y), B, T);
  });
  m.def("softmax_causal_backward", [](const py::array& y, const py::array& dy, py::array& dx) {
    int64_t T = last_dim(y), n = y.size();
    int dt = check(y, "y", FLOATS);
    check(dy, "dy", 1u << dt, n);
    check(dx, "dx", 1u << dt, n);
    int64_t B = T ? n / (T * T) : 0;
    py::gil_scoped_release g;
    if (dt == F32) K->softmax_causal_bwd_f32(ct<float>(y), ct<float>(dy), mt<float>(dx), B, T);
    else K->softmax_causal_bwd_f64(ct<double>(y), ct<double>(dy), mt<double>(dx), B, T);
  });

  // causal attention on packed qkv (B, T, 3, H, D) -> o (B, T, H*D), lse (B, H, T): the causal block
  // of the views q = qkv[:, :, 0], k = [:, :, 1], v = [:, :, 2] (rows 3 H D apart); dqkv packed alike
  m.def("attention_forward", [](const py::array& qkv, py::array& o, py::array& lse, double scale) {
    if (qkv.ndim() != 5 || qkv.shape(2) != 3) throw py::value_error("attention_forward: qkv must be (B, T, 3, H, D)");
    int64_t B = qkv.shape(0), T = qkv.shape(1), H = qkv.shape(3), D = qkv.shape(4), HD = H * D;
    int dt = check(qkv, "qkv", FLOATS);
    check(o, "o", 1u << dt, B * T * HD);
    check(lse, "lse", 1u << dt, B * H * T);
    const RowStrides s{T * 3 * HD, 3 * HD};
    py::gil_scoped_release g;
    if (dt == F32)
      K->attention_block_fwd_f32(ct<float>(qkv), s, at<float>(qkv, HD), s, at<float>(qkv, 2 * HD), s, mt<float>(o),
                                 mt<float>(lse), B, T, T, H, D, true, scale);
    else
      K->attention_block_fwd_f64(ct<double>(qkv), s, at<double>(qkv, HD), s, at<double>(qkv, 2 * HD), s,
                                 mt<double>(o), mt<double>(lse), B, T, T, H, D, true, scale);
  });
  m.def("attention_backward", [](const py::array& qkv, const py::array& o, const py::array& lse,
                                 const py::array& dout, py::array& dqkv, double scale) {
    if (qkv.ndim() != 5 || qkv.shape(2) != 3) throw py::value_error("attention_backward: qkv must be (B, T, 3, H, D)");
    int64_t B = qkv.shape(0), T = qkv.shape(1), H = qkv.shape(3), D = qkv.shape(4), HD = H * D;
    int dt = check(qkv, "qkv", FLOATS);
    check(o, "o", 1u << dt, B * T * HD);
    check(lse, "lse", 1u << dt, B * H * T);
    check(dout, "dout", 1u << dt, B * T * HD);
    check(dqkv, "dqkv", 1u << dt, qkv.size());
    const RowStrides s{T * 3 * HD, 3 * HD}, os{T * HD, HD};
    py::gil_scoped_release g;
    if (dt == F32)
      K->attention_block_bwd_f32(ct<float>(qkv), s, at<float>(qkv, HD), s, at<float>(qkv, 2 * HD), s, ct<float>(o),
                                 os, ct<float>(lse), ct<float>(dout), os, mt<float>(dqkv), s, at<float>(dqkv, HD), s,
                                 at<float>(dqkv, 2 * HD), s, B, T, T, H, D, true, scale);
    else
      K->attention_block_bwd_f64(ct<double>(qkv), s, at<double>(qkv, HD), s, at<double>(qkv, 2 * HD), s,
                                 ct<double>(o), os, ct<double>(lse), ct<double>(dout), os, mt<double>(dqkv), s,
                                 at<double>(dqkv, HD), s, at<double>(dqkv, 2 * HD), s, B, T, T, H, D, true, scale);
  });
  // one block of (ring) attention: q (B, Tq, H, D), k, v (B, Tk, H, D), strided views read in place ->
  // o (B, Tq, H*D), lse (B, H, Tq); causal needs Tq == Tk
  m.def("attention_block_forward", [](const py::array& q, const py::array& k, const py::array& v, py::array& o,
                                      py::array& lse, double scale, bool causal) {
    const char* fn = "attention_block_forward";
    auto [B, Tq, Tk, H, D] = block_dims(fn, q, k, causal);
    int dt = check(o, "o", FLOATS, B * Tq * H * D);
    check(lse, "lse", 1u << dt, B * H * Tq);
    RowStrides qs = rows_of(q, fn, "q", dt, B, Tq, H, D), ks = rows_of(k, fn, "k", dt, B, Tk, H, D),
               vs = rows_of(v, fn, "v", dt, B, Tk, H, D);
    if (Tk == 0 && Tq > 0) throw py::value_error(std::string(fn) + ": Tk=0, the queries have no key to attend to");
    py::gil_scoped_release g;
    if (dt == F32)
      K->attention_block_fwd_f32(ct<float>(q), qs, ct<float>(k), ks, ct<float>(v), vs, mt<float>(o), mt<float>(lse),
                                 B, Tq, Tk, H, D, causal, scale);
    else
      K->attention_block_fwd_f64(ct<double>(q), qs, ct<double>(k), ks, ct<double>(v), vs, mt<double>(o),
                                 mt<double>(lse), B, Tq, Tk, H, D, causal, scale);
  });
  // its backward: o, lse of the complete softmax of these query rows (every key block), o and dout
  // (B, Tq, H, D) read through their strides (a head group's columns of (B, Tq, H*D) arrays), lse (B, H, Tq)
  // -> dq (B, Tq, H, D), dk, dv (B, Tk, H, D), written (=) through their strides
  m.def("attention_block_backward", [](const py::array& q, const py::array& k, const py::array& v,
                                       const py::array& o, const py::array& lse, const py::array& dout, py::array& dq,
                                       py::array& dk, py::array& dv, double scale, bool causal) {
    const char* fn = "attention_block_backward";
    auto [B, Tq, Tk, H, D] = block_dims(fn, q, k, causal);
    const int dt = dtype_code(q);
    if (dt < 0 || !(FLOATS & (1u << dt)))
      throw py::type_error(std::string(fn) + ": q has unsupported dtype " + py::str(q.dtype()).cast<std::string>());
    check(lse, "lse", 1u << dt, B * H * Tq);
    RowStrides os = rows_of(o, fn, "o", dt, B, Tq, H, D), dos = rows_of(dout, fn, "dout", dt, B, Tq, H, D);
    RowStrides qs = rows_of(q, fn, "q", dt, B, Tq, H, D), ks = rows_of(k, fn, "k", dt, B, Tk, H, D),
               vs = rows_of(v, fn, "v", dt, B, Tk, H, D), dqs = rows_of(dq, fn, "dq", dt, B, Tq, H, D),
               dks = rows_of(dk, fn, "dk", dt, B, Tk, H, D), dvs = rows_of(dv, fn, "dv", dt, B, Tk, H, D);
    for (const py::array* a : {&dq, &dk, &dv})
      if (!a->writeable()) throw py::value_error(std::string(fn) + ": dq, dk and dv must be writeable");
    py::gil_scoped_release g;
    if (dt == F32)
      K->attention_block_bwd_f32(ct<float>(q), qs, ct<float>(k), ks, ct<float>(v), vs, ct<float>(o), os,
                                 ct<float>(lse), ct<float>(dout), dos, mt<float>(dq), dqs, mt<float>(dk), dks,
                                 mt<float>(dv), dvs, B, Tq, Tk, H, D, causal, scale);
    else
      K->attention_block_bwd_f64(ct<double>(q), qs, ct<double>(k), ks, ct<double>(v), vs, ct<double>(o), os,
                                 ct<double>(lse), ct<double>(dout), dos, mt<double>(dq), dqs, mt<double>(dk), dks,
                                 mt<double>(dv), dvs, B, Tq, Tk, H, D, causal, scale);
  });
  m.def("layernorm_forward", [](const py::array& x, const py::array& w, const py::array& b, py::array& y,
                                py::array& mean, py::array& rstd, double eps) {
    int64_t C = last_dim(x), N = C ? x.size() / C : 0;
    int dt = check(x, "x", FLOATS);
    unsigned same = 1u << dt;
    check(w, "w", same, C), check(b, "b", same, C), check(y, "y", same, x.size());
    check(mean, "mean", same, N), check(rstd, "rstd", same, N);
    py::gil_scoped_release g;
    if (dt == F32)
      K->layernorm_fwd_f32(ct<float>(x), ct<float>(w), ct<float>(b), mt<float>(y), mt<float>(mean), mt<float>(rstd),
                           N, C, eps);
    else
      K->layernorm_fwd_f64(ct<double>(x), ct<double>(w), ct<double>(b), mt<double>(y), mt<double>(mean),
                           mt<double>(rstd), N, C, eps);
  });
  // res: None or an (N, C) array added to dx (the residual's gradient)
  m.def("layernorm_backward", [](const py::array& dy, const py::array& x, const py::array& w,
                                 const py::array& mean, const py::array& rstd, py::array& dx, py::array& dw,
                                 py::array& db, py::object res) {
    int64_t C = last_dim(x), N = C ? x.size() / C : 0;
    int dt = check(x, "x", FLOATS);
    unsigned same = 1u << dt;
    check(dy, "dy", same, x.size()), check(w, "w", same, C), check(mean, "mean", same, N);
    check(rstd, "rstd", same, N), check(dx, "dx", same, x.size()), check(dw, "dw", same, C), check(db, "db", same, C);
    py::array r;
    if (!res.is_none()) {
      r = res.cast<py::array>();
      check(r, "res", same, x.size());
    }
    const void* rp = res.is_none() ? nullptr : r.data();
    py::gil_scoped_release g;
    if (dt == F32)
      K->layernorm_bwd_f32(ct<float>(dy), ct<float>(x), ct<float>(w), ct<float>(mean), ct<float>(rstd),
                           static_cast<const float*>(rp), mt<float>(dx), mt<float>(dw), mt<float>(db), N, C);
    else
      K->layernorm_bwd_f64(ct<double>(dy), ct<double>(x), ct<double>(w), ct<double>(mean), ct<double>(rstd),
                           static_cast<const double*>(rp), mt<double>(dx), mt<double>(dw), mt<double>(db), N, C);
  });
  m.def("add_layernorm_forward", [](py::array& x, const py::array& res, const py::array& w, const py::array& b,
                                    py::array& y, py::array& mean, py::array& rstd, double eps) {
    int64_t C = last_dim(x), N = C ? x.size() / C : 0;
    int dt = check(x, "x", FLOATS);
    unsigned same = 1u << dt;
    check(res, "res", same, x.size()), check(w, "w", same, C), check(b, "b", same, C);
    check(y, "y", same, x.size()), check(mean, "mean", same, N), check(rstd, "rstd", same, N);
    py::gil_scoped_release g;
    if (dt == F32)
      K->add_layernorm_fwd_f32(mt<float>(x), ct<float>(res), ct<float>(w), ct<float>(b), mt<float>(y),
                               mt<float>(mean), mt<float>(rstd), N, C, eps);
    else
      K->add_layernorm_fwd_f64(mt<double>(x), ct<double>(res), ct<double>(w), ct<double>(b), mt<double>(y),
                               mt<double>(mean), mt<double>(rstd), N, C, eps);
  });
  m.def("bias_gelu_forward", [](py::array& h, const py::array& b, py::array& y) {
    int64_t F = last_dim(h), N = F ? h.size() / F : 0;
    int dt = check(h, "h", FLOATS);
    check(b, "b", 1u << dt, F), check(y, "y", 1u << dt, h.size());
    py::gil_scoped_release g;
    if (dt == F32) K->bias_gelu_fwd_f32(mt<float>(h), ct<float>(b), mt<float>(y), N, F);
    else K->bias_gelu_fwd_f64(mt<double>(h), ct<double>(b), mt<double>(y), N, F);
  });

  m.def("bias_add", [](py::array& y, const py::array& b) {
    int64_t F = last_dim(y), N = F ? y.size() / F : 0;
    int dt = check(y, "y", FLOATS);
    check(b, "b", 1u << dt, F);
    py::gil_scoped_release g;
    if (dt == F32) K->bias_add_f32(mt<float>(y), ct<float>(b), N, F);
    else K->bias_add_f64(mt<double>(y), ct<double>(b), N, F);
  });
  m.def("column_sum", [](const py::array& x, py::array& out) {
    int64_t F = last_dim(x), N = F ? x.size() / F : 0;
    int dt = check(x, "x", FLOATS);
    check(out, "out", 1u << dt, F);
    py::gil_scoped_release g;
    if (dt == F32) K->column_sum_f32(ct<float>(x), mt<float>(out), N, F);
    else K->column_sum_f64(ct<double>(x), mt<double>(out), N, F);
  });

  m.def("gelu_forward", [](const py::array& x, py::array& y) {
    int dt = check(x, "x", FLOATS);
    check(y, "y", 1u << dt, x.size());
    py::gil_scoped_release g;
    if (dt == F32) K->gelu_fwd_f32(ct<float>(x), mt<float>(y), x.size());
    else K->gelu_fwd_f64(ct<double>(x), mt<double>(y), x.size());
  });
  m.def("gelu_backward", [](const py::array& x, const py::array& dy, py::array& dx) {
    int dt = check(x, "x", FLOATS);
    check(dy, "dy", 1u << dt, x.size()), check(dx, "dx", 1u << dt, x.size());
    py::gil_scoped_release g;
    if (dt == F32) K->gelu_bwd_f32(ct<float>(x), ct<float>(dy), mt<float>(dx), x.size());
    else K->gelu_bwd_f64(ct<double>(x), ct<double>(dy), mt<double>(dx), x.size());
  });

  m.def("cross_entropy_forward", [](const py::array& logits, const py::array& targets, py::array& loss,
                                    py::array& lse) {
    int64_t V = last_dim(logits), N = V ? logits.size() / V : 0;
    int dt = check(logits, "logits", FLOATS);
    check(targets, "targets", I64ONLY, N), check(loss, "loss", 1u << dt, N), check(lse, "lse", 1u << dt, N);
    check_targets(ct<int64_t>(targets), N, V);
    py::gil_scoped_release g;
    if (dt == F32) K->ce_fwd_f32(ct<float>(logits), ct<int64_t>(targets), mt<float>(loss), mt<float>(lse), N, V);
    else K->ce_fwd_f64(ct<double>(logits), ct<int64_t>(targets), mt<double>(loss), mt<double>(lse), N, V);
  });
  m.def("cross_entropy_backward", [](const py::array& logits, const py::array& lse, const py::array& targets,
                                     const py::array& dloss, py::array& dlogits) {
    int64_t V = last_dim(logits), N = V ? logits.size() / V : 0;
    int dt = check(logits, "logits", FLOATS);
    check(lse, "lse", 1u << dt, N), check(targets, "targets", I64ONLY, N);
    check(dloss, "dloss", 1u << dt), check(dlogits, "dlogits", 1u << dt, logits.size());
    if (dloss.size() != 1 && dloss.size() != N)
      throw py::value_error("cross_entropy_backward: dloss must be a scalar or have N=" + std::to_string(N) +
                            " elements, got " + std::to_string(dloss.size()));
    int64_t stride = dloss.size() == 1 ? 0 : 1;
    check_targets(ct<int64_t>(targets), N, V);
    py::gil_scoped_release g;
    if (dt == F32)
      K->ce_bwd_f32(ct<float>(logits), ct<float>(lse), ct<int64_t>(targets), ct<float>(dloss), stride,
                    mt<float>(dlogits), N, V);
    else
      K->ce_bwd_f64(ct<double>(logits), ct<double>(lse), ct<int64_t>(targets), ct<double>(dloss), stride,
                    mt<double>(dlogits), N, V);
  });

  m.def("adamw_step", [](py::array& p, const py::array& grad, py::array& mom, py::array& var, double lr,
                         double beta1, double beta2, double eps, double weight_decay, double bc1, double bc2) {
    int pdt = check(p, "p", FLOATS);
    int gdt = check(grad, "g", FLOATS | HALVES, p.size());
    if (pdt == F64 && gdt != F64) throw py::type_error("adamw_step: float64 parameters need a float64 gradient");
    // the moments: p's dtype, or bf16 for float32 parameters (bf16 optimizer state)
    int mdt = check(mom, "m", (1u << pdt) | (pdt == F32 ? (1u << BF16) : 0u), p.size());
    check(var, "v", 1u << mdt, p.size());
    py::gil_scoped_release g;
    K->adamw(mp(p), cp(grad), mp(mom), mp(var), pdt, gdt, mdt, p.size(), lr, beta1, beta2, eps, weight_decay, bc1,
             bc2);
  });

  m.def("topk", [](const py::array& scores, int64_t k, py::array& idx, py::array& vals) {
    int64_t E = last_dim(scores), N = E ? scores.size() / E : 0;
    int dt = check(scores, "scores", FLOATS);
    if (k < 1 || k > E) throw py::value_error("topk: k=" + std::to_string(k) + " must be in [1, " + std::to_string(E) + "]");
    check(idx, "idx", I64ONLY, N * k), check(vals, "vals", 1u << dt, N * k);
    py::gil_scoped_release g;
    pympar::topk(cp(scores), dt, N, E, k, mt<int64_t>(idx), mp(vals));
  });
  m.def("capacity_positions", [](const py::array& expert, int64_t n_expert, int64_t capacity, py::array& pos,
                                 py::array& counts) {
    int64_t A = expert.size();
    check(expert, "expert_idx", I64ONLY), check(pos, "pos", I64ONLY, A), check(counts, "counts", I64ONLY, n_expert);
    try {
      py::gil_scoped_release g;
      pympar::capacity_positions(ct<int64_t>(expert), A, n_expert, capacity, mt<int64_t>(pos), mt<int64_t>(counts));
    } catch (const std::out_of_range& e) {
      throw py::index_error(e.what());
    }
  });
  m.def("permute", [](const py::array& x, const py::array& rows, py::array& out) {
    if (!(x.flags() & py::array::c_style) || !(out.flags() & py::array::c_style))
      throw py::value_error("permute: x and out must be C-contiguous");
    int64_t N = x.ndim() ? x.shape(0) : 0, M = rows.size();
    check(rows, "rows", I64ONLY);
    int64_t row_bytes = N ? x.nbytes() / N : 0;
    if (!x.dtype().is(out.dtype()) || out.nbytes() != M * row_bytes)
      throw py::value_error("permute: out must have x's dtype and shape (len(rows),) + x.shape[1:]");
    const int64_t* r = rows_in_bounds(rows, M, N, "permute");
    py::gil_scoped_release g;
    pympar::permute_rows(static_cast<const char*>(x.data()), r, static_cast<char*>(out.mutable_data()), M, row_bytes);
  });
  m.def("unpermute_add", [](const py::array& y, const py::array& rows, py::object weights, py::array& out) {
    add_rows(y, rows, weights, out, "unpermute_add");
  });
  m.def("scatter_add", [](py::array& dst, const py::array& rows, const py::array& src) {
    add_rows(src, rows, py::none(), dst, "scatter_add");
  });

  m.def("cast", [](const py::array& src, py::array& dst) {
    int sdt = check(src, "src", FLOATS | HALVES);
    int ddt = check(dst, "dst", FLOATS | HALVES, src.size());
    if (sdt == F64 && (ddt == F16 || ddt == BF16))
      throw py::type_error("cast: float64 -> float16/bfloat16 is not offered natively (it would round twice)");
    py::gil_scoped_release g;
    K->cast(src.data(), sdt, dst.mutable_data(), ddt, src.size());
  });
  m.def("reduce_inplace", [](py::array& dst, const py::array& src, int op) {
    int dt = check(dst, "dst", FLOATS | HALVES | INTS);
    check(src, "src", 1u << dt, dst.size());
    if (op < 0 || op > 3) throw py::value_error("reduce_inplace: op code must be 0..3 (sum, max, min, prod)");
    py::gil_scoped_release g;
    K->reduce(dst.mutable_data(), src.data(), dt, op, dst.size());
  });
  m.def("scale_inplace", [](py::array& x, double alpha) {
    int dt = check(x, "x", FLOATS | HALVES | INTS);
    py::gil_scoped_release g;
    K->scale(x.mutable_data(), dt, alpha, x.size());
  });
}
