// A batch's rows split across the cores no other call is using (the dense executor,
// dense_net.hpp): a large batch on a node whose Triton instances leave cores idle (one
// request at a time on a node of N cores) runs on more than one of them.
//
// How it decides (idle_parts): every predict in the process counts itself busy while it
// runs; a call may take 1 + (usable cores - busy calls) parts, at most one per
// kMinMacsPerPart multiply-adds of work and at most its own thread limit
// (TRITON_REC_DENSE_THREADS, default: the usable cores; 1 turns it off). So requests
// that arrive together each keep to their own core, and a lone large request spreads.
// Every row is computed the same way in any part (gemm.hpp, interaction.hpp), so the
// answers are the same bits however a batch is split.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace triton_rec {

// Work below which a part is not worth its hand-off to another thread (about 30 us).
constexpr int64_t kMinMacsPerPart = 2'000'000;

// The cores this process may run on (sched_getaffinity), at least 1.
inline int usable_cores() {
  static const int n = [] {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    const int c = CPU_COUNT(&set);
    return c > 0 ? c : 1;
  }();
  return n;
}

// TRITON_REC_DENSE_THREADS: a positive number caps the threads of one call (1: never
// split); unset, "auto" or 0: the usable cores. Anything else is refused at load.
inline int dense_threads_from_env() {
  const char* v = std::getenv("TRITON_REC_DENSE_THREADS");
  if (v == nullptr || *v == '\0' || std::string(v) == "auto") return usable_cores();
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 0 || n > 4096) {
    throw std::invalid_argument(std::string("TRITON_REC_DENSE_THREADS: not a thread count: ") + v);
  }
  return n == 0 ? usable_cores() : static_cast<int>(n);
}

// The calls running now, process-wide (a call counts itself while it runs).
inline std::atomic<int>& busy_calls() {
  static std::atomic<int> n{0};
  return n;
}

// How many parts a call takes (see the top of the file): 1 + the idle cores (usable cores
// - `busy` calls, itself included), at most `max_threads` and `most` (what its work is
// worth), at least 1.
inline int idle_parts(int64_t most, int max_threads, int busy) {
  const int idle = usable_cores() - busy;
  int64_t parts = 1 + (idle > 0 ? idle : 0);
  if (parts > max_threads) parts = max_threads;
  if (parts > most) parts = most;
  return parts < 1 ? 1 : static_cast<int>(parts);
}

// The parts `rows` rows of `macs_per_row` multiply-adds are worth: one per kMinMacsPerPart,
// at most one a row.
inline int64_t parts_worth(int64_t rows, int64_t macs_per_row) {
  const int64_t by_work = rows * macs_per_row / kMinMacsPerPart;
  return by_work < rows ? by_work : rows;
}

// TRITON_REC_DENSE_THREADS as the process read it first (dense_threads_from_env).
inline int default_max_threads() {
  static const int n = dense_threads_from_env();
  return n;
}

// A call's parts (idle_parts of `most` and `max_threads`), counted in busy_calls, the call
// and its other parts, while this lives.
class IdleParts {
 public:
  IdleParts(int64_t most, int max_threads = default_max_threads()) : busy_(busy_calls()) {
    parts_ = idle_parts(most, max_threads, busy_.fetch_add(1) + 1);
    busy_.fetch_add(parts_ - 1);
  }
  ~IdleParts() { busy_.fetch_sub(parts_); }
  IdleParts(const IdleParts&) = delete;
  IdleParts& operator=(const IdleParts&) = delete;
  int parts() const { return parts_; }

 private:
  std::atomic<int>& busy_;
  int parts_ = 1;
};

// The threads that take the other parts: started on first use (usable cores - 1), each
// waiting for a job; the calling thread takes parts too, so a call never waits for a
// thread to be free.
class RowPool {
 public:
  static RowPool& instance() {
    static RowPool* pool = new RowPool();  // never destroyed: its threads outlive statics
    return *pool;
  }

