// The per-key and per-set rules of the device embedding cache, written once for the GPU
// kernels (src/native/kernels/cache_kernels.cu, NVRTC) and for their CPU twin
// (array_cache_twin.hpp, g++, which the tests run against the numpy reference,
// triton_rec/cache/array_cache.py). The state is the one of ArrayEmbeddingCache (its
// module docstring is the specification):
//
//   keys    int64 [S, W]    valid  uint8 [S, W]   ticks int64 [S, W]
//   vectors encoded rows [S, W, row_bytes]        seq   int64 [S]   (per-set seqlock)
//   meta    int64 [kMetaLen]                      sketch uint8 [4, width] (tinylfu only)
//
// A key lives in set fastrange(mix64(key), S). Readers take no lock: seq even and
// unchanged around the probe and the copy, else retry once, else report a miss. A writer
// takes a set by making its seq odd (compare-and-swap from even: the set's lock), writes,
// and makes it even again. Writers hold the cache's process-shared writer lock
// (writer_lock.hpp): shared, they lock set by set and give up on a set another writer
// holds past kSetWaitTries (busy: the caller writes its keys again holding the lock
// exclusively); exclusive, they are the only writer, so a set found odd was left so by a
// dead writer and is healed (its ways dropped) and taken.
//
// A "group" runs a rule: SerialGroup (one thread: the CPU twin) or, in the kernels, a
// warp whose lanes probe the ways and copy the row together. Writes of a set are decided
// by its leader alone (plan_set), then the group copies the rows.
#pragma once

#include "hd.hpp"

#if !defined(__CUDACC_RTC__)
#include <sched.h>
#endif

