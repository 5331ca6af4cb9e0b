#include "threadpool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <exception>
#include <utility>
#include <mutex>
#include <thread>
#include <vector>

namespace pympar {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::atomic<int> g_spin_us{200};   // set_spin_us (pympar.kernels.set_spin_us; PYMPAR_SPIN_US at the edge)

// true once pred() holds, false when the spin budget ran out first
template <typename Pred>
bool spin_until(Pred pred) {
  if (pred()) return true;
  const int64_t budget = int64_t(g_spin_us.load(std::memory_order_relaxed)) * 1000;
  if (budget <= 0) return false;
  const int64_t t0 = now_ns();
  for (int i = 1;; ++i) {
    cpu_relax();
    if (pred()) return true;
    if ((i & 63) == 0 && now_ns() - t0 > budget) return false;
  }
}

// true on a pool worker, and on a caller while it runs its part: a parallel call made there runs
// inline (or, for run_concurrently, on temporary threads) without touching `busy` again
thread_local bool t_inside = false;

// Dispatch without locks on the hot path: the caller publishes a job by bumping `ticket_`
// (generation << 8 | number of parts, one word so a worker never pairs one generation with
// another's part count); idle workers spin on it for a while, then sleep on cv_. The caller runs
// part 0 itself and spins (then sleeps) until `pending_` reaches 0. The seq_cst pairs
// (ticket_ / sleepers_, pending_ / caller_waiting_) make a sleeper always see the new ticket or
// the poster always see the sleeper.
class Pool {
 public:
  static constexpr int kMaxThreads = 255;

  ~Pool() { resize(1); }

  std::mutex busy;  // held for a whole parallel call (and while resizing)

  void resize(int n) {
    std::lock_guard<std::mutex> b(busy);
    stop_workers();
    nthreads_ = std::max(1, std::min(n, kMaxThreads));   // set_num_threads refuses more (bindings)
    stop_.store(false);
    uint64_t t = ticket_.load();  // a new worker has seen every job so far
    for (int i = 1; i < nthreads_; ++i) workers_.emplace_back([this, i, t] { loop(i, t); });
  }

  int size() const { return nthreads_; }

  // after fork: the worker handles name threads of the parent; forget them without joining
  void abandon() { new std::vector<std::thread>(std::move(workers_)); }

