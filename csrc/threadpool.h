// A small persistent thread pool: exactly set_num_threads(n) threads run a parallel_for
// (the calling thread plus n-1 workers). Default 1: no worker threads exist at all, so an
// MPI job with many ranks per node never oversubscribes unless asked to.
#pragma once
#include <cstdint>
#include <functional>

namespace pympar {

void set_num_threads(int n);
int get_num_threads();

// Calls fn(begin, end) on disjoint chunks covering [0, n). Chunk boundaries are multiples of
// `align` (except the last). Work below `grain` items runs inline on the caller. When another
// call already holds the pool (two Python threads), this call runs inline too.
void parallel_for(int64_t n, int64_t grain, int64_t align,
                  const std::function<void(int64_t, int64_t)>& fn);

}  // namespace pympar
