// The region layout of the shared-memory embedding cache (shm_cache.hpp): its constants,
// header, parameters and the byte layout that follows from them; shm_cache.hpp's ShmCache
// reads and writes a region laid out so.
//
// ============================== REGION LAYOUT ===============================
// All integers native (little-endian); every offset is a multiple of 64.
// [0, 4096)        ShmCacheHeader (below): magic "TRECSHMC", layout version,
//                  parameters, config checksum, `initialized` flag (set LAST,
//                  release), global counters, global access clock, TinyLFU
//                  aging mutex and increment counter, attachment-token table.
// [4096, ...)      num_sets sets of `set_stride` bytes. Set layout (W = ways,
//                  D = vec_size):
//                    +0        atomic<uint64> seq    seqlock: odd = being written
//                    +8        pthread_mutex_t       PROCESS_SHARED | ROBUST (<= 48 B)
//                    +56       uint8  valid[W]       W <= 8: 1 = way holds key[w] (atomic)
//                    +64       int64  key[W]         (atomic, relaxed)
//                    +64+8W    uint64 tick[W]        last access (atomic, relaxed)
//                    +64+16W   uint8  valid[W]       W > 8: as above
//                    +vec_off  row vec[W]            vec_off = round_up(64+16W+V, 64),
//                                                    V = W <= 8 ? 0 : round8(W)
//                  (valid[] sits in the 8 bytes after the mutex when it fits: at the
//                  default 8 ways that saves 64 bytes per set, 8 per row.)
//                  set_stride = round_up(vec_off + W*R, 64), R = bytes of one encoded
//                  row of D values in the header's `precision` (row_codec.hpp).
// [sketch_offset, total_bytes)   TinyLFU only: count-min sketch, 4 rows of
//                  `sketch_width` 4-bit saturating counters (max 15) packed 16
//                  per uint64 word; row r occupies words [r*width/16, (r+1)*width/16).
//                  sketch_width = max(64, power of two >= 8 * capacity).
// * set of key k: num_sets == 1 ? 0 : mix64(uint64(k)) >> (64 - log2(num_sets))
//   (the HIGH bits; the hash index uses the low bits of the same mixer).
// * sketch counter of key k in row r (r = 0..3):
//       h = mix64(uint64(k) ^ 0xd6e8feb86659fd93)
//       idx_r = mix64(h + r * 0x9e3779b97f4a7c15) & (sketch_width - 1)
// Changing anything above requires bumping kShmCacheLayoutVersion.
// ============================================================================
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <system_error>

#include "hash_index.hpp"  // mix64
#include "row_codec.hpp"

namespace triton_rec {

constexpr uint64_t kShmCacheMagic = 0x434D485343455254ULL;  // "TRECSHMC" little-endian
constexpr uint32_t kShmCacheLayoutVersion = 3;  // 2: encoded rows; 3: valid[] after the mutex
// Ways whose valid bytes fit in the set header, after the seqlock and the mutex.
constexpr uint32_t kShmCacheHeaderValidWays = 8;
constexpr uint64_t kShmCacheHeaderBytes = 4096;
constexpr uint32_t kShmCacheMaxWays = 64;
constexpr uint32_t kShmCacheMaxVecSize = 1u << 16;
constexpr uint64_t kShmCacheMaxSets = uint64_t{1} << 40;
constexpr uint64_t kShmCacheMaxBytes = uint64_t{1} << 46;
constexpr uint32_t kShmCacheAttachSlots = 256;
constexpr uint64_t kSketchRows = 4;
constexpr uint64_t kSketchMinWidth = 64;
constexpr uint64_t kSketchAgingFactor = 10;  // halve every 10 x capacity increments

enum class CachePolicy : uint32_t { kLru = 0, kTinyLfu = 1 };

inline const char* policy_name(CachePolicy p) noexcept {
  return p == CachePolicy::kLru ? "lru" : p == CachePolicy::kTinyLfu ? "tinylfu" : "?";
}

// A region that is not an initialized cache, is malformed, or a lock that can no
// longer be used (ENOTRECOVERABLE, ...).
class ShmCacheError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free 64-bit atomics");
static_assert(std::atomic<int64_t>::is_always_lock_free, "need lock-free 64-bit atomics");
static_assert(std::atomic<uint8_t>::is_always_lock_free, "need lock-free 8-bit atomics");
static_assert(sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<uint8_t>) == 1, "");
static_assert(sizeof(pthread_mutex_t) <= 48, "pthread_mutex_t must fit in 48 bytes");

