// Reproducible sums (pympar/comm/exact.py): a term's bits added into fixed 32-bit integer bins.
// One pass per term array, the same arithmetic as ExactSum.add's NumPy form (which stays the
// reference and the path without the native module); see exact.py for why the result does not
// depend on the order of the terms.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <limits>
#include <string>

#include "pyarrays.h"

namespace py = pybind11;

namespace {

constexpr int BIN = 32;
constexpr int64_t MASK = (int64_t(1) << BIN) - 1;

inline int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// add m * 2^e (|m| < 2^27) into element i's window of K bins whose top is top[i]
template <int K>
inline void add_part(int64_t m, int64_t e, int32_t& top, int64_t* bins) {
  if (m == 0) return;
  const int64_t lo_bin = floor_div(e, BIN);
  const uint64_t a = uint64_t(m < 0 ? -m : m) << (e - lo_bin * BIN);      // < 2^59
  const int64_t s = m < 0 ? -1 : 1;
  const int64_t lo = s * int64_t(a & uint64_t(MASK)), hi = s * int64_t(a >> BIN);
  const int64_t ptop = hi != 0 ? lo_bin + 1 : lo_bin;
  if (ptop > top) {                                  // raise the window: bins below it leave
    const int64_t d = ptop - top;
    for (int k = K - 1; k >= 0; --k) bins[k] = k - d >= 0 ? bins[k - d] : 0;
    top = int32_t(ptop);
  }
  const int64_t khi = top - (lo_bin + 1), klo = top - lo_bin;
  if (hi != 0 && khi >= 0 && khi < K) bins[khi] += hi;
  if (lo != 0 && klo >= 0 && klo < K) bins[klo] += lo;
}

template <typename T, int K>
int64_t add_all(const T* x, int64_t n, int32_t* top, int64_t* bins) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return i;              // refused before anything is added
  for (int64_t i = 0; i < n; ++i) {
    const T v = x[i];
    if (v == 0) continue;
    int E;
    const T f = std::frexp(v, &E);
    if (sizeof(T) == 4) {
      add_part<K>(int64_t(double(f) * 16777216.0), int64_t(E) - 24, top[i], bins + i * K);
    } else {
      const int64_t m = int64_t(double(f) * 9007199254740992.0), am = m < 0 ? -m : m, s = m < 0 ? -1 : 1;
      add_part<K>(s * (am >> 26), int64_t(E) - 53 + 26, top[i], bins + i * K);
      add_part<K>(s * (am & ((int64_t(1) << 26) - 1)), int64_t(E) - 53, top[i], bins + i * K);
    }
  }
  return -1;
}

// element i's window raised to new_top (>= top): bins below it leave
template <int K>
void raise_all(int32_t* top, int64_t* bins, const int32_t* new_top, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    if (new_top[i] <= top[i]) continue;
    const int64_t d = int64_t(new_top[i]) - top[i];
    int64_t* b = bins + i * K;
    for (int k = K - 1; k >= 0; --k) b[k] = k - d >= 0 ? b[k - d] : 0;
    top[i] = new_top[i];
  }
}

