// The constants both sides of the seam between the native code and the Python engine
// use, defined here once: bindings*.cpp export each to triton_rec._native, and the engine
// takes them from there (cached_table.py, model_config.py), so neither side spells them
// again.
#pragma once

#include <cstdint>

namespace triton_rec {

// The counters an instance keeps per table where Python does not see the work (one int64
// each, added atomically): TableStats.native of cached_table.py, whose NATIVE_FIELDS are
// kTableStatNames (exported by bindings_local_misses.cpp as TABLE_STAT_FIELDS).
enum TableStat : int {
  kLookups = 0,
  kHits,
  kMisses,
  kSyncFetched,
  kCacheNs,
  kStoreNs,
  kNotFound,
  kDefaultAnswered,
  kQueued,
  kDropped,
  kNumTableStats
};
inline constexpr const char* kTableStatNames[kNumTableStats] = {
    "lookups",  "hits",      "misses",           "sync_fetched", "cache_ns",
    "store_ns", "not_found", "default_answered", "queued",       "dropped"};

inline void count(int64_t* stats, TableStat s, int64_t v) noexcept {
  if (v != 0) __atomic_fetch_add(stats + s, v, __ATOMIC_RELAXED);
}

// Why a key was answered with the default value: the columns of a request's default
// counts (DEFAULT_CAUSES of cached_table.py, exported as DEFAULT_CAUSES).
enum DefaultCause : int { kCauseNotFound = 0, kCauseAsync, kNumDefaultCauses };
inline constexpr const char* kDefaultCauseNames[kNumDefaultCauses] = {"not_found", "async"};

// The response's default-answer counts (one per DefaultCause, in order): INT32 outputs a
// model may declare and response parameters (DEFAULT_INFO of model_config.py).
inline constexpr const char* kDefaultInfo[kNumDefaultCauses] = {"DefaultNotFound", "DefaultAsync"};

// The request parameter asking for every miss fetched now (EXACT_PARAMETER).
inline constexpr const char* kExactParameter = "exact";

}  // namespace triton_rec
