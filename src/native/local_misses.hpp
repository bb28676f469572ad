// The misses of a cache whose table is node-local (issue 25): what
// CachedTable.finish_query (triton_rec/cache/cached_table.py) does with them, in C++ and
// without the GIL. Used by the native backend's hot path (src/triton_backend/trec/, through the
// address a table's native plan hands it) and by CachedTable itself (bindings_local_misses.cpp), so
// both request paths run this one implementation for node-local tables; CachedTable's
// Python rules serve the tier stores (Redis, RocksDB) and are held to this one by
// tests/unit/test_local_misses.py.
//
// HPS's rules (the module docstring of cached_table.py): per request and table, the hit
// rate over the request's distinct keys; at or above `hit_rate_threshold` the misses are
// answered with the default value and queued for a background insert (InsertQueue),
// below it they are fetched from the table now, answered and inserted. A static table,
// a threshold above 1.0 or a request asking for `exact` answers always fetches.
#pragma once

#include <pthread.h>
#include <time.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "hash_index.hpp"
#include "request_kernels.hpp"
#include "seam.hpp"
#include "shm_cache.hpp"

namespace triton_rec {

// CLOCK_MONOTONIC nanoseconds: what Python's time.perf_counter_ns reads.
inline uint64_t monotonic_ns() noexcept {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000ull + static_cast<uint64_t>(ts.tv_nsec);
}

class LocalMisses;
class MissCache;

// One cache's insert among the inserts of a request's tables (PendingInserts).
struct PendingInsert {
  const MissCache* cache;
  const int64_t* keys;
  size_t n;
  const uint8_t* rows;  // [n, cache->format().row_bytes]
};

// The cache LocalMisses puts the rows it fetched into. Thread-safe: insert may run in any
// number of threads (the request threads and the InsertQueue's).
class MissCache {
 public:
  virtual ~MissCache() = default;
  // How the cache encodes rows (the table's rows go in as they are).
  virtual RowFormat format() const = 0;
  // Inserts (or overwrites) keys[0..n) with rows [n, format().row_bytes], by the cache's
  // policy; a key given twice: its last row.
  virtual void insert(const int64_t* keys, size_t n, const uint8_t* rows) const = 0;
  // Caches of the same non-null kind can write several caches' inserts together
  // (insert_together: the device caches of one GPU, one synchronization for all); null:
  // each cache inserts alone.
  virtual const void* kind() const { return nullptr; }
  // Inserts parts[0..n), each into its cache (all of this cache's kind()), together;
  // returns once every one is in its cache.
  virtual void insert_together(const PendingInsert* parts, size_t n) const {
    for (size_t i = 0; i < n; ++i) parts[i].cache->insert(parts[i].keys, parts[i].n, parts[i].rows);
  }
};

// The inserts of one request's tables, gathered while each table's misses are answered and
// written together once all are (the GPU paths: one write for every device cache of the
// request instead of a round trip per table). flush() returns once every insert is in its
// cache, before the request is answered: HPS's synchronous insert, as LocalMisses does it
// alone. One per thread; not thread-safe.
class PendingInserts {
 public:
  // Keeps a copy of keys[0..n) and their rows for cache; the write's time is added to
  // stats (the table's TableStat counters, may be null) when flushed.
  void add(const MissCache* cache, const int64_t* keys, size_t n, const uint8_t* rows,
           int64_t* stats) {
    if (n == 0) return;
    const size_t rb = cache->format().row_bytes;
    parts_.push_back({cache, stats, keys_.size(), n, rows_.size()});
    keys_.insert(keys_.end(), keys, keys + n);
    rows_.insert(rows_.end(), rows, rows + n * rb);
  }
  // Writes every insert (the caches of one kind together; a cache without a kind in a
  // group of its own) and forgets them, also when a write fails (its error is rethrown).
  // A group's write time goes to its tables' kCacheNs, shared by their keys.
  void flush() {
    struct Clear {
      PendingInserts* p;
      ~Clear() { p->clear(); }
    } clear{this};
    std::vector<PendingInsert> all;
    for (const Part& p : parts_) {
      all.push_back({p.cache, keys_.data() + p.key0, p.n, rows_.data() + p.row0});
    }
    std::vector<char> done(all.size(), 0);
    std::vector<PendingInsert> group;
    std::vector<size_t> members;
    for (size_t i = 0; i < all.size(); ++i) {
      if (done[i]) continue;
      const void* kind = all[i].cache->kind();
      group.clear();
      members.clear();
      size_t keys = 0;
      for (size_t j = i; j < all.size(); ++j) {
        if (!done[j] && (j == i || (kind != nullptr && all[j].cache->kind() == kind))) {
          group.push_back(all[j]);
          members.push_back(j);
          keys += all[j].n;
          done[j] = 1;
        }
      }
      const uint64_t t0 = monotonic_ns();
      group[0].cache->insert_together(group.data(), group.size());
      const double per_key = static_cast<double>(monotonic_ns() - t0) / static_cast<double>(keys);
      for (size_t j : members) {
        if (parts_[j].stats == nullptr) continue;
        count(parts_[j].stats, kCacheNs, static_cast<int64_t>(per_key * parts_[j].n));
      }
    }
  }
  void clear() {
    parts_.clear();
    keys_.clear();
    rows_.clear();
  }

