// Set-associative embedding cache laid out entirely inside one caller-provided
// memory region (a POSIX shared-memory mapping shared by every Triton instance
// process of a node). Header-only, no Python dependency.
//
// The region holds no pointers, only offsets, so every process may map it at
// a different address. All cross-process synchronisation lives in the region:
// per-set seqlocks (lock-free readers), per-set process-shared ROBUST mutexes
// (writers; a writer SIGKILLed mid-write is detected and its set repaired by
// the next process that takes the lock) and relaxed atomics for ticks, stats
// and the TinyLFU sketch.
//
// The region's layout (offsets, header, parameters): shm_cache_layout.hpp.
//
// Semantics
// * Ticks come from one global clock: a batch of M keys takes M consecutive
//   ticks (one fetch_add), key i gets base + i; so within one process LRU is
//   exact per key. A query hit, or an insert of a key already present, touches
//   the way; update() does not (a refresh must not make a key look hot).
// * Victim: the first invalid way, else the valid way with the smallest tick.
// * TinyLFU (policy 1): every queried key increments its 4 counters; every
//   10 x capacity increments all counters are halved (aging, by one process
//   under a try-lock). A NEW key that would evict a victim from a full set is
//   admitted only if estimate(new) > estimate(victim); inserting into a free
//   way is always admitted.
// * Readers never take a lock unless a set's seq stays odd (or keeps changing)
//   for a bounded number of spins: then they take the set mutex, which is how
//   a dead writer is detected (EOWNERDEAD) and its set repaired: if the set's
//   seq is odd every way of the set is invalidated and seq made even again.
// * Rows are copied (and decoded into the caller's float32 output, for fp16/int8)
//   between the seqlock fences (the classic seqlock pattern); a copy that raced a
//   writer is always discarded. insert()/update() take rows already encoded.
// * All processes sharing a region must live in one PID namespace (robust
//   futexes identify owners by TID).
#pragma once

#include <errno.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "hash_index.hpp"  // mix64
#include "shm_cache_layout.hpp"

namespace triton_rec {

// A view of one formatted region. Cheap to copy; does not own the memory.
// Thread- and process-safe: every method may run concurrently with every other
// one, in any thread of any process that maps the region.
class ShmCache {
 public:
  // Formats `len` bytes at `base` (8-byte aligned). `initialized` is cleared
  // first and set last (release), so concurrent attach() calls either fail or
  // see a complete region. Only set metadata is zeroed (vectors are not touched).
  static ShmCache initialize(void* base, size_t len, const ShmCacheParams& p, uint64_t checksum) {
    const ShmCacheLayout l = shm_cache_layout(p);
    check_region<std::invalid_argument>(base, len, l.total_bytes);
    auto* h = static_cast<ShmCacheHeader*>(base);
    reinterpret_cast<std::atomic<uint32_t>*>(static_cast<uint8_t*>(base) +
                                             kShmCacheInitializedOffset)
        ->store(0, std::memory_order_release);
    std::memset(base, 0, kShmCacheHeaderBytes);
    h = new (base) ShmCacheHeader;  // begins the lifetime of the atomics (memory already zero)
    h->initialized.store(0, std::memory_order_relaxed);
    h->magic = kShmCacheMagic;
    h->layout_version = kShmCacheLayoutVersion;
    h->policy = static_cast<uint32_t>(p.policy);
    h->num_sets = p.num_sets;
    h->ways = p.ways;
    h->vec_size = p.vec_size;
    h->checksum = checksum;
    h->total_bytes = l.total_bytes;
    h->set_stride = l.set_stride;
    h->vec_offset = l.vec_offset;
    h->sets_offset = l.sets_offset;
    h->sketch_offset = l.sketch_offset;
    h->sketch_width = l.sketch_width;
    h->aging_threshold = kSketchAgingFactor * p.num_sets * p.ways;
    h->attach_slots = kShmCacheAttachSlots;
    h->header_bytes = static_cast<uint32_t>(kShmCacheHeaderBytes);
    h->precision = static_cast<uint32_t>(p.precision);
    h->row_bytes = static_cast<uint32_t>(row_bytes_of(p.precision, p.vec_size));
    shm_detail::init_robust_mutex(&h->aging_mutex);
    auto* sets = static_cast<uint8_t*>(base) + l.sets_offset;
    for (uint64_t s = 0; s < p.num_sets; ++s) {
      uint8_t* set = sets + s * l.set_stride;
      std::memset(set, 0, l.vec_offset);
      shm_detail::init_robust_mutex(reinterpret_cast<pthread_mutex_t*>(set + 8));
    }
    if (l.sketch_width) {
      std::memset(static_cast<uint8_t*>(base) + l.sketch_offset, 0,
                  l.total_bytes - l.sketch_offset);
    }
    h->initialized.store(1, std::memory_order_release);
    return ShmCache(base, len);
  }

