// Where a pointer lives, for the bindings' boundary checks (bindings.cpp has no CUDA headers).
#include "common.cuh"
#include "kernels_cuda.h"

namespace pympar_cuda {

int pointer_device(ptr p) {
  cudaPointerAttributes a{};
  cudaError_t e = cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(p));
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear it: the next launch must not report this
    throw std::runtime_error(std::string("cannot query a pointer's device: ") + cudaGetErrorString(e));
  }
  return (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) ? a.device : -1;
}

int current_device() {
  int d = -1;
  cudaError_t e = cudaGetDevice(&d);
  if (e != cudaSuccess) throw std::runtime_error(std::string("no current CUDA device: ") + cudaGetErrorString(e));
  return d;
}

}  // namespace pympar_cuda