 private:
  struct Part {
    const MissCache* cache;
    int64_t* stats;
    size_t key0, n, row0;
  };
  std::vector<Part> parts_;
  std::vector<int64_t> keys_;
  std::vector<uint8_t> rows_;
};

// Group commit: writes that are serialized anyway (a device cache: one writer at a time,
// under its writer lock, and a write is a round trip to the GPU) gathered into one. A
// thread whose item arrives while another thread writes waits, and the next write takes
// every item that waited, in arrival order. Each submit still returns only once its item
// is written (rethrowing the write's error); under contention N items cost one write
// instead of N one after the other.
template <class Item>
class GroupCommit {
 public:
  // Runs write(items) for a batch of items that holds `item`.
  template <class Write>
  void submit(const Item& item, Write&& write) {
    Pending p{item, false, nullptr};
    std::unique_lock<std::mutex> lock(mutex_);
    waiting_.push_back(&p);
    turn_.wait(lock, [&] { return p.done || !writing_; });
    if (!p.done) {  // nobody writes: this thread writes every item that waits
      writing_ = true;
      std::vector<Pending*> batch;
      batch.swap(waiting_);
      lock.unlock();
      std::exception_ptr failure;
      try {
        items_.clear();
        for (const Pending* q : batch) items_.push_back(q->item);
        write(items_);
      } catch (...) {
        failure = std::current_exception();
      }
      lock.lock();
      for (Pending* q : batch) {
        q->done = true;
        q->failure = failure;
      }
      writing_ = false;
      turn_.notify_all();
    }
    if (p.failure) std::rethrow_exception(p.failure);
  }

 private:
  struct Pending {
    Item item;
    bool done = false;
    std::exception_ptr failure;
  };
  std::mutex mutex_;
  std::condition_variable turn_;
  std::vector<Pending*> waiting_;
  bool writing_ = false;
  std::vector<Item> items_;  // the batch's items (by the writing thread only)
};

// Inserts into one cache, group-committed: one per cache per process (shared by its
// instances' MissCaches).
class InsertBatcher {
 public:
  // write(keys, n, rows): one write of n keys and their rows (row_bytes each).
  using Write = void (*)(void* target, const int64_t* keys, size_t n, const uint8_t* rows);
  explicit InsertBatcher(size_t row_bytes) : row_bytes_(row_bytes) {}

  // Inserts keys[0..n) with rows through write(target, ...), in one write with whatever
  // other inserts are waiting; returns once they are written (rethrows the write's error).
  void insert(const int64_t* keys, size_t n, const uint8_t* rows, Write write, void* target) {
    commit_.submit(Insert{keys, n, rows}, [&](const std::vector<Insert>& batch) {
      if (batch.size() == 1) {
        write(target, batch[0].keys, batch[0].n, batch[0].rows);
        return;
      }
      keys_.clear();
      rows_.clear();
      for (const Insert& q : batch) {  // in arrival order: a key given twice, its last row
        keys_.insert(keys_.end(), q.keys, q.keys + q.n);
        rows_.insert(rows_.end(), q.rows, q.rows + q.n * row_bytes_);
      }
      write(target, keys_.data(), keys_.size(), rows_.data());
    });
  }