struct ShmCacheStats {
  uint64_t lookups = 0, hits = 0, misses = 0, inserts = 0, updates = 0, evictions = 0,
           rejected_admissions = 0, erased = 0, recovered_sets = 0, sketch_agings = 0;
};

struct InsertResult {
  int64_t inserted = 0, evicted = 0, rejected = 0;
};

// Fixed header; lives at offset 0 and fits in kShmCacheHeaderBytes.
struct ShmCacheHeader {
  // --- immutable after initialization --------------------------------------
  uint64_t magic;
  uint32_t layout_version;
  uint32_t policy;
  uint64_t num_sets;
  uint32_t ways;
  uint32_t vec_size;
  uint64_t checksum;
  uint64_t total_bytes;
  uint64_t set_stride;
  uint64_t vec_offset;  // within a set
  uint64_t sets_offset;
  uint64_t sketch_offset;
  uint64_t sketch_width;  // counters per row (0: no sketch)
  uint64_t aging_threshold;
  uint32_t attach_slots;
  uint32_t header_bytes;
  uint32_t precision;                             // row_codec.hpp Precision
  uint32_t row_bytes;                             // bytes of one encoded row
  alignas(64) std::atomic<uint32_t> initialized;  // 1 once fully formatted (release)
  // --- mutable, shared --------------------------------------------------------
  alignas(64) std::atomic<uint64_t> clock;
  alignas(64) std::atomic<uint64_t> lookups;
  std::atomic<uint64_t> hits;
  std::atomic<uint64_t> misses;
  alignas(64) std::atomic<uint64_t> inserts;
  std::atomic<uint64_t> updates;
  std::atomic<uint64_t> evictions;
  std::atomic<uint64_t> rejected_admissions;
  std::atomic<uint64_t> erased;
  std::atomic<uint64_t> recovered_sets;
  std::atomic<uint64_t> sketch_agings;
  alignas(64) std::atomic<uint64_t> sketch_increments;
  alignas(64) pthread_mutex_t aging_mutex;  // PROCESS_SHARED | ROBUST, try-locked
  alignas(64) std::atomic<int64_t> attached[kShmCacheAttachSlots];  // 0 = free slot
};
static_assert(sizeof(ShmCacheHeader) <= kShmCacheHeaderBytes, "header too large");
constexpr size_t kShmCacheInitializedOffset = offsetof(ShmCacheHeader, initialized);

struct ShmCacheParams {
  uint64_t num_sets = 0;
  uint32_t ways = 0;
  uint32_t vec_size = 0;
  CachePolicy policy = CachePolicy::kLru;
  Precision precision = Precision::kFp32;
};

struct ShmCacheLayout {
  uint64_t set_stride, vec_offset, sets_offset, sketch_offset, sketch_width, total_bytes;
};

