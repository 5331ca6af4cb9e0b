// Grouped expert MLPs (nn/moe.py): a rank's local experts, each c_fc (C -> H), GELU, c_proj (H -> C),
// run over their token groups in ONE call instead of one Python MLP per expert. Groups are the
// expert-major rows of xs; each group runs in blocks of at most `block` rows, and every block makes
// exactly the products and elementwise passes nn.layers.MLP makes on it (the same cblas_?gemm with
// the same operands and transposes, the same bias/GELU/column-sum kernels, a first gradient written
// and later ones added by the GEMM), so the numbers are the per-expert loop's. Groups are spread over
// the kernel threads in ranges of about equal rows; a range runs its groups' products sequentially
// (the gemm function is MKL's sequential cblas_?gemm, located by kernels/gemm.py).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "pyarrays.h"
#include "threadpool.h"
#if defined(PYMPAR_AMX)
#include "amx.h"
#endif

namespace pympar::bind {
namespace {

constexpr int ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112;

template <typename T>
using Gemm = void (*)(int, int, int, int, int, int, T, const void*, int, const void*, int, T, void*, int);

template <typename T>
struct Ops;
template <>
struct Ops<float> {
  static void bias_gelu(float* h, const float* b, float* y, int64_t n, int64_t f) { K->bias_gelu_fwd_f32(h, b, y, n, f); }
  static void gelu(const float* x, float* y, int64_t n) { K->gelu_fwd_f32(x, y, n); }
  static void gelu_bwd(const float* x, const float* dy, float* dx, int64_t n) { K->gelu_bwd_f32(x, dy, dx, n); }
  static void bias_add(float* y, const float* b, int64_t n, int64_t f) { K->bias_add_f32(y, b, n, f); }
  static void column_sum(const float* x, float* o, int64_t n, int64_t f) { K->column_sum_f32(x, o, n, f); }
};
template <>
struct Ops<double> {
  static void bias_gelu(double* h, const double* b, double* y, int64_t n, int64_t f) { K->bias_gelu_fwd_f64(h, b, y, n, f); }
  static void gelu(const double* x, double* y, int64_t n) { K->gelu_fwd_f64(x, y, n); }
  static void gelu_bwd(const double* x, const double* dy, double* dx, int64_t n) { K->gelu_bwd_f64(x, dy, dx, n); }
  static void bias_add(double* y, const double* b, int64_t n, int64_t f) { K->bias_add_f64(y, b, n, f); }
  static void column_sum(const double* x, double* o, int64_t n, int64_t f) { K->column_sum_f64(x, o, n, f); }
};

// One expert's parameters (and, in backward, their gradients and whether each gradient is written
// fresh by its first contribution or added to).
template <typename T>
struct Expert {
  const T *wfc = nullptr, *bfc = nullptr, *wproj = nullptr, *bproj = nullptr;
  T *gwfc = nullptr, *gbfc = nullptr, *gwproj = nullptr, *gbproj = nullptr;
  bool fresh[4] = {false, false, false, false};
};

// the data pointer of list[i], checked: dtype dt, C-contiguous, n elements (a None bias: nullptr)
template <typename T>
T* ptr_of(const py::list& l, size_t i, int dt, int64_t n, const char* what, bool none_ok) {
  py::handle h = l[i];
  if (h.is_none()) {
    if (!none_ok) throw py::value_error(std::string(what) + ": None where an array is needed");
    return nullptr;
  }
  py::array a = py::reinterpret_borrow<py::array>(h);
  check(a, what, 1u << dt, n);
  return static_cast<T*>(const_cast<void*>(a.data()));
}

// ranges of groups of about equal rows, one per part (a part may be empty)
std::vector<int64_t> balanced(const std::vector<int64_t>& rows, int parts) {
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  std::vector<int64_t> b(parts + 1, static_cast<int64_t>(rows.size()));
  b[0] = 0;
  int64_t acc = 0, g = 0;
  for (int p = 1; p < parts; ++p) {
    const int64_t target = total * p / parts;
    while (g < static_cast<int64_t>(rows.size()) && acc + rows[g] / 2 < target) acc += rows[g++];
    b[p] = g;
  }
  return b;
}

void over_groups(const std::vector<int64_t>& rows, const std::function<void(int64_t)>& group) {
  const int parts = static_cast<int>(std::min<int64_t>(get_num_threads(), static_cast<int64_t>(rows.size())));
  if (parts <= 1) {
    for (size_t g = 0; g < rows.size(); ++g) group(static_cast<int64_t>(g));
    return;
  }
  const std::vector<int64_t> b = balanced(rows, parts);
  parallel_for(parts, 1, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t g = b[p]; g < b[p + 1]; ++g) group(g);
  });
}

