// A small persistent thread pool: exactly set_num_threads(n) threads run a parallel_for
// (the calling thread plus n-1 workers). Default 1: no worker threads exist at all, so an
// MPI job with many ranks per node never oversubscribes unless asked to.
//
// The same threads can also run the BLAS's parallel work (OpenBLAS's caller-managed threading,
// see blas_threads_callback), so that one set of n threads owns the cores for the whole step:
// no second pool spinning beside this one.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>

namespace pympar {

void set_num_threads(int n);   // n in 1..max_threads() (the bindings refuse more)
int get_num_threads();
int max_threads();

// How long an idle worker (and a waiting caller) spins before it sleeps, in microseconds.
// Spinning bridges the short gaps between back-to-back kernel calls of a training step.
void set_spin_us(int us);
int get_spin_us();

// Calls fn(begin, end) on disjoint chunks covering [0, n). Chunk boundaries are multiples of
// `align` (except the last). Work below `grain` items runs inline on the caller. When another
// call already holds the pool (two Python threads, or a call nested inside a chunk), this call
// runs inline too.
void parallel_for(int64_t n, int64_t grain, int64_t align,
                  const std::function<void(int64_t, int64_t)>& fn);

// Calls fn(i) for i in [0, n) with ALL n calls running at the same time (callers that make the
// jobs wait on each other, like OpenBLAS's threaded GEMM, need this). On the pool when it is free
// and has >= n threads; otherwise the jobs the pool cannot take run on temporary threads.
void run_concurrently(int n, const std::function<void(int)>& fn);

// OpenBLAS's caller-managed threading hook (openblas_set_threads_callback_function, OpenBLAS
// >= 0.3.27): runs dojob(i, jobdata + i * elsize, arg) for the n jobs on this pool.
int64_t blas_callback_calls();  // how many times OpenBLAS handed work to the hook (tests)
extern "C" void pympar_blas_threads_callback(int sync, void (*dojob)(int, void*, int), int n,
                                             size_t elsize, void* jobdata, int arg);

}  // namespace pympar
