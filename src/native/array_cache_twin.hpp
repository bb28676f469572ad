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

// trec_lookup_tables on host memory (targets and everything they point to in host memory):
// the same spans (spans[2t] table t's first key, spans[2t + 1] its first float in out,
// spans[2 * tables] one past the last key), the same rules, a key at a time.
inline void twin_lookup_tables(const LookupTarget* targets, const int64_t* spans, int tables,
                               const int64_t* keys, float* out, uint8_t* status) {
  if (tables <= 0) return;
  std::vector<int64_t> first(static_cast<size_t>(tables) + 1), ticks(first.size());
  std::vector<int64_t> row_bytes(first.size());
  for (int t = 0; t <= tables; ++t) first[t] = spans[2 * t];
  for (int t = 0; t < tables; ++t) {
    const LookupTarget& tg = targets[t];
    ticks[t] = tg.cache ? tg.view.meta[kClock] + 1 : 0;
    row_bytes[t] = tg.cache
                       ? tg.view.row_bytes
                       : encoded_row_bytes(static_cast<uint32_t>(tg.table.precision), tg.table.dim);
  }
  const SerialGroup g;
  for (int64_t i = first[0]; i < first[tables]; ++i) {
    const int t = table_of(first.data(), tables, i);
    const LookupTarget& tg = targets[t];
    float* dst = out + spans[2 * t + 1] + (i - first[t]) * tg.dim();
    status[i] = tg.cache ? query_key(g, tg.view, keys[i], dst, ticks[t])
                         : whole_table_key(g, tg.table, row_bytes[t], keys[i], dst);
  }
  for (int t = 0; t < tables; ++t) {
    const int64_t n = first[t + 1] - first[t];
    if (!targets[t].cache || n <= 0) continue;
    const View& c = targets[t].view;
    advance_clock(c);
    if (count_keys(c, n)) {
      halve_sketch(c, 0, 1);
      sketch_aged(c);
    }
  }
}

// A cache query of keys[0..n) on host memory: statuses into status[0..n), vectors into
// out [n, dim] (twin_lookup_tables of one cache).
inline void twin_query(const View& c, const int64_t* keys, int64_t n, float* out, uint8_t* status) {
  LookupTarget t;
  t.view = c;
  const int64_t spans[3] = {0, 0, n};
  twin_lookup_tables(&t, spans, 1, keys, out, status);
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