// per-thread scratch of n elements (slot 0: a block's GELU output, slot 1: its hidden layer when
// the caller keeps none)
template <typename T>
T* scratch(int slot, int64_t n) {
  thread_local std::vector<T> buf[2];
  if (static_cast<int64_t>(buf[slot].size()) < n) buf[slot].resize(static_cast<size_t>(n));
  return buf[slot].data();
}

struct Groups {
  std::vector<int64_t> rows, lo;   // rows of each group and its first row in xs
};

Groups groups_of(const py::array& counts, int64_t M) {
  check(counts, "counts", I64ONLY);
  Groups g;
  const int64_t* c = static_cast<const int64_t*>(counts.data());
  int64_t at = 0;
  for (py::ssize_t i = 0; i < counts.size(); ++i) {
    if (c[i] < 0) throw py::value_error("grouped_mlp: a negative group size");
    g.rows.push_back(c[i]);
    g.lo.push_back(at);
    at += c[i];
  }
  if (at != M)
    throw py::value_error("grouped_mlp: the groups cover " + std::to_string(at) + " rows, xs has " +
                          std::to_string(M));
  return g;
}

// params: 4 per group (c_fc weight (H, C), c_fc bias (H,) or None, c_proj weight (C, H), c_proj bias
// (C,) or None); grads likewise (None for none) when given
template <typename T>
std::vector<Expert<T>> experts_of(const py::list& params, const py::list* grads, const bool* fresh, size_t G,
                                  int dt, int64_t C, int64_t H) {
  if (params.size() != 4 * G || (grads && grads->size() != 4 * G))
    throw py::value_error("grouped_mlp: 4 parameters (and 4 gradients) per group");
  std::vector<Expert<T>> ex(G);
  for (size_t g = 0; g < G; ++g) {
    Expert<T>& e = ex[g];
    e.wfc = ptr_of<T>(params, 4 * g, dt, H * C, "c_fc.weight", false);
    e.bfc = ptr_of<T>(params, 4 * g + 1, dt, H, "c_fc.bias", true);
    e.wproj = ptr_of<T>(params, 4 * g + 2, dt, C * H, "c_proj.weight", false);
    e.bproj = ptr_of<T>(params, 4 * g + 3, dt, C, "c_proj.bias", true);
    if (grads) {
      e.gwfc = ptr_of<T>(*grads, 4 * g, dt, H * C, "c_fc.weight grad", false);
      e.gbfc = ptr_of<T>(*grads, 4 * g + 1, dt, H, "c_fc.bias grad", true);
      e.gwproj = ptr_of<T>(*grads, 4 * g + 2, dt, C * H, "c_proj.weight grad", false);
      e.gbproj = ptr_of<T>(*grads, 4 * g + 3, dt, C, "c_proj.bias grad", true);
      if ((e.gbfc == nullptr) != (e.bfc == nullptr) || (e.gbproj == nullptr) != (e.bproj == nullptr))
        throw py::value_error("grouped_mlp: a bias and its gradient must both be given or both None");
      for (int k = 0; k < 4; ++k) e.fresh[k] = fresh[4 * g + k];
    }
  }
  return ex;
}

// grad (n,) of a bias += column sums of d (m, n): written when first, else summed apart and added
template <typename G, typename In, typename F>
void bias_grad(G* grad, const In* d, int64_t m, int64_t n, bool first, F column_sum) {
  if (first) {
    column_sum(d, grad, m, n);
    return;
  }
  std::vector<G> s(static_cast<size_t>(n));
  column_sum(d, s.data(), m, n);
  for (int64_t j = 0; j < n; ++j) grad[j] += s[j];
}