namespace triton_rec {
namespace xcache {

// meta[] slots; triton_rec/cache/array_cache.py takes them from _native.ARRAY_CACHE_META.
enum MetaSlot : int {
  kClock = 0,
  kIncs,
  kCapacity,
  kPolicy,
  kWays,
  kVec,
  kMagic,
  kAgings,
  kInserts,
  kUpdates,
  kEvictions,
  kRejected,
  kOverflow,
  kErased,
  kRecovered,
  kPrecision,
  kMetaLen
};

// Policies: indices in CACHE_POLICIES (ps_json.CachePolicy order).
constexpr int32_t kPolicyLru = 0;
constexpr int32_t kPolicyTinyLfu = 1;

constexpr int kSketchRows = 4;
constexpr uint32_t kSketchMax = 255;  // uint8 counters saturate here
constexpr int64_t kAgingFactor = 10;  // halve the sketch after this many x slots counted keys
constexpr int64_t kSketchWidthFactor = 8;
constexpr int64_t kMaxWays = 64;

// What a query says of each key (the status array).
constexpr uint8_t kMiss = 0;
constexpr uint8_t kHit = 1;
constexpr uint8_t kTorn = 2;  // a writer was in the key's set twice: reported as a miss
// What trec_lookup_tables says of a key a whole table (static, uvm) lacks: kMiss (the default
// value), or this when the index names a row outside the table (a corrupt index).
constexpr uint8_t kCorrupt = 3;

// Per-call counters of a write (write_set's `result`), in this order.
enum WriteCount : int {
  kWInserted = 0,
  kWUpdated,
  kWEvicted,
  kWRejected,
  kWOverflow,
  kWErased,
  kWRecovered,
  kWriteCounts
};
// A write launch's result: the counts above, then the keys it left in busy sets (not
// written: the caller writes them again under the exclusive lock).
constexpr int kWBusy = kWriteCounts;
constexpr int kWriteResults = kWriteCounts + 1;
// The target of a key in a busy set.
constexpr int32_t kBusyTarget = -2;
// How many times a writer under the shared lock tries a set another writer holds (a short
// sleep between tries) before it gives up on it: a set's write is a few microseconds; a
// writer that stays longer was preempted, or died.
constexpr int kSetWaitTries = 2048;

// What write_set does to each of its keys.
enum WriteMode : int32_t { kModeInsert = 0, kModeUpdate = 1, kModeErase = 2 };

// The seed of sketch row r (odd 64-bit constants).
TREC_HD uint64_t sketch_seed(int r) noexcept {
  return r == 0   ? 0x9E3779B97F4A7C15ULL
         : r == 1 ? 0xC2B2AE3D27D4EB4FULL
         : r == 2 ? 0x165667B19E3779F9ULL
                  : 0xD6E8FEB86659FD93ULL;
}

// The state arrays and geometry (plain data: a kernel argument as it is).
struct View {
  int64_t* keys;
  uint8_t* valid;
  int64_t* ticks;
  uint8_t* vectors;
  int64_t* seq;
  int64_t* meta;
  uint8_t* sketch;  // null unless tinylfu
  int64_t num_sets;
  int64_t ways;
  int64_t dim;
  int64_t row_bytes;
  int64_t sketch_width;  // counters per sketch row (a power of two), 0 without sketch
  int64_t slots;         // num_sets * ways
  int64_t precision;
  int64_t policy;
};

// A whole table on the device (static: device memory; uvm: pinned host memory mapped into
// the device), in the node store's index layout (hash_index.hpp); device addresses.
struct WholeTable {
  const int64_t* slots = nullptr;
  uint64_t capacity = 0;
  const uint8_t* vectors = nullptr;
  int64_t rows = 0;
  int64_t precision = 0;
  int64_t dim = 0;
  float default_value = 0.0f;
};

// What one table of a device lookup is: a cache (its state view) or a whole table. Plain
// data, in device memory as it is in host memory: trec_lookup_tables reads an array of
// them, one per table of a request.
struct LookupTarget {
  int32_t cache = 1;  // 1: `view`; 0: `table`
  View view{};
  WholeTable table{};
  TREC_HD int64_t dim() const noexcept { return cache ? view.dim : table.dim; }
  TREC_HD int64_t row_bytes() const noexcept {
    return cache ? view.row_bytes
                 : encoded_row_bytes(static_cast<uint32_t>(table.precision), table.dim);
  }
};

// Where HugeCTR's slot combiner puts one table's slots (trec_combine_tables): out [segments,
// dim] (device), sums or means (`mean`).
struct CombineTarget {
  float* out = nullptr;
  int64_t dim = 0;
  int32_t mean = 0;
};

// The most tables one trec_lookup_tables or trec_combine_tables launch serves (their
// per-block tables); a request with more tables takes a launch per this many.
constexpr int kLaunchTables = 64;

TREC_HD int64_t set_of(const View& c, int64_t key) noexcept {
  return static_cast<int64_t>(fastrange(mix64(static_cast<uint64_t>(key)), c.num_sets));
}

// -- memory access shared by readers and writers ------------------------------------

// A read that sees other processes' and other SMs' writes (hd.hpp FreshLoad).
TREC_HD int64_t load_fresh(const int64_t* p) noexcept { return FreshLoad::at(p); }
TREC_HD uint8_t load_fresh(const uint8_t* p) noexcept { return FreshLoad::at(p); }

// Orders this thread's memory accesses before and after it (device scope on a GPU).
TREC_HD void fence() noexcept {
#if defined(__CUDA_ARCH__)
  __threadfence();
#else
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
}

TREC_HD void store_volatile(int64_t* p, int64_t v) noexcept {
  *const_cast<volatile int64_t*>(p) = v;
}

// Atomic adds and compare-and-swap on the shared state (meta counters, set locks), which
// writers in other threads, processes and launches change at the same time.
TREC_HD int64_t add_fetch(int64_t* p, int64_t v) noexcept {
#if defined(__CUDA_ARCH__)
  return static_cast<int64_t>(atomicAdd(reinterpret_cast<unsigned long long*>(p),
                                        static_cast<unsigned long long>(v))) +
         v;
#else
  return __atomic_add_fetch(p, v, __ATOMIC_ACQ_REL);
#endif
}

TREC_HD bool compare_swap(int64_t* p, int64_t expected, int64_t desired) noexcept {
#if defined(__CUDA_ARCH__)
  return atomicCAS(
             reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(expected),
             static_cast<unsigned long long>(desired)) == static_cast<unsigned long long>(expected);
#else
  return __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_ACQ_REL,
                                     __ATOMIC_ACQUIRE);
#endif
}

// A pause between tries of a set another writer holds (a GPU before Volta has no sleep:
// it tries again at once).
TREC_HD void pause_briefly() noexcept {
#if defined(__CUDA_ARCH__)
#if __CUDA_ARCH__ >= 700
  __nanosleep(500);
#endif
#else
  sched_yield();
#endif
}

// -- groups -----------------------------------------------------------------------------

// One thread does everything (the CPU twin).
struct SerialGroup {
  TREC_HD int lane() const noexcept { return 0; }
  TREC_HD int size() const noexcept { return 1; }
  TREC_HD bool leader() const noexcept { return true; }
  TREC_HD void sync() const noexcept {}
  TREC_HD int64_t broadcast(int64_t v) const noexcept { return v; }
  // The first index in [0, n) where pred holds, or -1.
  template <class Pred>
  TREC_HD int first(int n, Pred pred) const {
    for (int w = 0; w < n; ++w) {
      if (pred(w)) return w;
    }
    return -1;
  }
};

#if defined(__CUDA_ARCH__)
// The 32 lanes of a warp, all running the same rule on the same key or set.
struct WarpGroup {
  __device__ int lane() const noexcept { return static_cast<int>(threadIdx.x & 31u); }
  __device__ int size() const noexcept { return 32; }
  __device__ bool leader() const noexcept { return lane() == 0; }
  __device__ void sync() const noexcept { __syncwarp(); }
  // Lane 0's v, in every lane.
  __device__ int64_t broadcast(int64_t v) const noexcept {
    return static_cast<int64_t>(__shfl_sync(0xffffffffu, static_cast<long long>(v), 0));
  }
  template <class Pred>
  __device__ int first(int n, Pred pred) const {
    for (int base = 0; base < n; base += 32) {
      const int w = base + lane();
      const unsigned m = __ballot_sync(0xffffffffu, w < n && pred(w));
      if (m != 0u) return base + __ffs(static_cast<int>(m)) - 1;
    }
    return -1;
  }
};
#endif

// -- TinyLFU sketch ---------------------------------------------------------------------

TREC_HD int64_t sketch_index(const View& c, int64_t key, int r) noexcept {
  const uint64_t h = mix64(static_cast<uint64_t>(key) + sketch_seed(r));
  return r * c.sketch_width + static_cast<int64_t>(h & static_cast<uint64_t>(c.sketch_width - 1));
}

// Adds 1 to each of the key's counters, saturating at kSketchMax (racing readers may lose
// an increment, as the module docstring allows; never a counter past the maximum).
TREC_HD void sketch_add(const View& c, int64_t key) noexcept {
  for (int r = 0; r < kSketchRows; ++r) {
    uint8_t* p = c.sketch + sketch_index(c, key, r);
#if defined(__CUDA_ARCH__)
    const uint64_t addr = reinterpret_cast<uint64_t>(p);
    unsigned* word = reinterpret_cast<unsigned*>(addr & ~uint64_t(3));
    const unsigned shift = static_cast<unsigned>(addr & 3u) * 8u;
    unsigned old = *word;
    while (((old >> shift) & 0xffu) < kSketchMax) {
      const unsigned prev = atomicCAS(word, old, old + (1u << shift));
      if (prev == old) break;
      old = prev;
    }
#else
    if (*p < kSketchMax) *p = static_cast<uint8_t>(*p + 1);
#endif
  }
}

TREC_HD int64_t sketch_estimate(const View& c, int64_t key) noexcept {
  int64_t m = kSketchMax;
  for (int r = 0; r < kSketchRows; ++r) {
    const int64_t v = c.sketch[sketch_index(c, key, r)];
    m = v < m ? v : m;
  }
  return m;
}

// -- launch-wide bookkeeping (once per query or insert, after all its keys) ----------------

// The clock advances by one per query and per insert (ArrayEmbeddingCache._tick): every
// key of the call was stamped with the clock's value + 1.
TREC_HD void advance_clock(const View& c) noexcept { add_fetch(c.meta + kClock, 1); }

// Counts `n` looked-up keys toward the sketch's aging (tinylfu); true when the sketch is
// due to be halved (then: halve_sketch by every thread, then sketch_aged by one).
TREC_HD bool count_keys(const View& c, int64_t n) noexcept {
  if (c.policy != kPolicyTinyLfu || n <= 0) return false;
  return add_fetch(c.meta + kIncs, n) >= kAgingFactor * c.slots;
}

// Halves the sketch's counters [first, ...) stepping by `step` words (4 counters a word).
TREC_HD void halve_sketch(const View& c, int64_t first, int64_t step) noexcept {
  uint32_t* words = reinterpret_cast<uint32_t*>(c.sketch);
  const int64_t n = kSketchRows * c.sketch_width / 4;
  for (int64_t i = first; i < n; i += step) words[i] = (words[i] >> 1) & 0x7f7f7f7fu;
}

TREC_HD void sketch_aged(const View& c) noexcept {
  store_volatile(c.meta + kIncs, 0);
  add_fetch(c.meta + kAgings, 1);
}

// -- reads ------------------------------------------------------------------------------

// Looks `key` up; writes its decoded vector to out[0..dim) on a hit and zeros otherwise,
// stamps a hit's way with `tick`, counts the key in the sketch (tinylfu). Returns kHit,
// kMiss or kTorn. Every lane of the group calls it with the same key.
template <class G>
TREC_HD uint8_t query_key(const G& g, const View& c, int64_t key, float* out, int64_t tick) {
  const int64_t s = set_of(c, key);
  const int64_t* skeys = c.keys + s * c.ways;
  const uint8_t* svalid = c.valid + s * c.ways;
  uint8_t status = kTorn;
  int way = -1;
  for (int attempt = 0; attempt < 2 && status == kTorn; ++attempt) {
    // The leader reads the sequence number and every lane decides on its value, so the
    // lanes never diverge; each lane fences its own loads against the two reads.
    const int64_t seq0 = g.broadcast(g.leader() ? load_fresh(c.seq + s) : 0);
    fence();
    way = g.first(static_cast<int>(c.ways), [&](int w) {
      return load_fresh(svalid + w) != 0 && load_fresh(skeys + w) == key;
    });
    if (way >= 0) {
      decode_row_part<FreshLoad>(c.vectors + (s * c.ways + way) * c.row_bytes,
                                 static_cast<uint32_t>(c.precision), c.dim, out, g.lane(),
                                 g.size());
    }
    fence();
    g.sync();
    const int64_t seq1 = g.broadcast(g.leader() ? load_fresh(c.seq + s) : 0);
    if (seq0 == seq1 && (seq0 & 1) == 0) status = way >= 0 ? kHit : kMiss;
  }
  if (status != kHit) {
    for (int64_t j = g.lane(); j < c.dim; j += g.size()) out[j] = 0.0f;
  }
  if (g.leader()) {
    if (status == kHit) c.ticks[s * c.ways + way] = tick;
    if (c.policy == kPolicyTinyLfu) sketch_add(c, key);
  }
  return status;
}

// Looks `key` up in a whole table (static, uvm: the node store's index layout,
// hash_index.hpp): dst[0..dim) = its row decoded, or the default value; returns kHit,
// kMiss, or kCorrupt for a slot that names a row outside the table (a corrupt index).
// Every lane of the group calls it with the same key.
template <class G>
TREC_HD uint8_t whole_table_key(const G& g, const WholeTable& t, int64_t row_bytes, int64_t key,
                                float* dst) {
  const int64_t row = g.broadcast(g.leader() ? probe_index(t.slots, t.capacity, key) : 0);
  if (row >= 0 && row < t.rows) {
    decode_row_part(t.vectors + row * row_bytes, static_cast<uint32_t>(t.precision), t.dim, dst,
                    g.lane(), g.size());
    return kHit;
  }
  for (int64_t j = g.lane(); j < t.dim; j += g.size()) dst[j] = t.default_value;
  return row == -1 ? kMiss : kCorrupt;
}

// In a launch for several tables (trec_lookup_tables, trec_combine_tables and their twin),
// the table that item i belongs to: the last t < tables whose first item first[t] is at
// most i (a table without items has the next one's first: never chosen for an item).
TREC_HD int table_of(const int64_t* first, int tables, int64_t i) noexcept {
  int lo = 0, hi = tables - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= i) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// -- writes -----------------------------------------------------------------------------

// By the set's leader: takes set s for writing (its seq made odd). `exclusive`: the caller
// holds the cache's writer lock exclusively, so a set found odd was left so by a dead
// writer: it loses its ways (their data may be torn; counted in `recovered`) and is
// taken. Shared: a set found odd is another live writer's, or a dead one's; waits for it
// up to kSetWaitTries, then gives up (false: the set is busy, left as it is).
TREC_HD bool begin_write(const View& c, int64_t s, bool exclusive, int64_t* recovered) noexcept {
  if (exclusive) {
    const int64_t q = load_fresh(c.seq + s);
    if (q & 1) {
      for (int64_t w = 0; w < c.ways; ++w) c.valid[s * c.ways + w] = 0;
      *recovered += 1;
    }
    store_volatile(c.seq + s, q | 1);
    fence();
    return true;
  }
  for (int tries = 0; tries < kSetWaitTries; ++tries) {
    const int64_t q = load_fresh(c.seq + s);
    if ((q & 1) == 0 && compare_swap(c.seq + s, q, q + 1)) {
      fence();
      return true;
    }
    pause_briefly();
  }
  return false;
}

TREC_HD void end_write(const View& c, int64_t s) noexcept {
  fence();
  store_volatile(c.seq + s, load_fresh(c.seq + s) + 1);
}

// The way of `key` among the set's valid ways, or -1 (a writer's view: no seqlock).
TREC_HD int64_t find_in_set(const View& c, int64_t s, int64_t key) noexcept {
  for (int64_t w = 0; w < c.ways; ++w) {
    const int64_t i = s * c.ways + w;
    if (c.valid[i] && c.keys[i] == key) return w;
  }
  return -1;
}

// Decides the writes of one set, by its leader, after begin_write: for each of its
// `count` keys (distinct; for insert in batch order) target[i] = the way its row goes to,
// or -1. Keys, ticks and valid flags are written here; the rows by copy_rows. Adds to
// counts[kWriteCounts]. The rules are ArrayEmbeddingCache.insert / update / erase:
//  - insert: a key already held is updated in place (and stamped with `tick`); new keys
//    take, in order, the free ways (by index), then the least recently stamped (ties: lower
//    way), never a way updated by this batch; past the ways to give they are dropped
//    (overflow); tinylfu admits a new key over a valid victim only if its estimate is
//    strictly greater (else rejected).
//  - update: only keys held get their row (no stamp). erase: keys held lose their way.
TREC_HD void plan_set(const View& c, int32_t mode, int64_t s, const int64_t* keys, int64_t count,
                      int32_t* target, int64_t tick, int64_t* counts) {
  uint64_t pinned = 0;  // ways updated by this batch, one bit each (ways <= kMaxWays = 64)
  int64_t fresh = 0;    // new keys seen (insert)
  for (int64_t i = 0; i < count; ++i) {
    const int64_t w = find_in_set(c, s, keys[i]);
    target[i] = static_cast<int32_t>(w);
    if (w < 0) {
      ++fresh;
      continue;
    }
    if (mode == kModeErase) {
      c.valid[s * c.ways + w] = 0;
      target[i] = -1;
      counts[kWErased] += 1;
    } else {
      if (mode == kModeInsert) c.ticks[s * c.ways + w] = tick;
      pinned |= uint64_t(1) << w;
      counts[kWUpdated] += 1;
    }
  }
  if (mode != kModeInsert || fresh == 0) return;
  // Way order: free ways first (by index), then by last stamp; pinned ways last. A stable
  // insertion sort of at most kMaxWays ways.
  int32_t order[kMaxWays];
  int64_t okey[kMaxWays];
  int64_t avail = 0;
  for (int64_t w = 0; w < c.ways; ++w) {
    const int64_t i = s * c.ways + w;
    const bool pin = (pinned >> w) & 1;
    const int64_t k = !c.valid[i] ? kInt64Min : pin ? kInt64Max : c.ticks[i];
    avail += !pin;
    int64_t p = w;
    while (p > 0 && okey[p - 1] > k) {
      okey[p] = okey[p - 1];
      order[p] = order[p - 1];
      --p;
    }
    okey[p] = k;
    order[p] = static_cast<int32_t>(w);
  }
  // Victims are judged on the set as it was: record it before the first write.
  uint8_t was_valid[kMaxWays];
  int64_t was_key[kMaxWays];
  for (int64_t w = 0; w < c.ways; ++w) {
    was_valid[w] = c.valid[s * c.ways + w];
    was_key[w] = c.keys[s * c.ways + w];
  }
  int64_t rank = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (target[i] >= 0) continue;  // held: updated above
    const int64_t r = rank++;
    if (r >= avail) {
      counts[kWOverflow] += 1;
      continue;
    }
    const int32_t w = order[r];
    const bool victim = was_valid[w] != 0;
    if (c.policy == kPolicyTinyLfu && victim &&
        !(sketch_estimate(c, keys[i]) > sketch_estimate(c, was_key[w]))) {
      counts[kWRejected] += 1;
      continue;
    }
    const int64_t slot = s * c.ways + w;
    c.keys[slot] = keys[i];
    c.ticks[slot] = tick;
    c.valid[slot] = 1;
    target[i] = w;
    counts[kWInserted] += 1;
    counts[kWEvicted] += victim;
  }
}