  // Validates magic, version, `initialized`, parameters and size; throws ShmCacheError.
  static ShmCache attach(void* base, size_t len) {
    check_region<ShmCacheError>(base, len, sizeof(uint64_t) * 2);
    const auto* b = static_cast<const uint8_t*>(base);
    uint64_t magic;
    uint32_t version;
    std::memcpy(&magic, b + offsetof(ShmCacheHeader, magic), 8);
    std::memcpy(&version, b + offsetof(ShmCacheHeader, layout_version), 4);
    if (magic != kShmCacheMagic) {
      throw ShmCacheError("not a triton_rec shared cache region (bad magic; " +
                          std::to_string(len) + " bytes)");
    }
    if (version != kShmCacheLayoutVersion) {
      throw ShmCacheError("shared cache layout version " + std::to_string(version) +
                          ", this build reads version " + std::to_string(kShmCacheLayoutVersion));
    }
    if (len < kShmCacheHeaderBytes) {
      throw ShmCacheError("shared cache region truncated: " + std::to_string(len) +
                          " bytes, smaller than its header");
    }
    const auto* h = static_cast<const ShmCacheHeader*>(base);
    if (h->initialized.load(std::memory_order_acquire) != 1) {
      throw ShmCacheError(
          "shared cache region is not initialized (being formatted, or its "
          "creator died while formatting it)");
    }
    ShmCacheParams p;
    p.num_sets = h->num_sets;
    p.ways = h->ways;
    p.vec_size = h->vec_size;
    p.policy = static_cast<CachePolicy>(h->policy);
    p.precision = static_cast<Precision>(h->precision);
    ShmCacheLayout l;
    try {
      l = shm_cache_layout(p);
    } catch (const std::invalid_argument& e) {
      throw ShmCacheError(std::string("malformed shared cache header: ") + e.what());
    }
    if (l.total_bytes != h->total_bytes || l.set_stride != h->set_stride ||
        l.vec_offset != h->vec_offset || l.sets_offset != h->sets_offset ||
        l.sketch_offset != h->sketch_offset || l.sketch_width != h->sketch_width ||
        h->attach_slots != kShmCacheAttachSlots ||
        h->row_bytes != row_bytes_of(p.precision, p.vec_size) ||
        h->aging_threshold != kSketchAgingFactor * p.num_sets * p.ways) {
      throw ShmCacheError(
          "malformed shared cache header (layout fields disagree with its "
          "parameters)");
    }
    if (len < l.total_bytes) {
      throw ShmCacheError("shared cache region truncated: " + std::to_string(len) +
                          " bytes, its header needs " + std::to_string(l.total_bytes));
    }
    return ShmCache(base, len);
  }

  // ---- parameters -------------------------------------------------------------
  uint64_t num_sets() const noexcept { return num_sets_; }
  uint32_t ways() const noexcept { return ways_; }
  uint32_t vec_size() const noexcept { return dim_; }
  const RowFormat& format() const noexcept { return fmt_; }
  uint64_t capacity() const noexcept { return num_sets_ * ways_; }
  CachePolicy policy() const noexcept { return policy_; }
  uint64_t checksum() const noexcept { return h_->checksum; }
  uint64_t total_bytes() const noexcept { return h_->total_bytes; }