 private:
  struct Insert {
    const int64_t* keys;
    size_t n;
    const uint8_t* rows;
  };
  const size_t row_bytes_;
  GroupCommit<Insert> commit_;
  std::vector<int64_t> keys_;  // the batch, gathered (by the writing thread only)
  std::vector<uint8_t> rows_;
};

// The inserts of several requests' caches (each request's PendingInserts, its parts),
// group-committed: a write takes the parts of every request that waited, in arrival
// order (a key written twice keeps its last row). One per kind of cache
// (MissCache::kind) per process: every part it writes is of that kind.
class PartsBatcher {
 public:
  // write(target, parts, n): one write of parts[0..n) (their caches' locks taken there).
  using Write = void (*)(const void* target, const PendingInsert* parts, size_t n);

  // Writes parts[0..n) through write(target, ...), with whatever other requests' parts
  // are waiting; returns once they are written (rethrows the write's error).
  void insert(const PendingInsert* parts, size_t n, Write write, const void* target) {
    commit_.submit(Request{parts, n}, [&](const std::vector<Request>& batch) {
      all_.clear();
      for (const Request& q : batch) all_.insert(all_.end(), q.parts, q.parts + q.n);
      write(target, all_.data(), all_.size());
    });
  }

 private:
  struct Request {
    const PendingInsert* parts;
    size_t n;
  };
  GroupCommit<Request> commit_;
  std::vector<PendingInsert> all_;  // the batch's parts (by the writing thread only)
};

// The shared-memory cache (shm_cache.hpp), which locks its own sets.
class ShmMissCache final : public MissCache {
 public:
  explicit ShmMissCache(const ShmCache& cache) : cache_(cache) {}
  RowFormat format() const override { return cache_.format(); }
  void insert(const int64_t* keys, size_t n, const uint8_t* rows) const override {
    cache_.insert(keys, n, rows);
  }

 private:
  const ShmCache cache_;
};

// The background inserter of an instance's node-local tables (BackgroundInserter of
// cached_table.py holds one beside its Python queue): one thread; at most `max_pending`
// batches wait (the one being inserted not counted), beyond that a batch is dropped rather
// than slowing the request down. A failed insert is counted and the next miss retries.
class InsertQueue {
 public:
  explicit InsertQueue(size_t max_pending) : max_pending_(max_pending) {
    worker_ = std::thread([this] { run(); });
    pthread_setname_np(worker_.native_handle(), "trec-insert");  // as top -H and perf show it
  }
  ~InsertQueue() { close(); }
  InsertQueue(const InsertQueue&) = delete;
  InsertQueue& operator=(const InsertQueue&) = delete;

  // Queues keys[0..n) of `table` for insertion; false when the queue is full or closed.
  bool submit(const LocalMisses* table, const int64_t* keys, size_t n) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_ || jobs_.size() >= max_pending_) return false;
    jobs_.push_back({table, std::vector<int64_t>(keys, keys + n)});
    wake_.notify_one();
    return true;
  }

  // Waits up to `seconds` until every queued batch is inserted; whether it was.
  bool drain(double seconds) {
    std::unique_lock<std::mutex> lock(mutex_);
    return idle_.wait_for(lock, std::chrono::duration<double>(seconds),
                          [&] { return jobs_.empty() && current_ == nullptr; });
  }

  // Drops the batches of `table` and waits for the one in progress (a table going away).
  void forget(const LocalMisses* table) {
    std::unique_lock<std::mutex> lock(mutex_);
    jobs_.erase(
        std::remove_if(jobs_.begin(), jobs_.end(), [&](const Job& j) { return j.table == table; }),
        jobs_.end());
    idle_.wait(lock, [&] { return current_ != table; });
  }

  // Stops the thread; queued batches are dropped (idempotent).
  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed_ = true;
      jobs_.clear();
    }
    wake_.notify_all();
    if (worker_.joinable()) worker_.join();
    idle_.notify_all();
  }

  size_t pending() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return jobs_.size() + (current_ != nullptr);
  }
  // Batches whose insert failed, and the last failure's message.
  std::pair<int64_t, std::string> failures() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {failures_, last_failure_};
  }

 private:
  struct Job {
    const LocalMisses* table;
    std::vector<int64_t> keys;
  };
  void run();  // below LocalMisses

  const size_t max_pending_;
  mutable std::mutex mutex_;
  std::condition_variable wake_, idle_;
  std::deque<Job> jobs_;
  const LocalMisses* current_ = nullptr;  // the table of the batch being inserted
  bool closed_ = false;
  int64_t failures_ = 0;
  std::string last_failure_;
  std::thread worker_;
};