  // job(i) for i in [0, parts) side by side; the caller holds `busy` and parts <= size()
  void run_parts(int parts, const std::function<void(int)>& job) {
    job_ = &job;
    error_ = nullptr;
    pending_.store(parts - 1);
    ticket_.store(((ticket_.load() >> 8) + 1) << 8 | uint64_t(parts));
    if (sleepers_.load() > 0) {
      { std::lock_guard<std::mutex> lk(m_); }
      cv_.notify_all();
    }
    t_inside = true;
    try {
      job(0);
    } catch (...) {
      keep_error();
    }
    t_inside = false;
    if (!spin_until([this] { return pending_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock<std::mutex> lk(m_);
      caller_waiting_.store(true);
      done_cv_.wait(lk, [this] { return pending_.load() == 0; });
      caller_waiting_.store(false);
    }
    job_ = nullptr;
    if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
  }

 private:
  void keep_error() {
    std::lock_guard<std::mutex> lk(err_m_);
    if (!error_) error_ = std::current_exception();
  }

  void loop(int id, uint64_t seen) {
    t_inside = true;
    for (;;) {
      if (!spin_until([&] { return ticket_.load(std::memory_order_acquire) != seen || stop_.load(); })) {
        std::unique_lock<std::mutex> lk(m_);
        sleepers_.fetch_add(1);
        cv_.wait(lk, [&] { return ticket_.load() != seen || stop_.load(); });
        sleepers_.fetch_sub(1);
      }
      if (stop_.load()) return;
      seen = ticket_.load();
      if (id >= int(seen & 0xff)) continue;  // fewer parts than threads this time
      try {
        (*job_)(id);
      } catch (...) {
        keep_error();
      }
      if (pending_.fetch_sub(1) == 1 && caller_waiting_.load()) {
        { std::lock_guard<std::mutex> lk(m_); }
        done_cv_.notify_one();
      }
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> pending_{0}, sleepers_{0};
  std::atomic<bool> caller_waiting_{false}, stop_{false};
  const std::function<void(int)>* job_ = nullptr;
  std::exception_ptr error_;
  std::mutex m_, err_m_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  int nthreads_ = 1;
};

// A forked child has the pool's memory but none of its worker threads (and possibly a mutex
// locked by a thread that no longer exists): it abandons that pool and builds a new one of the
// same size on first use. Pools are never destroyed: no joins during interpreter teardown.
std::atomic<bool> g_forked{false};
Pool* g_pool = nullptr;
std::once_flag g_once;

Pool& pool() {
  std::call_once(g_once, [] {
    g_pool = new Pool();
    pthread_atfork(nullptr, nullptr, [] { g_forked.store(true); });
  });
  if (g_forked.exchange(false)) {
    int n = g_pool->size();
    g_pool->abandon();
    g_pool = new Pool();
    g_pool->resize(n);
  }
  return *g_pool;
}

}  // namespace

void set_num_threads(int n) {
  if (n != pool().size()) pool().resize(n);
}
int get_num_threads() { return pool().size(); }

void set_spin_us(int us) { g_spin_us.store(std::max(0, us)); }
int max_threads() { return Pool::kMaxThreads; }
int get_spin_us() { return g_spin_us.load(); }

void parallel_for(int64_t n, int64_t grain, int64_t align, const std::function<void(int64_t, int64_t)>& fn) {
  Pool& p = pool();
  align = std::max<int64_t>(align, 1);
  int parts = static_cast<int>(std::min<int64_t>(p.size(), (n + grain - 1) / std::max<int64_t>(grain, 1)));
  std::unique_lock<std::mutex> busy(p.busy, std::defer_lock);
  if (parts <= 1 || t_inside || !busy.try_lock()) {
    if (n > 0) fn(0, n);
    return;
  }
  // chunk bounds, aligned so that vector loops and cache lines are not split
  int64_t per = (n + parts - 1) / parts;
  per = (per + align - 1) / align * align;
  p.run_parts(parts, [&](int i) {
    int64_t b = std::min<int64_t>(n, i * per), e = std::min<int64_t>(n, b + per);
    if (b < e) fn(b, e);
  });
}

void run_concurrently(int n, const std::function<void(int)>& fn) {
  if (n <= 1) {
    if (n == 1) fn(0);
    return;
  }
  Pool& p = pool();
  std::unique_lock<std::mutex> busy(p.busy, std::defer_lock);
  int on_pool = !t_inside && busy.try_lock() ? std::min(n, p.size()) : 1;
  std::vector<std::thread> extra;  // the jobs the pool cannot take: rare (pool in use, n > size)
  for (int i = on_pool; i < n; ++i) extra.emplace_back([&fn, i] { fn(i); });
  if (on_pool > 1)
    p.run_parts(on_pool, fn);
  else
    fn(0);
  for (auto& t : extra) t.join();
}

namespace {
std::atomic<int64_t> g_blas_calls{0};
}

int64_t blas_callback_calls() { return g_blas_calls.load(); }

extern "C" void pympar_blas_threads_callback(int /*sync*/, void (*dojob)(int, void*, int), int n,
                                             size_t elsize, void* jobdata, int arg) {
  g_blas_calls.fetch_add(1, std::memory_order_relaxed);
  // OpenBLAS always waits for the jobs it hands over (sync=1 in every release that has the hook)
  char* base = static_cast<char*>(jobdata);
  run_concurrently(n, [&](int i) { dojob(i, base + size_t(i) * elsize, arg); });
}

}  // namespace pympar