// 2^e as a double, -1022 <= e <= 1023 (a normal number: its exponent field alone)
inline double pow2(int64_t e) {
  const uint64_t bits = uint64_t(e + 1023) << 52;
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// the bins read as one float64 (bins unchanged): a normalised copy (each but the top one in
// [0, 2^32), the integer unchanged), Neumaier's compensated sum of each bin's exact value relative to
// the top bin, scaled by 2^(32 top) once; NaN where a non-finite term was added (top == bad)
template <int K>
void value_all(const int32_t* top, const int64_t* bins, double* out, int64_t n, int32_t none, int32_t bad) {
  for (int64_t i = 0; i < n; ++i) {
    if (top[i] == none) {
      out[i] = 0.0;
      continue;
    }
    if (top[i] == bad) {
      out[i] = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    int64_t b[K];
    for (int k = 0; k < K; ++k) b[k] = bins[i * K + k];
    for (int k = K - 1; k > 0; --k) {
      const int64_t carry = b[k] >> BIN;             // arithmetic shift: floor division
      b[k] -= carry * (int64_t(1) << BIN);
      b[k - 1] += carry;
    }
    double s = 0.0, c = 0.0;
    for (int k = 0; k < K; ++k) {
      const double v = double(b[k]) * pow2(-int64_t(k) * BIN);              // exact: a power of two
      const double u = s + v;
      c += std::fabs(s) >= std::fabs(v) ? (s - u) + v : (v - u) + s;
      s = u;
    }
    const int64_t e = int64_t(top[i]) * BIN;
    out[i] = e >= -1022 && e <= 1023 ? (s + c) * pow2(e) : std::ldexp(s + c, int(std::max<int64_t>(-3000, std::min<int64_t>(3000, e))));
  }
}

}  // namespace

namespace pympar::bind {

// a sum's top (int32, n) and bins (int64, n x kept) checked; kept (3 or 4)
static int checked_sum(const py::array& top, const py::array& bins, const char* kernel) {
  const int64_t n = top.size();
  check(top, (std::string(kernel) + " top").c_str(), 1u << I32);
  const int kept = n ? int(bins.size() / n) : 3;
  check(bins, (std::string(kernel) + " bins").c_str(), 1u << I64, n * kept);
  if (kept != 3 && kept != 4) throw py::value_error(std::string(kernel) + ": 3 or 4 bins per element");
  return kept;
}

void bind_exact(py::module_& m) {
  m.def("exact_add", [](const py::array& x, py::array& top, py::array& bins, int kept) {
    const int dt = check(x, "exact_add x", (1u << F32) | (1u << F64));
    const int64_t n = x.size();
    check(top, "exact_add top", 1u << I32, n);
    check(bins, "exact_add bins", 1u << I64, n * kept);
    if (!(top.writeable() && bins.writeable())) throw py::value_error("exact_add: top and bins must be writeable");
    if ((dt == F32 && kept != 3) || (dt == F64 && kept != 4)) throw py::value_error("exact_add: kept must be 3 (float32) or 4 (float64)");
    auto* t = static_cast<int32_t*>(top.mutable_data());
    auto* b = static_cast<int64_t*>(bins.mutable_data());
    int64_t bad;
    {
      py::gil_scoped_release g;
      bad = dt == F32 ? add_all<float, 3>(static_cast<const float*>(x.data()), n, t, b)
                      : add_all<double, 4>(static_cast<const double*>(x.data()), n, t, b);
    }
    return bad;
  }, "ExactSum.add's pass over one term array (pympar/comm/exact.py); returns the index of the first "
     "non-finite element (then nothing was added), or -1");
  m.def("exact_raise", [](py::array& top, py::array& bins, const py::array& new_top) {
    const int kept = checked_sum(top, bins, "exact_raise");
    check(new_top, "exact_raise new_top", 1u << I32, top.size());
    auto* t = static_cast<int32_t*>(top.mutable_data());
    auto* b = static_cast<int64_t*>(bins.mutable_data());
    const auto* nt = static_cast<const int32_t*>(new_top.data());
    const int64_t n = top.size();
    py::gil_scoped_release g;
    if (kept == 3) raise_all<3>(t, b, nt, n); else raise_all<4>(t, b, nt, n);
  }, "ExactSum's windows raised to new_top (pympar/comm/exact.py)");
  m.def("exact_value", [](const py::array& top, const py::array& bins, py::array& out, int none, int bad) {
    const int kept = checked_sum(top, bins, "exact_value");
    check(out, "exact_value out", 1u << F64, top.size());
    const auto* t = static_cast<const int32_t*>(top.data());
    const auto* b = static_cast<const int64_t*>(bins.data());
    auto* o = static_cast<double*>(out.mutable_data());
    const int64_t n = top.size();
    py::gil_scoped_release g;
    if (kept == 3) value_all<3>(t, b, o, n, none, bad); else value_all<4>(t, b, o, n, none, bad);
  }, "ExactSum.value: the bins read as float64, unchanged (pympar/comm/exact.py)");
}

}  // namespace pympar::bind
