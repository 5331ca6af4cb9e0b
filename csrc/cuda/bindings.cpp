// pympar._cuda: the pybind11 face of the CUDA kernels. Every array argument is an object with
// __cuda_array_interface__ (a CuPy array). Before any launch each binding checks what its kernel
// assumes -- the dtypes, element counts and shapes that must agree with each other, C order,
// outputs that are writable, memory on the current device -- and raises ValueError naming the
// argument, where a wrong call would otherwise read or write outside an allocation (the same
// checks csrc/bindings.cpp makes for the C++ kernels). pympar/kernels/cuda.py allocates the
// outputs. `stream` is CuPy's current stream as an integer; kernels launch asynchronously on
// it, the GIL released.
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "kernels_cuda.h"

namespace py = pybind11;
namespace K = pympar_cuda;
using K::ptr;

namespace {

enum : int { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5, OTHER = 6 };
constexpr unsigned FLOATS = (1u << F32) | (1u << F16) | (1u << BF16);  // storage the kernels take (math in f32)
constexpr unsigned KNOWN = (1u << OTHER) - 1;                          // every dtype with a code
constexpr unsigned ANY = ~0u;
const char* const kName[] = {"float32", "float64", "float16", "bfloat16", "int32", "int64", "another dtype"};

struct Arr {
  ptr p = 0;
  int dt = OTHER;
  int64_t itemsize = 0, size = 1;
  std::string typestr;
  std::vector<int64_t> shape;
  int ndim() const { return static_cast<int>(shape.size()); }
  int64_t dim(int i) const { return shape[i < 0 ? shape.size() + i : i]; }
};

[[noreturn]] void bad(const std::string& where, const std::string& what) { throw py::value_error(where + " " + what); }

std::string names(unsigned mask) {
  std::string out;
  for (int c = 0; c < OTHER; ++c)
    if (mask >> c & 1u) out += (out.empty() ? "" : ", ") + std::string(kName[c]);
  return out;
}

int code_of(const std::string& ts, int64_t* itemsize) {
  if (ts.size() < 3) return OTHER;
  char kind = ts[1];
  int64_t n = std::stoll(ts.substr(2));
  *itemsize = n;
  if (kind == 'f') return n == 4 ? F32 : n == 8 ? F64 : n == 2 ? F16 : OTHER;
  if (kind == 'V' && n == 2) return BF16;  // ml_dtypes' bfloat16
  if (kind == 'i') return n == 4 ? I32 : n == 8 ? I64 : OTHER;
  return OTHER;
}

// One binding's arguments: arr() checks each one's dtype, C order and writability, count() the
// element counts, and devices() -- last, after every cheap check -- that all of them are on the
// current device.
struct Args {
  const char* fn;
  std::vector<std::pair<const char*, ptr>> ptrs;

  std::string where(const char* name) const { return std::string(fn) + ": " + name; }

  Arr arr(const char* name, const py::handle& a, unsigned dtypes, bool out = false) {
    if (!py::hasattr(a, "__cuda_array_interface__"))
      bad(where(name), "must be a CUDA array (an object with __cuda_array_interface__, e.g. a CuPy array), not " +
                           py::str(py::type::of(a)).cast<std::string>());
    py::dict d = a.attr("__cuda_array_interface__");
    Arr r;
    for (auto s : d["shape"]) {
      r.shape.push_back(s.cast<int64_t>());
      r.size *= r.shape.back();
    }
    r.typestr = d["typestr"].cast<std::string>();
    r.dt = code_of(r.typestr, &r.itemsize);
    if (!(dtypes >> r.dt & 1u))
      bad(where(name), "has dtype " + r.typestr + " (" + kName[r.dt] + "); expected " + names(dtypes));
    py::tuple data = d["data"];
    r.p = data[0].cast<ptr>();
    if (out && data[1].cast<bool>()) bad(where(name), "is read-only, but the kernel writes it");
    if (d.contains("strides") && !d["strides"].is_none()) {  // None means C order
      py::tuple st = d["strides"];
      int64_t want = r.itemsize;
      for (int i = r.ndim() - 1; i >= 0; --i) {
        if (r.shape[i] > 1 && st[i].cast<int64_t>() != want) bad(where(name), "must be C-contiguous (its strides are not)");
        want *= r.shape[i];
      }
    }
    if (r.size > 0) ptrs.emplace_back(name, r.p);
    return r;
  }