  uint64_t set_of(int64_t key) const noexcept {
    return num_sets_ == 1 ? 0 : (mix64(static_cast<uint64_t>(key)) >> set_shift_);
  }

  // ---- batch operations -------------------------------------------------------
  // out[i] = vector of keys[i] and hit[i] = 1 when cached; hit[i] = 0 otherwise
  // (out[i] is then unspecified). Returns the number of hits. Lock-free.
  int64_t query(const int64_t* keys, size_t m, float* out, uint8_t* hit) const {
    if (m == 0) return 0;
    const uint64_t base_tick = h_->clock.fetch_add(m, std::memory_order_relaxed) + 1;
    const size_t row_bytes = fmt_.row_bytes;
    const bool fp32 = fmt_.is_fp32();
    const DecodeFn decode = fmt_.decode;
    // Software pipeline (as hash_index.hpp's lookup_range), per iteration i:
    //   stage 1: find key i's set, prefetch its seq/key/tick/valid lines (kSetAhead)
    //   stage 2: guess key i - kSetAhead's way from the (now cached) keys without the
    //            seqlock, prefetch that way's vector (kVecAhead)
    //   stage 3: the real seqlock read of key i - kSetAhead - kVecAhead
    // A hit touches 5 cache lines of a set spread over the whole segment; without the
    // pipeline the valid byte and the vector were two dependent memory misses per key.
    // The guess is only a prefetch hint: stage 3 decides.
    constexpr size_t kSetAhead = 16, kVecAhead = 8, kRing = 32;
    static_assert((kRing & (kRing - 1)) == 0 && kRing > kSetAhead + kVecAhead, "ring size");
    uint8_t* sets[kRing];
    int64_t hits = 0;
    auto stage1 = [&](size_t i) {
      uint8_t* set = set_ptr(set_of(keys[i]));
      sets[i & (kRing - 1)] = set;
      TRITON_REC_PREFETCH(set);
      TRITON_REC_PREFETCH(keys_of(set));
      __builtin_prefetch(ticks(set), 1, 3);
      TRITON_REC_PREFETCH(valid(set));
    };
    auto stage2 = [&](size_t i) {
      uint8_t* set = sets[i & (kRing - 1)];
      const int w = find_way(set, keys[i]);
      if (w >= 0) shm_detail::prefetch_row(vec(set, w), row_bytes);
    };
    auto stage3 = [&](size_t i) {
      uint8_t* set = sets[i & (kRing - 1)];
      const int64_t k = keys[i];
      float* dst = out + i * dim_;
      const int w = read_consistent(set, [&](uint8_t* s) {
        const int way = find_way(s, k);
        if (way >= 0) {
          if (fp32) {
            std::memcpy(dst, vec(s, way), row_bytes);
          } else {
            decode(vec(s, way), dst, dim_);
          }
        }
        return way;
      });
      if (w >= 0) {
        ticks(set)[w].store(base_tick + i, std::memory_order_relaxed);
        hit[i] = 1;
        ++hits;
      } else {
        hit[i] = 0;
      }
    };
    constexpr size_t kLag = kSetAhead + kVecAhead;
    size_t i = 0;
    for (; i < std::min(m, kLag); ++i) {  // prologue (also covers m < kLag)
      stage1(i);
      if (i >= kSetAhead) stage2(i - kSetAhead);
    }
    for (; i < m; ++i) {  // steady state
      stage1(i);
      stage2(i - kSetAhead);
      stage3(i - kLag);
    }
    for (; i < m + kLag; ++i) {  // drain
      if (i >= kSetAhead && i - kSetAhead < m) stage2(i - kSetAhead);
      if (i >= kLag) stage3(i - kLag);
    }
    h_->lookups.fetch_add(m, std::memory_order_relaxed);
    h_->hits.fetch_add(static_cast<uint64_t>(hits), std::memory_order_relaxed);
    h_->misses.fetch_add(m - static_cast<uint64_t>(hits), std::memory_order_relaxed);
    if (policy_ == CachePolicy::kTinyLfu) record_accesses(keys, m);
    return hits;
  }

