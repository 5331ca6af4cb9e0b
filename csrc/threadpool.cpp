#include "threadpool.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace pympar {
namespace {

class Pool {
 public:
  ~Pool() { resize(1); }

  void resize(int n) {
    std::lock_guard<std::mutex> busy(busy_);
    stop_workers();
    nthreads_ = std::max(1, n);
    stop_ = false;
    // a new worker has seen every job so far: it must not run the last one again
    uint64_t gen = generation_;
    for (int i = 1; i < nthreads_; ++i) workers_.emplace_back([this, i, gen] { loop(i, gen); });
  }

  int size() const { return nthreads_; }

  // after fork: the worker handles name threads of the parent; forget them without joining
  void abandon() { new std::vector<std::thread>(std::move(workers_)); }

  void run(int64_t n, int64_t grain, int64_t align, const std::function<void(int64_t, int64_t)>& fn) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    int parts = static_cast<int>(std::min<int64_t>(nthreads_, (n + grain - 1) / std::max<int64_t>(grain, 1)));
    if (!busy.owns_lock() || parts <= 1) {
      if (n > 0) fn(0, n);
      return;
    }
    // chunk bounds, aligned so that vector loops and cache lines are not split
    int64_t per = (n + parts - 1) / parts;
    per = (per + align - 1) / align * align;
    {
      std::lock_guard<std::mutex> lk(m_);
      fn_ = &fn;
      n_ = n;
      per_ = per;
      parts_ = parts;
      pending_ = parts - 1;
      ++generation_;
    }
    cv_.notify_all();
    chunk(0);
    std::unique_lock<std::mutex> lk(m_);
    done_cv_.wait(lk, [this] { return pending_ == 0; });
    fn_ = nullptr;
  }

 private:
  void chunk(int i) {
    int64_t b = std::min<int64_t>(n_, i * per_), e = std::min<int64_t>(n_, b + per_);
    if (b < e) (*fn_)(b, e);
  }

  void loop(int id, uint64_t seen) {
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(m_);
        cv_.wait(lk, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (id >= parts_) continue;  // fewer chunks than threads this time
      }
      chunk(id);
      std::lock_guard<std::mutex> lk(m_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lk(m_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::mutex busy_;  // held for a whole parallel_for (and while resizing)
  std::mutex m_;
  std::condition_variable cv_, done_cv_;
  std::vector<std::thread> workers_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, per_ = 0;
  int parts_ = 0, pending_ = 0, nthreads_ = 1;
  uint64_t generation_ = 0;
  bool stop_ = false;
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

void parallel_for(int64_t n, int64_t grain, int64_t align, const std::function<void(int64_t, int64_t)>& fn) {
  pool().run(n, grain, std::max<int64_t>(align, 1), fn);
}

}  // namespace pympar
