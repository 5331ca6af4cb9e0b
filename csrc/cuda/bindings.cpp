// pympar._cuda: the pybind11 face of the CUDA kernels. Arguments are device pointers and CuPy's
// current stream as integers; pympar/kernels/cuda.py checks dtypes, contiguity and devices and
// allocates the outputs. Kernels are launched asynchronously on the given stream, GIL released.
#include <pybind11/pybind11.h>

#include "kernels_cuda.h"

namespace py = pybind11;
namespace K = pympar_cuda;
using K::ptr;

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "pympar CUDA kernels (see pympar.kernels.cuda)";
  auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("softmax_causal_forward", &K::softmax_causal_fwd, nogil);
  m.def("softmax_causal_backward", &K::softmax_causal_bwd, nogil);
  m.def("attention_forward", &K::attention_fwd, nogil);
  m.def("attention_backward", &K::attention_bwd, nogil);
  m.def("layernorm_forward", &K::layernorm_fwd, nogil);
  m.def("layernorm_backward_scratch", &K::layernorm_bwd_scratch);
  m.def("layernorm_backward", &K::layernorm_bwd, nogil);
  m.def("gelu_forward", &K::gelu_fwd, nogil);
  m.def("gelu_backward", &K::gelu_bwd, nogil);
  m.def("cross_entropy_forward", &K::ce_fwd, nogil);
  m.def("cross_entropy_backward", &K::ce_bwd, nogil);
  m.def("adamw_step", &K::adamw, nogil);
  m.def("cast", &K::cast, nogil);
  m.def("reduce_inplace", &K::reduce, nogil);
  m.def("scale_inplace", &K::scale, nogil);
  m.def("topk", &K::topk, nogil);
  m.def("capacity_positions", &K::capacity_positions, nogil);
  m.def("permute", &K::permute_rows, nogil);
  m.def("unpermute_add", &K::unpermute_add, nogil);
}
