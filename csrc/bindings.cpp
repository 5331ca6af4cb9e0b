#include <pybind11/pybind11.h>
namespace py = pybind11;
static int g_threads = 1;
PYBIND11_MODULE(_C, m) {
  m.def("set_num_threads", [](int n) { g_threads = n; });
}