// One expert on cblas_?gemm (float32/float64). Every engine offers the same steps of MLP's forward and
// backward on a block of m rows; the drivers below run them over the groups and blocks.
template <typename T>
struct BlasExpert {
  using Elem = T;
  Gemm<T> gemm;
  const Expert<T>& e;
  int64_t C, H;

  // h (m, H) = x W_fc^T (+ b_fc), g = GELU(h): MLP._hidden's product and pass
  void hidden(const T* x, T* h, T* g, int64_t m) const {
    gemm(ROW_MAJOR, NO_TRANS, TRANS, int(m), int(H), int(C), T(1), x, int(C), e.wfc, int(C), T(0), h, int(H));
    if (e.bfc) Ops<T>::bias_gelu(h, e.bfc, g, m, H);
    else Ops<T>::gelu(h, g, m * H);
  }
  void out(const T* g, T* y, int64_t m) const {          // y (m, C) = g W_p^T (+ b_p)
    gemm(ROW_MAJOR, NO_TRANS, TRANS, int(m), int(C), int(H), T(1), g, int(H), e.wproj, int(H), T(0), y, int(C));
    if (e.bproj) Ops<T>::bias_add(y, e.bproj, m, C);
  }
  void gelu(const T* h, T* g, int64_t n) const { Ops<T>::gelu(h, g, n); }
  void gelu_bwd(const T* h, T* dg, int64_t n) const { Ops<T>::gelu_bwd(h, dg, dg, n); }
  void dg(const T* dy, T* out, int64_t m) const {        // dg (m, H) = dy W_p
    gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, int(m), int(H), int(C), T(1), dy, int(C), e.wproj, int(H), T(0), out, int(H));
  }
  void dx(const T* dh, T* out, int64_t m) const {        // dx (m, C) = dh W_fc
    gemm(ROW_MAJOR, NO_TRANS, NO_TRANS, int(m), int(C), int(H), T(1), dh, int(H), e.wfc, int(C), T(0), out, int(C));
  }
  // the weight gradients of one block (first: the group's first block -- a fresh gradient is
  // written there, added to after): c_proj's from dy and g, c_fc's from dh and x
  void proj_grads(const T* dy, const T* g, int64_t m, bool first) const {
    gemm(ROW_MAJOR, TRANS, NO_TRANS, int(C), int(H), int(m), T(1), dy, int(C), g, int(H),
         T(first && e.fresh[2] ? 0 : 1), e.gwproj, int(H));
    if (e.gbproj) bias_grad(e.gbproj, dy, m, C, first && e.fresh[3], Ops<T>::column_sum);
  }
  void fc_grads(const T* dh, const T* x, int64_t m, bool first) const {
    gemm(ROW_MAJOR, TRANS, NO_TRANS, int(H), int(C), int(m), T(1), dh, int(H), x, int(C),
         T(first && e.fresh[0] ? 0 : 1), e.gwfc, int(C));
    if (e.gbfc) bias_grad(e.gbfc, dh, m, H, first && e.fresh[1], Ops<T>::column_sum);
  }
};

// The drivers: every group (expert_of(g) -> its engine) in blocks of `block` rows.
template <typename T, typename Make>
void forward(const Groups& G, Make expert_of, const T* xs, T* h_all, T* ys, int64_t C, int64_t H, int64_t block) {
  over_groups(G.rows, [&](int64_t g) {
    const auto ex = expert_of(g);
    for (int64_t r0 = 0; r0 < G.rows[g]; r0 += block) {
      const int64_t m = std::min(block, G.rows[g] - r0), at = G.lo[g] + r0;
      T* h = h_all ? h_all + at * H : scratch<T>(1, m * H);
      T* gb = scratch<T>(0, m * H);
      ex.hidden(xs + at * C, h, gb, m);
      ex.out(gb, ys + at * C, m);
    }
  });
}

