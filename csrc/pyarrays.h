// Shared by the binding files (bindings.cpp, bindings_lowp.cpp): the arithmetic table in use and
// the checks an array passes before its pointer reaches a kernel.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "dtypes.h"
#include "kernels.h"

namespace pympar::bind {
namespace py = pybind11;

extern const KernelTable* K;   // the instruction-set build picked at import (bindings.cpp)

static inline int dtype_code(const py::array& a) {
  py::dtype d = a.dtype();
  char kind = d.kind();
  auto item = d.itemsize();
  if (kind == 'f') return item == 4 ? F32 : item == 8 ? F64 : item == 2 ? F16 : -1;
  if (kind == 'i') return item == 4 ? I32 : item == 8 ? I64 : -1;
  if (item == 2 && py::str(d.attr("name")).cast<std::string>() == "bfloat16") return BF16;
  return -1;
}

// the array, checked: dtype in `allowed` (a bit mask of DType codes), C-contiguous, `n` elements (n >= 0)
static inline int check(const py::array& a, const char* name, unsigned allowed, int64_t n = -1) {
  int dt = dtype_code(a);
  if (dt < 0 || !(allowed & (1u << dt)))
    throw py::type_error(std::string(name) + ": unsupported dtype " + py::str(a.dtype()).cast<std::string>());
  if (!(a.flags() & py::array::c_style))
    throw py::value_error(std::string(name) + ": array must be C-contiguous (pass np.ascontiguousarray(...))");
  if (n >= 0 && a.size() != n)
    throw py::value_error(std::string(name) + ": expected " + std::to_string(n) + " elements, got " +
                          std::to_string(a.size()));
  return dt;
}

constexpr unsigned FLOATS = (1u << F32) | (1u << F64);
constexpr unsigned HALVES = (1u << F16) | (1u << BF16);
constexpr unsigned INTS = (1u << I32) | (1u << I64);
constexpr unsigned I64ONLY = 1u << I64;

static inline const void* cp(const py::array& a) { return a.data(); }
static inline void* mp(py::array& a) { return a.mutable_data(); }

template <typename T> static inline const T* ct(const py::array& a) { return static_cast<const T*>(a.data()); }
template <typename T> static inline T* mt(py::array& a) { return static_cast<T*>(a.mutable_data()); }

static inline int64_t last_dim(const py::array& a) { return a.ndim() ? a.shape(a.ndim() - 1) : 1; }

static inline std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

void bind_lowp(py::module_& m);   // bindings_lowp.cpp
void bind_grouped(py::module_& m);   // grouped.cpp
void bind_exact(py::module_& m);  // exact.cpp
void bind_fastcoll(py::module_& m);  // fastcoll.cpp

}  // namespace pympar::bind