// How a table answers its misses: its threshold, and whether a miss may be answered with
// the default and inserted in the background (a queue exists and the table is not static).
struct MissRules {
  double hit_rate_threshold = 1.0;
  bool deferrable = false;
};

// The misses of one table: a cache in front of the node-local table.
// Thread-safe: finish() may run in any number of threads; the views must outlive it.
class LocalMisses {
 public:
  LocalMisses(std::shared_ptr<const MissCache> cache, IndexView index, TableView table,
              float default_value, MissRules rules, InsertQueue* queue, int64_t* stats)
      : cache_(std::move(cache)), index_(index), table_(table), default_value_(default_value),
        rules_(rules), queue_(rules.deferrable ? queue : nullptr), stats_(stats) {
    const RowFormat f = cache_->format();
    if (f.precision != table.fmt.precision || f.dim != table.fmt.dim) {
      throw std::invalid_argument("the cache's rows and the table's rows differ in format");
    }
    if (rules_.deferrable && queue_ == nullptr) {
      throw std::invalid_argument("deferrable misses need an insert queue");
    }
  }
  ~LocalMisses() {
    if (queue_ != nullptr) queue_->forget(this);
  }
  LocalMisses(const LocalMisses&) = delete;
  LocalMisses& operator=(const LocalMisses&) = delete;

  int64_t dim() const noexcept { return static_cast<int64_t>(table_.fmt.dim); }

  // The rest of a cache query of keys[0..m) into out [m, dim] (hit[i]: whether key i hit;
  // `hits` of them, found in `query_ns`): counts the lookup and answers the misses. The
  // keys are those of `segments` requests, request j's in [bounds[j], bounds[j+1])
  // (bounds null: one request); exact[j]: request j asks for every miss fetched now (null:
  // none does). defaults [segments, kNumDefaultCauses]: each request's keys answered with
  // the default value are added here. `pending` (null: insert now): where the rows fetched
  // for the cache go instead, for the caller to write with other tables' (PendingInserts).
  // Throws CorruptIndexError on a corrupt table.
  void finish(const int64_t* keys, int64_t m, float* out, const uint8_t* hit, int64_t hits,
              uint64_t query_ns, const int64_t* bounds, int64_t segments, const uint8_t* exact,
              int64_t* defaults, PendingInserts* pending = nullptr) const {
    const int64_t one[2] = {0, m};
    if (bounds == nullptr || segments < 1) {
      bounds = one;
      segments = 1;
    }
    const int64_t misses = m - hits;
    count(stats_, kLookups, m);
    count(stats_, kHits, hits);
    if (misses == 0) {
      count(stats_, kCacheNs, static_cast<int64_t>(query_ns));
      return;
    }
    count(stats_, kMisses, misses);
    Scratch& s = scratch();
    const size_t dim = table_.fmt.dim;
    s.deferred.clear();
    s.fetch.clear();
    s.fetch_segment.clear();
    for (int64_t j = 0; j < segments; ++j) {
      const int64_t b = bounds[j], e = bounds[j + 1];
      int decided = -1;  // the request's rule, taken at its first miss (none: not needed)
      for (int64_t i = b; i < e; ++i) {
        if (hit[i] != 0) continue;
        if (decided < 0) {
          decided = deferred(keys + b, hit + b, e - b, exact != nullptr && exact[j] != 0, s);
        }
        if (decided == 1) {
          std::fill_n(out + i * dim, dim, default_value_);
          defaults[j * kNumDefaultCauses + kCauseAsync] += 1;
          s.deferred.push_back(keys[i]);
        } else {
          s.fetch.push_back(i);
          s.fetch_segment.push_back(j);
        }
      }
    }
    if (!s.deferred.empty()) {
      const auto n = static_cast<int64_t>(s.deferred.size());
      const bool queued = queue_->submit(this, s.deferred.data(), s.deferred.size());
      count(stats_, kDefaultAnswered, n);
      count(stats_, queued ? kQueued : kDropped, n);
    }
    if (s.fetch.empty()) {
      count(stats_, kCacheNs, static_cast<int64_t>(query_ns));
      return;
    }
    // The rest from the table now: gathered as it holds them (for the cache), decoded
    // into the answer; a key it lacks gets exactly the default and is not cached (each
    // later lookup asks again and is counted).
    const uint64_t t1 = monotonic_ns();
    s.fetch_keys.clear();
    for (int64_t i : s.fetch) s.fetch_keys.push_back(keys[i]);
    int64_t absent = 0;
    gather_rows(
        index_, table_, s.fetch_keys.data(), s.fetch.size(), &s.found_keys, &s.found_rows,
        [&](size_t f, const uint8_t* row) { table_.fmt.decode(row, out + s.fetch[f] * dim, dim); },
        [&](size_t f) {
          std::fill_n(out + s.fetch[f] * dim, dim, default_value_);
          defaults[s.fetch_segment[f] * kNumDefaultCauses + kCauseNotFound] += 1;
          ++absent;
        });
    const uint64_t t2 = monotonic_ns();
    if (pending != nullptr) {  // written with the request's other tables (timed there)
      pending->add(cache_.get(), s.found_keys.data(), s.found_keys.size(), s.found_rows.data(),
                   stats_);
    } else {
      cache_->insert(s.found_keys.data(), s.found_keys.size(), s.found_rows.data());
    }
    const uint64_t t3 = pending != nullptr ? t2 : monotonic_ns();
    count(stats_, kSyncFetched, static_cast<int64_t>(s.fetch.size()));
    count(stats_, kNotFound, absent);
    count(stats_, kCacheNs, static_cast<int64_t>(query_ns + (t3 - t2)));
    count(stats_, kStoreNs, static_cast<int64_t>(t2 - t1));
  }