// Backward. g_keep == nullptr: the weight gradients too (MLP.backward's order: c_proj's before dg
// is written over g). Else the input gradient only (a zero-bubble B pass): each block's g and dh
// are kept in g_keep and dh_keep (M, H) for weight_grads (the W pass).
template <typename T, typename Make>
void backward(const Groups& G, Make expert_of, const T* xs, const T* dys, const T* h_all, T* dxs, int64_t C, int64_t H,
              int64_t block, T* g_keep, T* dh_keep) {
  const bool weights = g_keep == nullptr;
  over_groups(G.rows, [&](int64_t g) {
    const auto ex = expert_of(g);
    for (int64_t r0 = 0; r0 < G.rows[g]; r0 += block) {
      const int64_t m = std::min(block, G.rows[g] - r0), at = G.lo[g] + r0;
      const T* x = xs + at * C;
      const T* dy = dys + at * C;
      T* gb = weights ? scratch<T>(0, m * H) : g_keep + at * H;
      const T* h;
      if (h_all) {
        h = h_all + at * H;
        ex.gelu(h, gb, m * H);
      } else {                                      // recomputed, as MLP._backward_rows does
        T* hb = scratch<T>(1, m * H);
        ex.hidden(x, hb, gb, m);
        h = hb;
      }
      if (weights) ex.proj_grads(dy, gb, m, r0 == 0);
      T* dg = weights ? gb : dh_keep + at * H;      // (over g when nothing keeps it)
      ex.dg(dy, dg, m);
      ex.gelu_bwd(h, dg, m * H);                    // dh, over dg
      if (weights) ex.fc_grads(dg, x, m, r0 == 0);
      ex.dx(dg, dxs + at * C, m);
    }
  });
}

// The W pass of a backward that kept g and dh: the same products on the same operands
template <typename T, typename Make>
void weight_grads(const Groups& G, Make expert_of, const T* xs, const T* dys, const T* g_keep, const T* dh_keep,
                  int64_t C, int64_t H, int64_t block) {
  over_groups(G.rows, [&](int64_t g) {
    const auto ex = expert_of(g);
    for (int64_t r0 = 0; r0 < G.rows[g]; r0 += block) {
      const int64_t m = std::min(block, G.rows[g] - r0), at = G.lo[g] + r0;
      ex.proj_grads(dys + at * C, g_keep + at * H, m, r0 == 0);
      ex.fc_grads(dh_keep + at * H, xs + at * C, m, r0 == 0);
    }
  });
}

int64_t dims(const py::array& xs, const py::list& params, int64_t* C, int64_t* H) {
  if (xs.ndim() != 2) throw py::value_error("grouped_mlp: xs must be 2-D (rows, C)");
  *C = xs.shape(1);
  if (params.size() == 0) {
    *H = 0;
    return xs.shape(0);
  }
  py::array w = py::reinterpret_borrow<py::array>(params[0]);
  if (w.ndim() != 2 || w.shape(1) != *C) throw py::value_error("grouped_mlp: c_fc.weight must be (H, C)");
  *H = w.shape(0);
  return xs.shape(0);
}

// an optional array argument: its data (checked: dtype dt, C-contiguous, n elements), or nullptr for None
void* optional(const py::object& o, int dt, int64_t n, const char* what) {
  if (o.is_none()) return nullptr;
  py::array a = py::reinterpret_borrow<py::array>(o);
  check(a, what, 1u << dt, n);
  return a.mutable_data();
}

const bool* fresh_of(const py::object& o, size_t G) {
  if (o.is_none()) return nullptr;
  py::array a = py::reinterpret_borrow<py::array>(o);
  if (a.dtype().kind() != 'b' || a.size() != static_cast<py::ssize_t>(4 * G) || !(a.flags() & py::array::c_style))
    throw py::value_error("grouped_mlp_backward: fresh must be a contiguous bool array, 4 per group");
  return static_cast<const bool*>(a.data());
}

// the three modes of a backward call: everything (fresh), the input gradient (keeps), the weights (all three,
// no dxs)
void mode_check(bool fresh, bool keeps, bool dx) {
  if ((fresh && !keeps && dx) || (!fresh && keeps && dx) || (fresh && keeps && !dx)) return;
  throw py::value_error("grouped_mlp_backward: give (grads, fresh, dxs), (g_keep, dh_keep, dxs) or "
                        "(grads, fresh, g_keep, dh_keep)");
}