  // Inserts (or overwrites) keys[i] -> rows[i] (encoded, fmt_.row_bytes each), in
  // order (a repeated key: the last occurrence wins). Overwrites count as updates.
  InsertResult insert(const int64_t* keys, size_t m, const void* rows) const {
    const auto* vectors = static_cast<const uint8_t*>(rows);
    InsertResult r;
    if (m == 0) return r;
    const uint64_t base_tick = h_->clock.fetch_add(m, std::memory_order_relaxed) + 1;
    uint64_t updated = 0;
    // The sets of a batch are spread over the whole segment: the set of key i + kAhead is
    // prefetched (its lock and seq line, written; its keys and ticks) while key i is
    // written, so taking a lock does not wait on memory.
    constexpr size_t kAhead = 8;
    for (size_t i = 0; i < std::min(m, kAhead); ++i) prefetch_for_write(set_ptr(set_of(keys[i])));
    for (size_t i = 0; i < m; ++i) {
      if (i + kAhead < m) prefetch_for_write(set_ptr(set_of(keys[i + kAhead])));
      const int64_t k = keys[i];
      const uint8_t* v = vectors + i * fmt_.row_bytes;
      uint8_t* set = set_ptr(set_of(k));
      SetLock lock(*this, set);
      int w = find_way(set, k);
      if (w >= 0) {
        write_way(set, w, k, v, base_tick + i);
        ++updated;
        continue;
      }
      w = free_way(set);
      if (w < 0) {
        w = lru_way(set);
        if (policy_ == CachePolicy::kTinyLfu) {
          const int64_t victim = keys_of(set)[w].load(std::memory_order_relaxed);
          if (estimate(k) <= estimate(victim)) {
            ++r.rejected;
            continue;
          }
        }
        ++r.evicted;
      }
      write_way(set, w, k, v, base_tick + i);
      ++r.inserted;
    }
    h_->inserts.fetch_add(static_cast<uint64_t>(r.inserted), std::memory_order_relaxed);
    h_->updates.fetch_add(updated, std::memory_order_relaxed);
    h_->evictions.fetch_add(static_cast<uint64_t>(r.evicted), std::memory_order_relaxed);
    h_->rejected_admissions.fetch_add(static_cast<uint64_t>(r.rejected), std::memory_order_relaxed);
    return r;
  }

  // Overwrites the vectors of keys already cached; never inserts, never touches ticks.
  int64_t update(const int64_t* keys, size_t m, const void* rows) const {
    const auto* vectors = static_cast<const uint8_t*>(rows);
    int64_t updated = 0;
    for (size_t i = 0; i < m; ++i) {
      uint8_t* set = set_ptr(set_of(keys[i]));
      SetLock lock(*this, set);
      const int w = find_way(set, keys[i]);
      if (w < 0) continue;
      begin_write(set);
      std::memcpy(vec(set, w), vectors + i * fmt_.row_bytes, fmt_.row_bytes);
      end_write(set);
      ++updated;
    }
    h_->updates.fetch_add(static_cast<uint64_t>(updated), std::memory_order_relaxed);
    return updated;
  }

  int64_t erase(const int64_t* keys, size_t m) const {
    int64_t erased = 0;
    for (size_t i = 0; i < m; ++i) {
      uint8_t* set = set_ptr(set_of(keys[i]));
      SetLock lock(*this, set);
      const int w = find_way(set, keys[i]);
      if (w < 0) continue;
      begin_write(set);
      valid(set)[w].store(0, std::memory_order_relaxed);
      end_write(set);
      ++erased;
    }
    h_->erased.fetch_add(static_cast<uint64_t>(erased), std::memory_order_relaxed);
    return erased;
  }

