// The host side of the device cache's writes, and the CPU twin of its kernels.
//
// group_writes() turns a batch of keys into what trec_cache_write takes: the distinct keys
// (the last occurrence of each wins), grouped by set in batch order. The GPU path and the
// twin both use it. The twin functions run the rules of array_cache_rules.hpp over state
// arrays in host memory, one key or set at a time (SerialGroup), exactly as the kernels
// do with a warp each; tests/unit/test_gpu_kernels.py holds them to the numpy reference
// (ArrayEmbeddingCache with numpy), and the GPU check holds the kernels to both.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "array_cache_rules.hpp"

namespace triton_rec {
namespace xcache {

// A batch of writes grouped by set: set sets[t] gets keys[starts[t]..starts[t+1]), whose
// rows are rows[src[i]] of the caller's row array.
struct GroupedWrites {
  std::vector<int64_t> keys, src, sets, starts;
  int64_t size() const { return static_cast<int64_t>(keys.size()); }
  int64_t touched() const { return static_cast<int64_t>(sets.size()); }
};

inline void group_writes(const View& c, const int64_t* keys, int64_t n, GroupedWrites* g) {
  g->keys.clear();
  g->src.clear();
  g->sets.clear();
  g->starts.clear();
  // the last occurrence of each key, in batch order
  std::vector<int64_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), int64_t{0});
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return keys[a] < keys[b]; });
  std::vector<int64_t> last;
  last.reserve(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) {
    if (i + 1 == idx.size() || keys[idx[i]] != keys[idx[i + 1]]) last.push_back(idx[i]);
  }
  std::sort(last.begin(), last.end());
  // grouped by set, batch order within a set
  std::vector<int64_t> set(last.size());
  for (size_t i = 0; i < last.size(); ++i) set[i] = set_of(c, keys[last[i]]);
  std::vector<int64_t> order(last.size());
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return set[a] < set[b]; });
  g->keys.reserve(order.size());
  g->src.reserve(order.size());
  for (size_t i = 0; i < order.size(); ++i) {
    const int64_t o = order[i];
    if (i == 0 || set[o] != set[order[i - 1]]) {
      g->sets.push_back(set[o]);
      g->starts.push_back(static_cast<int64_t>(i));
    }
    g->keys.push_back(keys[last[o]]);
    g->src.push_back(last[o]);
  }
  g->starts.push_back(static_cast<int64_t>(order.size()));
}

// -- the CPU twin -------------------------------------------------------------------------

// A cache query of trec_lookup_tables on host memory: statuses into status[0..n), vectors into out
// [n, dim].
inline void twin_query(const View& c, const int64_t* keys, int64_t n, float* out, uint8_t* status) {
  if (n <= 0) return;
  const int64_t tick = c.meta[kClock] + 1;
  const SerialGroup g;
  for (int64_t i = 0; i < n; ++i) status[i] = query_key(g, c, keys[i], out + i * c.dim, tick);
  advance_clock(c);
  if (count_keys(c, n)) {
    halve_sketch(c, 0, 1);
    sketch_aged(c);
  }
}

// trec_cache_write on host memory (the caller holds the writer lock); adds the call's
// counts to counts[kWriteCounts] and to meta.
inline void twin_write(const View& c, int32_t mode, const GroupedWrites& w, const uint8_t* rows,
                       int64_t* counts) {
  if (w.size() == 0) return;
  const int64_t tick = c.meta[kClock] + 1;
  const SerialGroup g;
  std::vector<int32_t> target(static_cast<size_t>(w.size()));
  const int kMetaOf[kWriteCounts] = {kInserts,  kUpdates, kEvictions, kRejected,
                                     kOverflow, kErased,  kRecovered};
  for (int64_t t = 0; t < w.touched(); ++t) {
    const int64_t s = w.sets[t], b = w.starts[t], count = w.starts[t + 1] - b;
    int64_t local[kWriteCounts] = {0, 0, 0, 0, 0, 0, 0};
    begin_write(c, s, &local[kWRecovered]);
    plan_set(c, mode, s, w.keys.data() + b, count, target.data() + b, tick, local);
    copy_rows(g, c, s, w.src.data() + b, count, target.data() + b, rows);
    end_write(c, s);
    for (int k = 0; k < kWriteCounts; ++k) {
      counts[k] += local[k];
      c.meta[kMetaOf[k]] += local[k];
    }
  }
  if (mode == kModeInsert) advance_clock(c);
}

// A whole write on host memory, as gpu::write_host is on the device: keys[0..n) grouped
// by set, then twin_write (the caller holds the writer lock).
inline void twin_write_keys(const View& c, int32_t mode, const int64_t* keys, int64_t n,
                            const uint8_t* rows, int64_t* counts) {
  thread_local GroupedWrites g;
  group_writes(c, keys, n, &g);
  twin_write(c, mode, g, rows, counts);
}

// trec_cache_clear on host memory; returns the sets healed.
inline int64_t twin_clear(const View& c) {
  int64_t recovered = 0;
  for (int64_t s = 0; s < c.num_sets; ++s) {
    begin_write(c, s, &recovered);
    for (int64_t w = 0; w < c.ways; ++w) c.valid[s * c.ways + w] = 0;
    end_write(c, s);
  }
  if (c.sketch != nullptr) std::fill_n(c.sketch, kSketchRows * c.sketch_width, uint8_t{0});
  c.meta[kIncs] = 0;
  c.meta[kRecovered] += recovered;
  return recovered;
}

// trec_cache_repair on host memory; returns the sets healed.
inline int64_t twin_repair(const View& c) {
  int64_t recovered = 0;
  for (int64_t s = 0; s < c.num_sets; ++s) {
    if (c.seq[s] & 1) {
      begin_write(c, s, &recovered);
      end_write(c, s);
    }
  }
  c.meta[kRecovered] += recovered;
  return recovered;
}

}  // namespace xcache
}  // namespace triton_rec