void need(uintptr_t fn, int64_t block) {
  if (fn == 0 || block < 1) throw py::value_error("grouped_mlp: need a gemm function and block >= 1");
}

#if defined(PYMPAR_AMX)
// bf16 experts on AMX tiles or AVX512-BF16 dot products: the products nn.layers.Linear makes through
// kernels/gemm.product_bf16 (amx or avx512bf16 engine) with the same arguments -- each weight's bf16 compute copy, packed where the caller
// found its pack -- and lowp.cpp's elementwise passes. Per group, 12 addresses (0: none):
//   0 Wfc (H, C) bf16   1 pack of Wfc^T (C -> H)   2 pack of Wfc (H -> C)   3 b_fc float32 (H,)
//   4 Wp (C, H) bf16    5 pack of Wp^T (H -> C)    6 pack of Wp (C -> H)    7 b_p float32 (C,)
//   8..11 the float32 gradients of Wfc, b_fc, Wp, b_p (backward only)
constexpr int SLOTS = 12;
using u16 = uint16_t;

// C (m, n) = A (m, k) B: A row-major (lda); B the weight w (its (k, n) view given by sk, sn) or its pack
void amx_product(const u16* a, int64_t sam, int64_t sak, const int64_t* e, int w, int pack, int64_t sk, int64_t sn,
                 int64_t m, int64_t n, int64_t k, const amx::Out& o, amx::Engine eng) {
  const u16* b = reinterpret_cast<const u16*>(e[pack] ? e[pack] : e[w]);
  amx::gemm(a, sam, sak, b, sk, sn, e[pack] != 0, m, n, k, o, eng);
}

amx::Out bf16_out(u16* c, int64_t ldc, const float* bias, u16* g) {
  amx::Out o;
  o.mode = amx::Out::BF16;
  o.c = c;
  o.ldc = ldc;
  o.bias = bias;
  o.g = g;
  o.ldg = ldc;
  return o;
}

amx::Out f32_out(float* c, int64_t ldc, bool accumulate) {
  amx::Out o;
  o.c = c;
  o.ldc = ldc;
  o.accumulate = accumulate;
  return o;
}

// One expert on AMX tiles or AVX512-BF16 dot products (eng): e its 12 addresses (SLOTS), fr its 4 fresh
// flags (backward)
struct AmxExpert {
  using Elem = u16;
  const int64_t* e;
  const bool* fr;
  int64_t C, H;
  amx::Engine eng;

  const float* f(int slot) const { return reinterpret_cast<const float*>(e[slot]); }
  float* grad(int slot) const { return reinterpret_cast<float*>(e[slot]); }
  // h = round(x Wfc^T + b), g = round(GELU(h)) (with a bias: one epilogue; without: the GELU pass after)
  void hidden(const u16* x, u16* h, u16* g, int64_t m) const {
    amx_product(x, C, 1, e, 0, 1, 1, C, m, H, C, bf16_out(h, H, f(3), f(3) ? g : nullptr), eng);
    if (!f(3)) K->gelu_fwd_bf16(h, g, m * H);
  }
  void out(const u16* g, u16* y, int64_t m) const { amx_product(g, H, 1, e, 4, 5, 1, H, m, C, H, bf16_out(y, C, f(7), nullptr), eng); }
  void gelu(const u16* h, u16* g, int64_t n) const { K->gelu_fwd_bf16(h, g, n); }
  void gelu_bwd(const u16* h, u16* dg, int64_t n) const { K->gelu_bwd_bf16(h, dg, dg, n); }
  void dg(const u16* dy, u16* out, int64_t m) const { amx_product(dy, C, 1, e, 4, 6, H, 1, m, H, C, bf16_out(out, H, nullptr, nullptr), eng); }
  void dx(const u16* dh, u16* out, int64_t m) const { amx_product(dh, H, 1, e, 0, 2, C, 1, m, C, H, bf16_out(out, C, nullptr, nullptr), eng); }
  void proj_grads(const u16* dy, const u16* g, int64_t m, bool first) const {   // dW (C, H) = dy^T g, float32
    amx::gemm(dy, 1, C, g, H, 1, false, C, H, m, f32_out(grad(10), H, !(first && fr[2])), eng);
    if (e[11]) bias_grad(grad(11), dy, m, C, first && fr[3], K->column_sum_bf16);
  }
  void fc_grads(const u16* dh, const u16* x, int64_t m, bool first) const {     // dW (H, C) = dh^T x
    amx::gemm(dh, 1, H, x, C, 1, false, H, C, m, f32_out(grad(8), C, !(first && fr[0])), eng);
    if (e[9]) bias_grad(grad(9), dh, m, H, first && fr[1], K->column_sum_bf16);
  }
};
#endif