  // Empties every set (set by set; concurrent inserts may land right after).
  // The TinyLFU sketch and the counters are kept.
  void clear() const {
    for (uint64_t s = 0; s < num_sets_; ++s) {
      uint8_t* set = set_ptr(s);
      SetLock lock(*this, set);
      begin_write(set);
      for (uint32_t w = 0; w < ways_; ++w) valid(set)[w].store(0, std::memory_order_relaxed);
      end_write(set);
    }
  }

  // Snapshot of the cached keys (each set read consistently; sets one after another).
  std::vector<int64_t> keys() const {
    std::vector<int64_t> out;
    int64_t buf[kShmCacheMaxWays];
    for (uint64_t s = 0; s < num_sets_; ++s) {
      const int n = read_consistent(set_ptr(s), [&](uint8_t* set) {
        int c = 0;
        for (uint32_t w = 0; w < ways_; ++w) {
          if (valid(set)[w].load(std::memory_order_relaxed)) {
            buf[c++] = keys_of(set)[w].load(std::memory_order_relaxed);
          }
        }
        return c;
      });
      out.insert(out.end(), buf, buf + n);
    }
    return out;
  }

  uint64_t size() const {
    uint64_t total = 0;
    for (uint64_t s = 0; s < num_sets_; ++s) {
      total += static_cast<uint64_t>(read_consistent(set_ptr(s), [&](uint8_t* set) {
        int c = 0;
        for (uint32_t w = 0; w < ways_; ++w) c += valid(set)[w].load(std::memory_order_relaxed);
        return c;
      }));
    }
    return total;
  }

  ShmCacheStats stats() const noexcept {
    constexpr auto r = std::memory_order_relaxed;
    ShmCacheStats s;
    s.lookups = h_->lookups.load(r);
    s.hits = h_->hits.load(r);
    s.misses = h_->misses.load(r);
    s.inserts = h_->inserts.load(r);
    s.updates = h_->updates.load(r);
    s.evictions = h_->evictions.load(r);
    s.rejected_admissions = h_->rejected_admissions.load(r);
    s.erased = h_->erased.load(r);
    s.recovered_sets = h_->recovered_sets.load(r);
    s.sketch_agings = h_->sketch_agings.load(r);
    return s;
  }

  // ---- TinyLFU sketch -----------------------------------------------------------
  // Count-min estimate (0..15) of a key's recent query frequency; 0 without a sketch.
  unsigned estimate(int64_t key) const noexcept {
    if (!sketch_) return 0;
    const uint64_t h = mix64(static_cast<uint64_t>(key) ^ shm_detail::kSketchSalt);
    unsigned best = 15;
    for (uint64_t r = 0; r < kSketchRows; ++r) {
      uint64_t word_ix, shift;
      counter_pos(h, r, word_ix, shift);
      const unsigned c =
          static_cast<unsigned>((sketch_[word_ix].load(std::memory_order_relaxed) >> shift) & 0xF);
      best = c < best ? c : best;
    }
    return best;
  }

  // ---- attachment tokens (opaque non-zero int64s; the Python side uses them for PIDs) --
  bool register_token(int64_t token) const {
    if (token == 0) throw std::invalid_argument("attachment token must be non-zero");
    for (uint32_t i = 0; i < kShmCacheAttachSlots; ++i) {
      int64_t expected = 0;
      if (h_->attached[i].load(std::memory_order_relaxed) == 0 &&
          h_->attached[i].compare_exchange_strong(expected, token, std::memory_order_acq_rel)) {
        return true;
      }
    }
    return false;
  }

  // Frees one slot holding `token` (every such slot if `all`); returns slots freed.
  int64_t unregister_token(int64_t token, bool all) const {
    if (token == 0) return 0;
    int64_t freed = 0;
    for (uint32_t i = 0; i < kShmCacheAttachSlots; ++i) {
      int64_t expected = token;
      if (h_->attached[i].compare_exchange_strong(expected, 0, std::memory_order_acq_rel)) {
        ++freed;
        if (!all) break;
      }
    }
    return freed;
  }