// The keys of a busy set (begin_write gave up on it): no target, marked for the retry, and
// counted in the call's result[kWBusy].
TREC_HD void give_up_set(int32_t* target, int64_t count, int64_t* result) noexcept {
  for (int64_t i = 0; i < count; ++i) target[i] = kBusyTarget;
  add_fetch(result + kWBusy, count);
}

// The node-wide counter in meta of each write count (WriteCount order).
TREC_HD int meta_of_count(int k) noexcept {
  switch (k) {
    case kWInserted:
      return kInserts;
    case kWUpdated:
      return kUpdates;
    case kWEvicted:
      return kEvictions;
    case kWRejected:
      return kRejected;
    case kWOverflow:
      return kOverflow;
    case kWErased:
      return kErased;
    default:
      return kRecovered;
  }
}

// A set's write counts added to the call's result and to the node-wide counters in meta.
TREC_HD void add_write_counts(const View& c, const int64_t* counts, int64_t* result) noexcept {
  for (int k = 0; k < kWriteCounts; ++k) {
    if (counts[k] != 0) {
      add_fetch(result + k, counts[k]);
      add_fetch(c.meta + meta_of_count(k), counts[k]);
    }
  }
}

// The group copies the rows decided by plan_set: rows[src[i]] -> the set's way target[i].
template <class G>
TREC_HD void copy_rows(const G& g, const View& c, int64_t s, const int64_t* src, int64_t count,
                       const int32_t* target, const uint8_t* rows) {
  for (int64_t i = 0; i < count; ++i) {
    if (target[i] < 0) continue;
    const uint8_t* from = rows + src[i] * c.row_bytes;
    uint8_t* to = c.vectors + (s * c.ways + target[i]) * c.row_bytes;
    for (int64_t b = g.lane(); b < c.row_bytes; b += g.size()) to[b] = from[b];
  }
}

}  // namespace xcache
}  // namespace triton_rec