#if defined(PYMPAR_AMX)
amx::Engine engine_of(bool tiles, int64_t block, const char* what) {
  if (block < 1) throw py::value_error(std::string(what) + ": block must be >= 1");
  return amx::engine_for(tiles, what);
}
#endif

const int64_t* addresses(const py::array& a, size_t G) {
  check(a, "addresses", I64ONLY, static_cast<int64_t>(G) * 12);
  return static_cast<const int64_t*>(a.data());
}

}  // namespace

void bind_grouped(py::module_& m) {
#if defined(PYMPAR_AMX)
  // bf16 experts on AMX tiles (tiles) or AVX512-BF16 dot products (the amx and avx512bf16 engines of
  // kernels/gemm.py); the caller (nn/moe.py) gives each group's 12 addresses (see SLOTS above) and has
  // checked their arrays; xs, ys, h, dys, dxs bf16 (M, C|H)
  m.def("grouped_mlp_forward_bf16", [](const py::array& xs, const py::array& counts, const py::array& addrs,
                                       int64_t H, py::object h, py::array& ys, int64_t block, bool tiles) {
    const amx::Engine eng = engine_of(tiles, block, "grouped_mlp_forward_bf16");
    const int64_t M = xs.ndim() == 2 ? xs.shape(0) : -1, C = xs.ndim() == 2 ? xs.shape(1) : 0;
    check(xs, "xs", 1u << BF16, M * C), check(ys, "ys", 1u << BF16, M * C);
    Groups G = groups_of(counts, M);
    const int64_t* ad = addresses(addrs, G.rows.size());
    u16* hp = static_cast<u16*>(optional(h, BF16, M * H, "h"));
    py::gil_scoped_release r;
    forward<u16>(G, [&](int64_t g) { return AmxExpert{ad + g * SLOTS, nullptr, C, H, eng}; },
                 static_cast<const u16*>(xs.data()), hp, static_cast<u16*>(ys.mutable_data()), C, H, block);
  });
  // backward in three modes: (fresh, no keeps) everything; (no fresh, keeps) the input gradient with
  // each block's g and dh kept in g_keep, dh_keep (M, H) (a zero-bubble B pass); (fresh, keeps, no dxs)
  // the weight gradients from them (its W pass)
  m.def("grouped_mlp_backward_bf16", [](const py::array& xs, const py::array& dys, const py::array& counts,
                                        const py::array& addrs, py::object fresh, int64_t H, py::object h,
                                        py::object dxs, int64_t block, py::object g_keep, py::object dh_keep, bool tiles) {
    const amx::Engine eng = engine_of(tiles, block, "grouped_mlp_backward_bf16");
    const int64_t M = xs.ndim() == 2 ? xs.shape(0) : -1, C = xs.ndim() == 2 ? xs.shape(1) : 0;
    check(xs, "xs", 1u << BF16, M * C), check(dys, "dys", 1u << BF16, M * C);
    Groups G = groups_of(counts, M);
    const int64_t* ad = addresses(addrs, G.rows.size());
    const bool* fr = fresh_of(fresh, G.rows.size());
    const u16* hp = static_cast<const u16*>(optional(h, BF16, M * H, "h"));
    u16* gk = static_cast<u16*>(optional(g_keep, BF16, M * H, "g_keep"));
    u16* dk = static_cast<u16*>(optional(dh_keep, BF16, M * H, "dh_keep"));
    u16* dx = static_cast<u16*>(optional(dxs, BF16, M * C, "dxs"));
    mode_check(fr != nullptr, gk != nullptr && dk != nullptr, dx != nullptr);
    py::gil_scoped_release r;
    const u16 *x = static_cast<const u16*>(xs.data()), *dy = static_cast<const u16*>(dys.data());
    auto expert_of = [&](int64_t g) { return AmxExpert{ad + g * SLOTS, fr ? fr + 4 * g : nullptr, C, H, eng}; };
    if (dx) backward<u16>(G, expert_of, x, dy, hp, dx, C, H, block, fr ? nullptr : gk, fr ? nullptr : dk);
    else weight_grads<u16>(G, expert_of, x, dy, gk, dk, C, H, block);
  });
#endif

  m.def("grouped_mlp_forward", [](uintptr_t fn, const py::array& xs, const py::array& counts, const py::list& params,
                                  py::object h, py::array& ys, int64_t block) {
    need(fn, block);
    int64_t C, H;
    const int64_t M = dims(xs, params, &C, &H);
    const int dt = check(xs, "xs", FLOATS, M * C);
    check(ys, "ys", 1u << dt, M * C);
    Groups G = groups_of(counts, M);
    void* hp = optional(h, dt, M * H, "h");
    auto run = [&](auto zero) {
      using T = decltype(zero);
      auto ex = experts_of<T>(params, nullptr, nullptr, G.rows.size(), dt, C, H);
      auto gemm = reinterpret_cast<Gemm<T>>(fn);
      py::gil_scoped_release r;
      forward<T>(G, [&](int64_t g) { return BlasExpert<T>{gemm, ex[g], C, H}; }, ct<T>(xs), static_cast<T*>(hp),
                 mt<T>(ys), C, H, block);
    };
    if (dt == F32) run(0.0f);
    else run(0.0);
  }, "ys = the groups' MLPs of xs (groups of `counts` rows, 4 parameters each); h (or None) keeps c_fc's output");

  m.def("grouped_mlp_backward", [](uintptr_t fn, const py::array& xs, const py::array& dys, const py::array& counts,
                                   const py::list& params, py::object grads, py::object fresh, py::object h,
                                   py::object dxs, int64_t block, py::object g_keep, py::object dh_keep) {
    need(fn, block);
    int64_t C, H;
    const int64_t M = dims(xs, params, &C, &H);
    const int dt = check(xs, "xs", FLOATS, M * C);
    check(dys, "dys", 1u << dt, M * C);
    Groups G = groups_of(counts, M);
    const bool* fr = fresh_of(fresh, G.rows.size());
    const void* hp = optional(h, dt, M * H, "h");
    void* gk = optional(g_keep, dt, M * H, "g_keep");
    void* dk = optional(dh_keep, dt, M * H, "dh_keep");
    void* dx = optional(dxs, dt, M * C, "dxs");
    mode_check(fr != nullptr, gk != nullptr && dk != nullptr, dx != nullptr);
    py::list gl = fr ? py::reinterpret_borrow<py::list>(grads) : py::list();
    auto run = [&](auto zero) {
      using T = decltype(zero);
      auto ex = experts_of<T>(params, fr ? &gl : nullptr, fr, G.rows.size(), dt, C, H);
      auto gemm = reinterpret_cast<Gemm<T>>(fn);
      py::gil_scoped_release r;
      auto expert_of = [&](int64_t g) { return BlasExpert<T>{gemm, ex[g], C, H}; };
      if (dx)
        backward<T>(G, expert_of, ct<T>(xs), ct<T>(dys), static_cast<const T*>(hp), static_cast<T*>(dx), C, H, block,
                    fr ? nullptr : static_cast<T*>(gk), fr ? nullptr : static_cast<T*>(dk));
      else
        weight_grads<T>(G, expert_of, ct<T>(xs), ct<T>(dys), static_cast<const T*>(gk), static_cast<const T*>(dk), C, H,
                        block);
    };
    if (dt == F32) run(0.0f);
    else run(0.0);
  }, "the groups' backward: (grads, fresh) everything; (g_keep, dh_keep) the input gradient only, keeping "
     "what the weight gradients need; (grads, fresh, keeps, dxs None) those weight gradients");
}

}  // namespace pympar::bind