  std::vector<int64_t> tokens() const {
    std::vector<int64_t> out;
    for (uint32_t i = 0; i < kShmCacheAttachSlots; ++i) {
      const int64_t t = h_->attached[i].load(std::memory_order_acquire);
      if (t) out.push_back(t);
    }
    return out;
  }

  // ---- test hooks -----------------------------------------------------------------
  uint64_t debug_set_seq(uint64_t s) const {
    check_set(s);
    return seq(set_ptr(s)).load(std::memory_order_acquire);
  }

  // Takes set s's lock, starts a write (seq odd), scribbles NaN over the first
  // half of every way's row (a torn write) and sleeps `seconds` while holding
  // it: a process killed meanwhile dies exactly like a writer killed mid-write.
  // If it survives, the set is emptied and released.
  void debug_hold_set(uint64_t s, double seconds) const {
    check_set(s);
    uint8_t* set = set_ptr(s);
    SetLock lock(*this, set);
    begin_write(set);
    // all-ones bytes: NaN as float32 and as float16
    for (uint32_t w = 0; w < ways_; ++w) std::memset(vec(set, w), 0xff, (fmt_.row_bytes + 1) / 2);
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    for (uint32_t w = 0; w < ways_; ++w) valid(set)[w].store(0, std::memory_order_relaxed);
    end_write(set);
  }

 private:
  ShmCache(void* base, size_t /*len*/)
      : base_(static_cast<uint8_t*>(base)), h_(static_cast<ShmCacheHeader*>(base)) {
    num_sets_ = h_->num_sets;
    ways_ = h_->ways;
    dim_ = h_->vec_size;
    fmt_ = RowFormat(static_cast<Precision>(h_->precision), dim_);
    policy_ = static_cast<CachePolicy>(h_->policy);
    stride_ = h_->set_stride;
    vec_off_ = h_->vec_offset;
    valid_off_ = shm_detail::valid_offset(ways_);
    sets_ = base_ + h_->sets_offset;
    set_shift_ = 64 - shm_detail::log2_pow2(num_sets_);
    sketch_width_ = h_->sketch_width;
    sketch_ = sketch_width_ ? reinterpret_cast<std::atomic<uint64_t>*>(base_ + h_->sketch_offset)
                            : nullptr;
  }

  // Throws E (std::invalid_argument when formatting, ShmCacheError when attaching).
  template <class E>
  static void check_region(void* base, size_t len, uint64_t need) {
    if (base == nullptr) throw E("shared cache region is null");
    if (reinterpret_cast<uintptr_t>(base) % 8 != 0) {
      throw E("shared cache region must be 8-byte aligned");
    }
    if (len < need) {
      throw E("shared cache region has " + std::to_string(len) + " bytes, needs " +
              std::to_string(need));
    }
  }

  void check_set(uint64_t s) const {
    if (s >= num_sets_) {
      throw std::out_of_range("set index " + std::to_string(s) + " out of range [0, " +
                              std::to_string(num_sets_) + ")");
    }
  }

  // ---- set accessors ------------------------------------------------------------
  uint8_t* set_ptr(uint64_t s) const noexcept { return sets_ + s * stride_; }
  void prefetch_for_write(uint8_t* set) const noexcept {
    __builtin_prefetch(set, 1, 3);                     // seq, mutex (and valid[] for W <= 8)
    __builtin_prefetch(keys_of(set), 0, 3);            // keys
    __builtin_prefetch(ticks(set) + ways_ - 1, 1, 3);  // the ticks' last line
  }
  static std::atomic<uint64_t>& seq(uint8_t* set) noexcept {
    return *reinterpret_cast<std::atomic<uint64_t>*>(set);
  }
  static pthread_mutex_t* mutex(uint8_t* set) noexcept {
    return reinterpret_cast<pthread_mutex_t*>(set + 8);
  }
  static std::atomic<int64_t>* keys_of(uint8_t* set) noexcept {
    return reinterpret_cast<std::atomic<int64_t>*>(set + 64);
  }
  std::atomic<uint64_t>* ticks(uint8_t* set) const noexcept {
    return reinterpret_cast<std::atomic<uint64_t>*>(set + 64 + 8 * ways_);
  }
  std::atomic<uint8_t>* valid(uint8_t* set) const noexcept {
    return reinterpret_cast<std::atomic<uint8_t>*>(set + valid_off_);
  }
  uint8_t* vec(uint8_t* set, int w) const noexcept {
    return set + vec_off_ + static_cast<size_t>(w) * fmt_.row_bytes;
  }