  // fn(part) for every part in [0, parts), on this thread and the pool's; returns when
  // all have run and no pool thread holds the job any more, rethrowing the first
  // exception. then_more: the caller runs another job right after this one (a chunk's
  // network after its lookups), so the pool threads that took a part wait for it
  // awake (kSpin) rather than go to sleep.
  void run(int parts, const std::function<void(int)>& fn, bool then_more = false) {
    if (parts <= 1) {
      fn(0);
      return;
    }
    Job job;
    job.fn = &fn;
    job.parts = parts;
    job.then_more = then_more;
    job.left.store(parts);
    {
      std::lock_guard<std::mutex> lock(mu_);
      job.inside = 1;  // this thread
      jobs_.push_back(&job);
      queued_.store(static_cast<int>(jobs_.size()), std::memory_order_release);
    }
    wake_.notify_all();
    work(&job);
    spin_until([&] { return job.left.load(std::memory_order_acquire) == 0; });
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock,
               [&] { return job.left.load(std::memory_order_relaxed) == 0 && job.inside == 0; });
    drop(&job);
    if (job.error) std::rethrow_exception(job.error);
  }

 private:
  // A caller whose parts other threads still run, or a pool thread after a part of a job
  // that another follows (then_more), waits this long before it sleeps (the parts' end, or
  // the next job, is most often that close: a sleeping thread is woken by the kernel, tens
  // of us on a VM). Not after every part: a thread spinning for a job that does not come
  // takes a core from the server's other threads (measured: benchmarks/history/
  // 2026-12-07-idle-buffers-and-parallel-lookups.md).
  static constexpr std::chrono::microseconds kSpin{100};
  template <typename Ready>
  static void spin_until(Ready&& ready) {
    const auto end = std::chrono::steady_clock::now() + kSpin;
    for (int i = 0;; ++i) {
      if (ready()) return;
      if ((i & 63) == 63 && std::chrono::steady_clock::now() >= end) return;
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
    }
  }

  struct Job {
    const std::function<void(int)>* fn = nullptr;
    int parts = 0;
    bool then_more = false;
    std::atomic<int> left{0};  // parts not yet finished: counted down under mu_, read by
                               // the caller's spin without it
    std::atomic<int> next{0};
    int inside = 0;  // threads in work(); under mu_
    std::exception_ptr error;
  };

  RowPool() {
    for (int i = 1; i < usable_cores(); ++i) {
      std::thread([this] { serve(); }).detach();
    }
  }

  void drop(Job* job) {  // under mu_
    for (size_t i = 0; i < jobs_.size(); ++i) {
      if (jobs_[i] == job) {
        jobs_.erase(jobs_.begin() + static_cast<std::ptrdiff_t>(i));
        queued_.store(static_cast<int>(jobs_.size()), std::memory_order_release);
        return;
      }
    }
  }

  // Takes parts of `job` until none is left (the caller counted itself in job->inside).
  void work(Job* job) {
    for (int p; (p = job->next.fetch_add(1)) < job->parts;) {
      std::exception_ptr error;
      try {
        (*job->fn)(p);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mu_);
      if (error && !job->error) job->error = error;
      job->left.fetch_sub(1, std::memory_order_release);
    }
    std::lock_guard<std::mutex> lock(mu_);
    drop(job);  // nothing left to take
    if (--job->inside == 0) done_.notify_all();
  }

  void serve() {
    bool next_soon = false;  // the last job taken said another follows
    for (;;) {
      Job* job = nullptr;
      if (next_soon) spin_until([&] { return queued_.load(std::memory_order_acquire) > 0; });
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, [&] { return !jobs_.empty(); });
        job = jobs_.front();
        if (job->next.load() >= job->parts) {  // all taken: not this thread's to wait for
          drop(job);
          continue;
        }
        ++job->inside;
        next_soon = job->then_more;
      }
      work(job);
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<Job*> jobs_;
  std::atomic<int> queued_{0};  // jobs_.size() (what an idle thread's spin reads)
};

}  // namespace triton_rec
