// Buffers a request holds while it runs, kept from one request to the next and given back
// once the process has been idle (issue 35: a server's memory after a burst of large
// requests).
//
// IdlePool<T>: one per type and process, a LIFO list of T (a request's buffers: the native
// backend's Scratch, a row pool thread's DenseNet::Workspace). IdleLease<T> takes the one
// given back last (still warm in cache) or makes one, and gives it back when it ends: the
// process holds as many as it runs requests at once, whatever its thread count. One
// reaper thread per process drops every T that has lain unused for kIdleRelease, so what a
// burst grew (two requests of 4,096 samples of the MLPerf DLRM: about 24 MB) goes back to
// the allocator within kIdleRelease of its end (and from jemalloc, the server's allocator,
// to the system within its dirty_decay_ms: triton_rec/triton/server.py; from glibc's malloc
// when the reaper trims it), while a steady load keeps reusing the same buffers. The
// reaper sleeps while no pool holds a T.
#pragma once

#include <dlfcn.h>
#include <malloc.h>
#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace triton_rec {

// How long a pool keeps a T that no request has used.
constexpr std::chrono::milliseconds kIdleRelease{1000};

using IdleClock = std::chrono::steady_clock;

class IdleReaper {
 public:
  // What the reaper calls: drops what lay idle since before `cutoff`; whether it dropped
  // any T and whether any T is left (to drop later).
  struct Dropped {
    bool any = false;
    bool left = false;
  };
  struct Pool {
    virtual Dropped drop_idle(IdleClock::time_point cutoff) = 0;
    virtual std::mutex& mutex() = 0;

   protected:
    ~Pool() = default;
  };

  static IdleReaper& instance() {
    static IdleReaper* r = new IdleReaper();  // never destroyed: its thread outlives statics
    return *r;
  }

  void watch(Pool* p) {
    std::lock_guard<std::mutex> lock(mu_);
    pools_.push_back(p);
  }

  // A pool holds a T now (called after its own lock is let go): the reaper runs (or is
  // started: in a process made by fork, the parent's thread is not there).
  void arm() {
    std::lock_guard<std::mutex> lock(mu_);
    ++armed_;
    if (!started_) {
      try {
        std::thread([this] { reap(); }).detach();
        started_ = true;
      } catch (const std::system_error&) {  // no thread: the pools keep their T
        return;
      }
    }
    wake_.notify_one();
  }

 private:
  IdleReaper() {
    // fork: no lock of the reaper or of a pool held by another thread is copied into the
    // child; the child starts its own reaper when it needs one
    pthread_atfork([] { instance().lock_all(); }, [] { instance().unlock_all(false); },
                   [] { instance().unlock_all(true); });
  }

  void lock_all() {
    mu_.lock();
    for (Pool* p : pools_) p->mutex().lock();
  }
  void unlock_all(bool child) {
    for (Pool* p : pools_) p->mutex().unlock();
    if (child) started_ = false;
    mu_.unlock();
  }

  void reap() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return armed_ != 0; });
      const uint64_t seen = armed_;
      const std::vector<Pool*> pools = pools_;
      lock.unlock();
      std::this_thread::sleep_for(kIdleRelease / 2);
      bool left = false;
      bool any = false;
      const IdleClock::time_point cutoff = IdleClock::now() - kIdleRelease;
      for (Pool* p : pools) {
        const Dropped d = p->drop_idle(cutoff);
        left = left || d.left;
        any = any || d.any;
      }
      if (any) release_freed();
      lock.lock();
      if (!left && armed_ == seen) armed_ = 0;  // nothing to drop: sleep until a pool holds one
    }
  }

  // After the reaper dropped something. jemalloc (the server's allocator, preloaded): what
  // it freed small enough for its own thread's cache goes back to the arenas, whose decay
  // gives the pages back. glibc's malloc (TRITON_REC_MALLOC=system) gives freed pages
  // back only at the top of its main heap, past a threshold it raises to twice the
  // largest block it mapped and unmapped: the arenas' free pages are given back now (4
  // instances of the MLPerf DLRM after batches up to 4,096: +28 to +40 MiB idle without,
  // +8 to +16 MiB with). A thread's arena's top it cannot shrink: holding glibc's trim
  // threshold low would, but then every large request maps and faults its buffers anew
  // (the floor at 1,024 samples served at half its rate: benchmarks/history/
  // 2026-12-07-allocator-trim-and-mapped-ranges.md).
  static void release_freed() {
    using Mallctl = int (*)(const char*, void*, size_t*, void*, size_t);
    static const auto mallctl = reinterpret_cast<Mallctl>(dlsym(RTLD_DEFAULT, "mallctl"));
    if (mallctl != nullptr) {
      mallctl("thread.tcache.flush", nullptr, nullptr, nullptr, 0);
    } else {
      malloc_trim(0);
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::vector<Pool*> pools_;
  uint64_t armed_ = 0;  // counts arm() since the reaper last found every pool empty
  bool started_ = false;
};

template <typename T>
class IdlePool final : IdleReaper::Pool {
 public:
  static IdlePool& instance() {
    static IdlePool* p = [] {
      auto* pool = new IdlePool();  // never destroyed, as the reaper
      IdleReaper::instance().watch(pool);
      return pool;
    }();
    return *p;
  }

  std::unique_ptr<T> take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        std::unique_ptr<T> t = std::move(free_.back().item);
        free_.pop_back();
        return t;
      }
    }
    return std::make_unique<T>();
  }

  void give_back(std::unique_ptr<T> t) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mu_);
      free_.push_back({std::move(t), IdleClock::now()});
    } catch (const std::bad_alloc&) {  // not kept: the next request makes another
      return;
    }
    IdleReaper::instance().arm();
  }

  // The Ts held now (tests: bindings).
  size_t held() {
    std::lock_guard<std::mutex> lock(mu_);
    return free_.size();
  }

 private:
  struct Idle {
    std::unique_ptr<T> item;
    IdleClock::time_point since;
  };

  IdleReaper::Dropped drop_idle(IdleClock::time_point cutoff) override {
    std::vector<Idle> dropped;  // freed after the lock is let go
    std::lock_guard<std::mutex> lock(mu_);
    // the list is in the order given back: the idle ones lead
    size_t n = 0;
    while (n < free_.size() && free_[n].since <= cutoff) ++n;
    if (n > 0) {
      dropped.assign(std::make_move_iterator(free_.begin()),
                     std::make_move_iterator(free_.begin() + static_cast<std::ptrdiff_t>(n)));
      free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(n));
    }
    return {n > 0, !free_.empty()};
  }
  std::mutex& mutex() override { return mu_; }

  std::mutex mu_;
  std::vector<Idle> free_;  // last given back last
};

// A T of IdlePool<T> for a scope.
template <typename T>
class IdleLease {
 public:
  IdleLease() : t_(IdlePool<T>::instance().take()) {}
  ~IdleLease() { IdlePool<T>::instance().give_back(std::move(t_)); }
  IdleLease(const IdleLease&) = delete;
  IdleLease& operator=(const IdleLease&) = delete;
  T& operator*() const { return *t_; }
  T* get() const { return t_.get(); }

 private:
  std::unique_ptr<T> t_;
};

}  // namespace triton_rec