  int find_way(uint8_t* set, int64_t k) const noexcept {
    const auto* ks = keys_of(set);
    const auto* vs = valid(set);
    for (uint32_t w = 0; w < ways_; ++w) {
      if (ks[w].load(std::memory_order_relaxed) == k && vs[w].load(std::memory_order_relaxed)) {
        return static_cast<int>(w);
      }
    }
    return -1;
  }
  int free_way(uint8_t* set) const noexcept {
    for (uint32_t w = 0; w < ways_; ++w) {
      if (!valid(set)[w].load(std::memory_order_relaxed)) return static_cast<int>(w);
    }
    return -1;
  }
  int lru_way(uint8_t* set) const noexcept {
    int best = 0;
    uint64_t best_tick = ticks(set)[0].load(std::memory_order_relaxed);
    for (uint32_t w = 1; w < ways_; ++w) {
      const uint64_t t = ticks(set)[w].load(std::memory_order_relaxed);
      if (t < best_tick) best_tick = t, best = static_cast<int>(w);
    }
    return best;
  }

  // ---- seqlock --------------------------------------------------------------------
  // Writers (lock held): begin_write makes seq odd, end_write even again.
  static void begin_write(uint8_t* set) noexcept {
    const uint64_t s = seq(set).load(std::memory_order_relaxed);
    seq(set).store(s + 1, std::memory_order_relaxed);
    std::atomic_thread_fence(std::memory_order_release);
  }
  static void end_write(uint8_t* set) noexcept {
    const uint64_t s = seq(set).load(std::memory_order_relaxed);
    seq(set).store(s + 1, std::memory_order_release);
  }
  void write_way(uint8_t* set, int w, int64_t k, const uint8_t* v, uint64_t tick) const noexcept {
    begin_write(set);
    valid(set)[w].store(0, std::memory_order_relaxed);
    keys_of(set)[w].store(k, std::memory_order_relaxed);
    std::memcpy(vec(set, w), v, fmt_.row_bytes);
    ticks(set)[w].store(tick, std::memory_order_relaxed);
    valid(set)[w].store(1, std::memory_order_relaxed);
    end_write(set);
  }

  // Runs the restartable read `f(set)` between two equal even seq values; after a
  // bounded number of failed attempts runs it under the set lock instead (which also
  // repairs a set whose writer died).
  template <class F>
  int read_consistent(uint8_t* set, F&& f) const {
    unsigned odd = 0, retries = 0;
    for (;;) {
      const uint64_t s1 = seq(set).load(std::memory_order_acquire);
      if (s1 & 1) {
        if (++odd > shm_detail::kOddSpinLimit) break;
        if (odd <= shm_detail::kPauseSpins) {
          shm_detail::cpu_relax();
        } else {
          sched_yield();
        }
        continue;
      }
      const int r = f(set);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (seq(set).load(std::memory_order_relaxed) == s1) return r;
      if (++retries > shm_detail::kRetryLimit) break;
    }
    SetLock lock(*this, set);
    return f(set);
  }

  // Takes a set's robust mutex; repairs the set if the previous owner died mid-write.
  class SetLock {
   public:
    SetLock(const ShmCache& c, uint8_t* set) : set_(set) {
      const int rc = pthread_mutex_lock(mutex(set));
      if (rc == EOWNERDEAD) {
        c.repair(set);
        pthread_mutex_consistent(mutex(set));
      } else if (rc == ENOTRECOVERABLE) {
        throw ShmCacheError("a shared cache set lock is not recoverable (ENOTRECOVERABLE)");
      } else if (rc != 0) {
        throw std::system_error(rc, std::generic_category(), "pthread_mutex_lock (shared cache)");
      } else if (seq(set).load(std::memory_order_relaxed) & 1) {
        c.repair(set);  // defensive: an odd seq under a free lock is a torn write too
      }
    }
    ~SetLock() { pthread_mutex_unlock(mutex(set_)); }
    SetLock(const SetLock&) = delete;
    SetLock& operator=(const SetLock&) = delete;