namespace shm_detail {

constexpr uint64_t round_up(uint64_t x, uint64_t a) noexcept { return (x + a - 1) / a * a; }
constexpr uint64_t kSketchSalt = 0xd6e8feb86659fd93ULL;
constexpr uint64_t kSketchRowStep = 0x9e3779b97f4a7c15ULL;
constexpr uint64_t kNibbleLowBits = 0x7777777777777777ULL;
// Reader spin budget while a set's seq is odd: kPauseSpins busy spins, then
// sched_yield until kOddSpinLimit, then take the (robust) set lock.
constexpr unsigned kPauseSpins = 64;
constexpr unsigned kOddSpinLimit = 64 + 256;
// Consecutive seq mismatches (a busy writer) before a reader takes the lock.
constexpr unsigned kRetryLimit = 32;

// Prefetches the cache lines of one vector (at most 8; the hardware streamer takes
// the rest of longer rows).
inline void prefetch_row(const void* p, size_t bytes) noexcept {
  const uint8_t* a = static_cast<const uint8_t*>(p);
  const uint8_t* end = a + std::min<size_t>(bytes, 8 * 64);
  for (; a < end; a += 64) TRITON_REC_PREFETCH(a);
}

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Offset within a set of its valid[ways] bytes: in the 8 header bytes after the mutex
// when they fit, else after the ticks (the set layout above).
constexpr uint64_t valid_offset(uint64_t ways) noexcept {
  return ways <= kShmCacheHeaderValidWays ? 64 - kShmCacheHeaderValidWays : 64 + 16 * ways;
}

inline bool is_pow2(uint64_t x) noexcept { return x && !(x & (x - 1)); }

inline unsigned log2_pow2(uint64_t x) noexcept {
  unsigned r = 0;
  while ((uint64_t{1} << r) < x) ++r;
  return r;
}

inline void init_robust_mutex(pthread_mutex_t* m) {
  pthread_mutexattr_t attr;
  int rc = pthread_mutexattr_init(&attr);
  if (!rc) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
  if (!rc) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
  if (!rc) rc = pthread_mutex_init(m, &attr);
  pthread_mutexattr_destroy(&attr);
  if (rc) throw std::system_error(rc, std::generic_category(), "pthread_mutex_init");
}

}  // namespace shm_detail

// Validates parameters and computes the layout; throws std::invalid_argument.
inline ShmCacheLayout shm_cache_layout(const ShmCacheParams& p) {
  using shm_detail::round_up;
  if (!shm_detail::is_pow2(p.num_sets) || p.num_sets > kShmCacheMaxSets) {
    throw std::invalid_argument("num_sets must be a power of two in [1, 2^40], got " +
                                std::to_string(p.num_sets));
  }
  if (p.ways < 1 || p.ways > kShmCacheMaxWays) {
    throw std::invalid_argument("ways must be in [1, " + std::to_string(kShmCacheMaxWays) +
                                "], got " + std::to_string(p.ways));
  }
  if (p.vec_size < 1 || p.vec_size > kShmCacheMaxVecSize) {
    throw std::invalid_argument("vec_size must be in [1, " + std::to_string(kShmCacheMaxVecSize) +
                                "], got " + std::to_string(p.vec_size));
  }
  if (p.policy != CachePolicy::kLru && p.policy != CachePolicy::kTinyLfu) {
    throw std::invalid_argument("unknown cache policy " +
                                std::to_string(static_cast<uint32_t>(p.policy)));
  }
  ShmCacheLayout l{};
  const uint64_t w = p.ways;
  l.vec_offset = round_up(std::max(64 + 16 * w, shm_detail::valid_offset(w) + round_up(w, 8)), 64);
  if (static_cast<uint32_t>(p.precision) >= kNumPrecisions) {
    throw std::invalid_argument("unknown row precision " +
                                std::to_string(static_cast<uint32_t>(p.precision)));
  }
  l.set_stride = round_up(l.vec_offset + w * row_bytes_of(p.precision, p.vec_size), 64);
  l.sets_offset = kShmCacheHeaderBytes;
  const uint64_t room = kShmCacheMaxBytes - l.sets_offset;
  if (p.num_sets > room / l.set_stride) {
    throw std::invalid_argument("cache too large: " + std::to_string(p.num_sets) + " sets of " +
                                std::to_string(l.set_stride) + " bytes");
  }
  l.sketch_offset = l.sets_offset + p.num_sets * l.set_stride;
  l.sketch_width = 0;
  l.total_bytes = l.sketch_offset;
  if (p.policy == CachePolicy::kTinyLfu) {
    const uint64_t capacity = p.num_sets * w;
    uint64_t width = kSketchMinWidth;
    while (width < 8 * capacity) width <<= 1;
    const uint64_t bytes = kSketchRows * width / 2;  // 4 bits per counter
    if (bytes > kShmCacheMaxBytes - l.sketch_offset) {
      throw std::invalid_argument("cache too large (TinyLFU sketch)");
    }
    l.sketch_width = width;
    l.total_bytes += bytes;
  }
  return l;
}

}  // namespace triton_rec