  // The background insert of a batch of deferred keys (CachedTable.fill_from_store): each
  // distinct key the table holds, in ascending order, into the cache.
  void fill(std::vector<int64_t>* keys) const {
    std::sort(keys->begin(), keys->end());
    keys->erase(std::unique(keys->begin(), keys->end()), keys->end());
    std::vector<int64_t> found;
    std::vector<uint8_t> rows;
    gather_rows(
        index_, table_, keys->data(), keys->size(), &found, &rows, [](size_t, const uint8_t*) {},
        [](size_t) {});
    cache_->insert(found.data(), found.size(), rows.data());
  }

 private:
  struct Scratch {  // per thread, reused
    std::vector<int64_t> deferred, fetch, fetch_segment, fetch_keys, found_keys, distinct;
    std::vector<uint8_t> found_rows, used;
  };
  static Scratch& scratch() {
    thread_local Scratch s;
    return s;
  }

  // Whether one request's misses are answered with the default and inserted later: its
  // hit rate over distinct keys (a key asked twice counts once; a request without keys
  // counts as 1.0) at or above the threshold, and it did not ask for exact answers.
  bool deferred(const int64_t* keys, const uint8_t* hit, int64_t n, bool exact, Scratch& s) const {
    if (!rules_.deferrable || exact || rules_.hit_rate_threshold > 1.0) return false;
    if (rules_.hit_rate_threshold <= 0.0) return true;
    const uint64_t capacity = index_capacity(static_cast<uint64_t>(n));
    s.distinct.resize(capacity);
    s.used.resize(capacity);
    int64_t distinct = 0, distinct_hits = 0;
    count_distinct_hits(keys, hit, n, s.distinct.data(), s.used.data(), capacity, &distinct,
                        &distinct_hits);
    return static_cast<double>(distinct_hits) >=
           rules_.hit_rate_threshold * static_cast<double>(distinct);
  }

  const std::shared_ptr<const MissCache> cache_;
  const IndexView index_;
  const TableView table_;
  const float default_value_;
  const MissRules rules_;
  InsertQueue* const queue_;
  int64_t* const stats_;
};

inline void InsertQueue::run() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return closed_ || !jobs_.empty(); });
    if (closed_) break;
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    current_ = job.table;
    lock.unlock();
    std::string failure;
    try {
      job.table->fill(&job.keys);
    } catch (const std::exception& x) {
      failure = x.what();
    }
    lock.lock();
    if (!failure.empty()) {
      ++failures_;
      last_failure_ = std::move(failure);
    }
    current_ = nullptr;
    idle_.notify_all();
  }
  current_ = nullptr;
}

}  // namespace triton_rec