   private:
    uint8_t* set_;
  };

  // Lock held. An odd seq means the dead owner was between begin_write and
  // end_write: any way may be torn, so the whole set is emptied.
  void repair(uint8_t* set) const noexcept {
    const uint64_t s = seq(set).load(std::memory_order_relaxed);
    if (!(s & 1)) return;
    for (uint32_t w = 0; w < ways_; ++w) valid(set)[w].store(0, std::memory_order_relaxed);
    seq(set).store(s + 1, std::memory_order_release);
    h_->recovered_sets.fetch_add(1, std::memory_order_relaxed);
  }

  // ---- TinyLFU --------------------------------------------------------------------
  void counter_pos(uint64_t h, uint64_t row, uint64_t& word_ix, uint64_t& shift) const noexcept {
    const uint64_t idx = mix64(h + row * shm_detail::kSketchRowStep) & (sketch_width_ - 1);
    word_ix = row * (sketch_width_ / 16) + idx / 16;
    shift = (idx % 16) * 4;
  }

  void increment(int64_t key) const noexcept {
    const uint64_t h = mix64(static_cast<uint64_t>(key) ^ shm_detail::kSketchSalt);
    for (uint64_t r = 0; r < kSketchRows; ++r) {
      uint64_t word_ix, shift;
      counter_pos(h, r, word_ix, shift);
      auto& word = sketch_[word_ix];
      uint64_t old = word.load(std::memory_order_relaxed);
      while (((old >> shift) & 0xF) < 15 &&
             !word.compare_exchange_weak(old, old + (uint64_t{1} << shift),
                                         std::memory_order_relaxed)) {
      }
    }
  }

  void record_accesses(const int64_t* keys, size_t m) const {
    for (size_t i = 0; i < m; ++i) increment(keys[i]);
    const uint64_t threshold = h_->aging_threshold;
    const uint64_t n = h_->sketch_increments.fetch_add(m, std::memory_order_relaxed) + m;
    if (n < threshold) return;
    const int rc = pthread_mutex_trylock(&h_->aging_mutex);
    if (rc == EBUSY) return;  // another process is aging the sketch
    if (rc == EOWNERDEAD) {
      pthread_mutex_consistent(&h_->aging_mutex);  // a half-halved sketch is harmless
    } else if (rc != 0) {
      return;  // (ENOTRECOVERABLE cannot happen: consistent is always called) skip aging
    }
    while (h_->sketch_increments.load(std::memory_order_relaxed) >= threshold) {
      const uint64_t words = kSketchRows * sketch_width_ / 16;
      for (uint64_t i = 0; i < words; ++i) {
        uint64_t old = sketch_[i].load(std::memory_order_relaxed);
        while (!sketch_[i].compare_exchange_weak(old, (old >> 1) & shm_detail::kNibbleLowBits,
                                                 std::memory_order_relaxed)) {
        }
      }
      h_->sketch_increments.fetch_sub(threshold, std::memory_order_relaxed);
      h_->sketch_agings.fetch_add(1, std::memory_order_relaxed);
    }
    pthread_mutex_unlock(&h_->aging_mutex);
  }

  uint8_t* base_;
  ShmCacheHeader* h_;
  uint8_t* sets_;
  std::atomic<uint64_t>* sketch_;
  uint64_t num_sets_, stride_, vec_off_, valid_off_, sketch_width_;
  uint32_t ways_, dim_;
  RowFormat fmt_;
  unsigned set_shift_;
  CachePolicy policy_;
};

}  // namespace triton_rec