  void count(const char* name, const Arr& a, int64_t n) const {
    if (a.size != n)
      bad(where(name), "has " + std::to_string(a.size) + " elements; expected " + std::to_string(n));
  }

  void devices() const {
    if (ptrs.empty()) return;
    int cur = K::current_device();
    for (auto& [name, p] : ptrs) {
      int dev = K::pointer_device(p);
      if (dev != cur)
        bad(where(name), dev < 0 ? std::string("is not in device memory (host memory cannot be read by the kernel)")
                                 : "is on device " + std::to_string(dev) + ", not on the current device " +
                                       std::to_string(cur));
    }
  }
};

unsigned only(int dt) { return 1u << dt; }

}  // namespace

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "pympar CUDA kernels (see pympar.kernels.cuda); arguments are CuPy arrays, checked before launch";
  using O = const py::object&;

  m.def("softmax_causal_forward", [](O x, O y, ptr stream) {
    Args A{"softmax_causal_forward"};
    Arr X = A.arr("x", x, FLOATS);
    if (X.ndim() < 2 || X.dim(-1) != X.dim(-2)) bad(A.where("x"), "must be (..., T, T)");
    Arr Y = A.arr("y", y, only(X.dt), true);
    A.count("y", Y, X.size);
    int64_t T = X.dim(-1), B = T ? X.size / (T * T) : 0;
    A.devices();
    py::gil_scoped_release g;
    K::softmax_causal_fwd(X.p, Y.p, X.dt, B, T, stream);
  });
  m.def("softmax_causal_backward", [](O y, O dy, O dx, ptr stream) {
    Args A{"softmax_causal_backward"};
    Arr Y = A.arr("y", y, FLOATS);
    if (Y.ndim() < 2 || Y.dim(-1) != Y.dim(-2)) bad(A.where("y"), "must be (..., T, T)");
    Arr DY = A.arr("dy", dy, only(Y.dt)), DX = A.arr("dx", dx, only(Y.dt), true);
    A.count("dy", DY, Y.size), A.count("dx", DX, Y.size);
    int64_t T = Y.dim(-1), B = T ? Y.size / (T * T) : 0;
    A.devices();
    py::gil_scoped_release g;
    K::softmax_causal_bwd(Y.p, DY.p, DX.p, Y.dt, B, T, stream);
  });

  m.def("attention_forward", [](O qkv, O o, O lse, double scale, ptr stream) {
    Args A{"attention_forward"};
    Arr Q = A.arr("qkv", qkv, FLOATS);
    if (Q.ndim() != 5 || Q.dim(2) != 3 || Q.dim(4) > 128)
      bad(A.where("qkv"), "must be (B, T, 3, H, D) with D <= 128");
    int64_t B = Q.dim(0), T = Q.dim(1), H = Q.dim(3), D = Q.dim(4);
    Arr Ob = A.arr("o", o, only(Q.dt), true), L = A.arr("lse", lse, only(F32), true);
    A.count("o", Ob, B * T * H * D), A.count("lse", L, B * H * T);
    A.devices();
    py::gil_scoped_release g;
    K::attention_fwd(Q.p, Ob.p, L.p, Q.dt, B, T, H, D, scale, stream);
  });
  m.def("attention_backward", [](O qkv, O o, O lse, O dout, O dqkv, O dvec, double scale, ptr stream) {
    Args A{"attention_backward"};
    Arr Q = A.arr("qkv", qkv, FLOATS);
    if (Q.ndim() != 5 || Q.dim(2) != 3 || Q.dim(4) > 128)
      bad(A.where("qkv"), "must be (B, T, 3, H, D) with D <= 128");
    int64_t B = Q.dim(0), T = Q.dim(1), H = Q.dim(3), D = Q.dim(4);
    Arr Ob = A.arr("o", o, only(Q.dt)), L = A.arr("lse", lse, only(F32)), DO = A.arr("dout", dout, only(Q.dt));
    Arr DQ = A.arr("dqkv", dqkv, only(Q.dt), true), DV = A.arr("dvec", dvec, only(F32), true);
    A.count("o", Ob, B * T * H * D), A.count("lse", L, B * H * T), A.count("dout", DO, B * T * H * D);
    A.count("dqkv", DQ, Q.size), A.count("dvec", DV, B * H * T);
    A.devices();
    py::gil_scoped_release g;
    K::attention_bwd(Q.p, Ob.p, L.p, DO.p, DQ.p, DV.p, Q.dt, B, T, H, D, scale, stream);
  });

  m.def("layernorm_forward", [](O x, O w, O b, O y, O mean, O rstd, double eps, ptr stream) {
    Args A{"layernorm_forward"};
    Arr X = A.arr("x", x, FLOATS);
    if (X.ndim() < 1) bad(A.where("x"), "must have at least one dimension");
    int64_t C = X.dim(-1), N = C ? X.size / C : 0;
    Arr W = A.arr("w", w, only(X.dt)), Bb = A.arr("b", b, only(X.dt)), Y = A.arr("y", y, only(X.dt), true);
    Arr M = A.arr("mean", mean, only(F32), true), R = A.arr("rstd", rstd, only(F32), true);
    A.count("w", W, C), A.count("b", Bb, C), A.count("y", Y, X.size), A.count("mean", M, N), A.count("rstd", R, N);
    A.devices();
    py::gil_scoped_release g;
    K::layernorm_fwd(X.p, W.p, Bb.p, Y.p, M.p, R.p, X.dt, N, C, eps, stream);
  });
  m.def("layernorm_backward_scratch", &K::layernorm_bwd_scratch);
  m.def("layernorm_backward", [](O dy, O x, O w, O mean, O rstd, O dx, O dw, O db, O scratch, ptr stream) {
    Args A{"layernorm_backward"};
    Arr X = A.arr("x", x, FLOATS);
    if (X.ndim() < 1) bad(A.where("x"), "must have at least one dimension");
    int64_t C = X.dim(-1), N = C ? X.size / C : 0;
    Arr DY = A.arr("dy", dy, only(X.dt)), W = A.arr("w", w, only(X.dt));
    Arr M = A.arr("mean", mean, only(F32)), R = A.arr("rstd", rstd, only(F32));
    Arr DX = A.arr("dx", dx, only(X.dt), true), DW = A.arr("dw", dw, only(F32), true);
    Arr DB = A.arr("db", db, only(F32), true), S = A.arr("scratch", scratch, only(F32), true);
    A.count("dy", DY, X.size), A.count("w", W, C), A.count("mean", M, N), A.count("rstd", R, N);
    A.count("dx", DX, X.size), A.count("dw", DW, C), A.count("db", DB, C);
    if (S.size < K::layernorm_bwd_scratch(N, C))
      bad(A.where("scratch"), "has " + std::to_string(S.size) + " elements; needs layernorm_backward_scratch(N, C) = " +
                                            std::to_string(K::layernorm_bwd_scratch(N, C)));
    A.devices();
    py::gil_scoped_release g;
    K::layernorm_bwd(DY.p, X.p, W.p, M.p, R.p, DX.p, DW.p, DB.p, S.p, X.dt, N, C, stream);
  });

  m.def("gelu_forward", [](O x, O y, ptr stream) {
    Args A{"gelu_forward"};
    Arr X = A.arr("x", x, FLOATS), Y = A.arr("y", y, only(X.dt), true);
    A.count("y", Y, X.size);
    A.devices();
    py::gil_scoped_release g;
    K::gelu_fwd(X.p, Y.p, X.dt, X.size, stream);
  });
  m.def("gelu_backward", [](O x, O dy, O dx, ptr stream) {  // dx may be dy or x itself: elementwise
    Args A{"gelu_backward"};
    Arr X = A.arr("x", x, FLOATS), DY = A.arr("dy", dy, only(X.dt)), DX = A.arr("dx", dx, only(X.dt), true);
    A.count("dy", DY, X.size), A.count("dx", DX, X.size);
    A.devices();
    py::gil_scoped_release g;
    K::gelu_bwd(X.p, DY.p, DX.p, X.dt, X.size, stream);
  });

  m.def("cross_entropy_forward", [](O logits, O targets, O loss, O lse, ptr stream) {
    Args A{"cross_entropy_forward"};
    Arr L = A.arr("logits", logits, FLOATS);
    if (L.ndim() != 2) bad(A.where("logits"), "must be (N, V)");
    int64_t N = L.dim(0), V = L.dim(1);
    Arr T = A.arr("targets", targets, only(I64)), LS = A.arr("loss", loss, only(F32), true);
    Arr E = A.arr("lse", lse, only(F32), true);
    A.count("targets", T, N), A.count("loss", LS, N), A.count("lse", E, N);
    A.devices();
    py::gil_scoped_release g;
    K::ce_fwd(L.p, T.p, LS.p, E.p, L.dt, N, V, stream);
  });
  m.def("cross_entropy_backward", [](O logits, O lse, O targets, O dloss, O dlogits, ptr stream) {
    Args A{"cross_entropy_backward"};  // dlogits may be logits itself: each element read, then written
    Arr L = A.arr("logits", logits, FLOATS);
    if (L.ndim() != 2) bad(A.where("logits"), "must be (N, V)");
    int64_t N = L.dim(0), V = L.dim(1);
    Arr E = A.arr("lse", lse, only(F32)), T = A.arr("targets", targets, only(I64));
    Arr D = A.arr("dloss", dloss, only(F32)), DL = A.arr("dlogits", dlogits, only(L.dt), true);
    A.count("lse", E, N), A.count("targets", T, N), A.count("dlogits", DL, L.size);
    if (D.size != 1 && D.size != N)
      bad(A.where("dloss"), "has " + std::to_string(D.size) + " elements; expected 1 or N = " + std::to_string(N));
    A.devices();
    py::gil_scoped_release g;
    K::ce_bwd(L.p, E.p, T.p, D.p, D.size == 1 ? 0 : 1, DL.p, L.dt, N, V, stream);
  });

  m.def("adamw_step", [](O p, O gr, O mo, O ve, double lr, double b1, double b2, double eps, double wd, double bc1,
                         double bc2, ptr stream) {
    Args A{"adamw_step"};
    Arr P = A.arr("p", p, only(F32), true), G = A.arr("g", gr, FLOATS);
    Arr M = A.arr("m", mo, only(F32), true), Vv = A.arr("v", ve, only(F32), true);
    A.count("g", G, P.size), A.count("m", M, P.size), A.count("v", Vv, P.size);
    A.devices();
    py::gil_scoped_release g;
    K::adamw(P.p, G.p, M.p, Vv.p, G.dt, P.size, lr, b1, b2, eps, wd, bc1, bc2, stream);
  });
  m.def("cast", [](O src, O dst, ptr stream) {
    Args A{"cast"};
    Arr S = A.arr("src", src, FLOATS), D = A.arr("dst", dst, FLOATS, true);
    A.count("dst", D, S.size);
    A.devices();
    py::gil_scoped_release g;
    K::cast(S.p, S.dt, D.p, D.dt, S.size, stream);
  });
  m.def("reduce_inplace", [](O dst, O src, int op, ptr stream) {
    Args A{"reduce_inplace"};
    Arr D = A.arr("dst", dst, KNOWN, true), S = A.arr("src", src, only(D.dt));
    A.count("src", S, D.size);
    if (op < 0 || op > 3) bad(A.where("op"), "must be 0..3 (sum, max, min, prod)");
    A.devices();
    py::gil_scoped_release g;
    K::reduce(D.p, S.p, D.dt, op, D.size, stream);
  });
  m.def("scale_inplace", [](O x, double alpha, ptr stream) {
    Args A{"scale_inplace"};
    Arr X = A.arr("x", x, KNOWN, true);
    A.devices();
    py::gil_scoped_release g;
    K::scale(X.p, X.dt, alpha, X.size, stream);
  });

  m.def("topk", [](O scores, int64_t k, O idx, O vals, ptr stream) {
    Args A{"topk"};
    Arr S = A.arr("scores", scores, FLOATS);
    if (S.ndim() != 2) bad(A.where("scores"), "must be (N, E)");
    int64_t N = S.dim(0), E = S.dim(1);
    Arr I = A.arr("idx", idx, only(I64), true), Vl = A.arr("vals", vals, only(S.dt), true);
    A.count("idx", I, N * k), A.count("vals", Vl, N * k);
    A.devices();
    py::gil_scoped_release g;
    K::topk(S.p, S.dt, N, E, k, I.p, Vl.p, stream);
  });
  m.def("capacity_positions", [](O expert, int64_t n_expert, int64_t capacity, O pos, O counts, ptr stream) {
    Args A{"capacity_positions"};  // the caller has checked 0 <= expert < n_expert (a device value)
    Arr E = A.arr("expert", expert, only(I64)), P = A.arr("pos", pos, only(I64), true);
    Arr C = A.arr("counts", counts, only(I64), true);
    A.count("pos", P, E.size), A.count("counts", C, n_expert);
    A.devices();
    py::gil_scoped_release g;
    K::capacity_positions(E.p, E.size, n_expert, capacity, P.p, C.p, stream);
  });
  m.def("permute", [](O x, O rows, O out, ptr stream) {
    Args A{"permute"};  // rows: in [0, x.shape[0]) (the caller wraps them)
    Arr X = A.arr("x", x, ANY);
    if (X.ndim() < 1) bad(A.where("x"), "must have at least one dimension");
    Arr R = A.arr("rows", rows, only(I64)), Ou = A.arr("out", out, ANY, true);
    if (Ou.typestr != X.typestr) bad(A.where("out"), "has dtype " + Ou.typestr + "; x has " + X.typestr);
    int64_t per_row = X.dim(0) ? X.size / X.dim(0) : 0;
    A.count("out", Ou, R.size * per_row);
    A.devices();
    py::gil_scoped_release g;
    K::permute_rows(X.p, R.p, Ou.p, R.size, per_row * X.itemsize, stream);
  });
  m.def("unpermute_add", [](O y, O order, O offsets, O w, O out, int64_t n_rows, ptr stream) {
    Args A{"unpermute_add"};
    Arr Y = A.arr("y", y, FLOATS);
    if (Y.ndim() != 2) bad(A.where("y"), "must be (M, C)");
    int64_t M = Y.dim(0), C = Y.dim(1);
    Arr Od = A.arr("order", order, only(I64)), Of = A.arr("offsets", offsets, only(I64));
    Arr Ou = A.arr("out", out, only(Y.dt), true);
    A.count("order", Od, M), A.count("offsets", Of, n_rows + 1), A.count("out", Ou, n_rows * C);
    ptr wp = 0;
    if (!w.is_none()) {
      Arr W = A.arr("w", w, only(Y.dt));
      A.count("w", W, M);
      wp = W.p;
    }
    A.devices();
    py::gil_scoped_release g;
    K::unpermute_add(Y.p, Od.p, Of.p, wp, Ou.p, Y.dt, n_rows, C, stream);
  });
}
