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
#include <climits>
#include <cstdint>
#include <cstring>
#include <stdexcept>
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

// Linear-probing scratch of group_writes: a slot is (key, a and b: what the caller keeps),
// a < 0 for an empty slot; one cache line holds four.
struct ProbeTable {
  struct Slot {
    int64_t key;
    int32_t a, b;
  };
  std::vector<Slot> slots;
  uint64_t mask = 0;
  void reset(size_t n) {  // room for n entries, at most half full
    uint64_t cap = 16;
    while (cap < 2 * static_cast<uint64_t>(n)) cap <<= 1;
    slots.assign(cap, Slot{0, -1, -1});
    mask = cap - 1;
  }
  void prefetch(int64_t k) const {
    __builtin_prefetch(&slots[static_cast<size_t>(mix64(static_cast<uint64_t>(k)) & mask)], 1);
  }
  // The slot of k: where it is, or the empty slot it goes to.
  Slot& find(int64_t k) {
    size_t i = static_cast<size_t>(mix64(static_cast<uint64_t>(k)) & mask);
    while (slots[i].a >= 0 && slots[i].key != k) i = (i + 1) & mask;
    return slots[i];
  }
};

// One pass over the batch with a hash of its keys (each key's last occurrence and its set's
// group) and a hash of their sets, then a counting scatter: O(n), no sort (sorting twice,
// a 26,624-key batch took 4.9 ms; the write of a device cache's misses waits for it). Sets
// come in the order they first appear; a set's keys in batch order.
inline void group_writes(const View& c, const int64_t* keys, int64_t n, GroupedWrites* g) {
  g->keys.clear();
  g->src.clear();
  g->sets.clear();
  g->starts.clear();
  if (n > INT32_MAX) throw std::length_error("group_writes: more than 2^31 keys");
  struct Scratch {
    ProbeTable seen, groups;
    std::vector<int32_t> group_of;  // per batch index; -1: a later one wins
    std::vector<int64_t> next;      // per group: its next free place
  };
  thread_local Scratch scratch;
  // references taken once: in a shared library each use of a thread_local by name may
  // cost a __tls_get_addr call (7% of this function, in a profile)
  ProbeTable& seen = scratch.seen;
  ProbeTable& groups = scratch.groups;
  std::vector<int32_t>& group_of = scratch.group_of;
  std::vector<int64_t>& next = scratch.next;
  seen.reset(static_cast<size_t>(n));
  groups.reset(static_cast<size_t>(n));
  group_of.resize(static_cast<size_t>(n));
  next.clear();
  int64_t distinct = 0;
  constexpr int64_t kAhead = 16;  // the tables outgrow the CPU's caches: fetch ahead
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      const int64_t ahead = keys[i + kAhead];
      seen.prefetch(ahead);
      groups.prefetch(set_of(c, ahead));
    }
    ProbeTable::Slot& k = seen.find(keys[i]);
    if (k.a >= 0) {  // seen before: this occurrence replaces that one, in the same set
      group_of[static_cast<size_t>(k.a)] = -1;
    } else {
      k.key = keys[i];
      const int64_t s = set_of(c, keys[i]);
      ProbeTable::Slot& q = groups.find(s);
      if (q.a < 0) {
        q.key = s;
        q.a = static_cast<int32_t>(g->sets.size());
        g->sets.push_back(s);
        next.push_back(0);
      }
      k.b = q.a;
      ++next[static_cast<size_t>(q.a)];
      ++distinct;
    }
    k.a = static_cast<int32_t>(i);
    group_of[static_cast<size_t>(i)] = k.b;
  }
  g->starts.resize(g->sets.size() + 1);
  g->starts[0] = 0;
  for (size_t t = 0; t < g->sets.size(); ++t) {
    g->starts[t + 1] = g->starts[t] + next[t];
    next[t] = g->starts[t];
  }
  g->keys.resize(static_cast<size_t>(distinct));
  g->src.resize(static_cast<size_t>(distinct));
  for (int64_t i = 0; i < n; ++i) {
    const int32_t t = group_of[static_cast<size_t>(i)];
    if (t < 0) continue;
    const auto at = static_cast<size_t>(next[static_cast<size_t>(t)]++);
    g->keys[at] = keys[i];
    g->src[at] = i;
  }
}

// -- the CPU twin -------------------------------------------------------------------------

// trec_lookup_tables on host memory (targets and everything they point to in host memory):
// the same spans (spans[2t] table t's first key, spans[2t + 1] its first float in out,
// spans[2 * tables] one past the last key), the same rules, a key at a time.
inline void twin_lookup_tables(const LookupTarget* targets, const int64_t* spans, int tables,
                               const int64_t* keys, float* out, uint8_t* status) {
  if (tables <= 0) return;
  std::vector<int64_t> first(static_cast<size_t>(tables) + 1), ticks(first.size());
  for (int t = 0; t <= tables; ++t) first[t] = spans[2 * t];
  for (int t = 0; t < tables; ++t) {  // a cache's clock: what its keys stamp with
    ticks[t] = targets[t].cache ? targets[t].view.meta[kClock] + 1 : 0;
  }
  const SerialGroup g;
  for (int64_t i = first[0]; i < first[tables]; ++i) {
    const int t = table_of(first.data(), tables, i);
    const LookupTarget& tg = targets[t];
    float* dst = out + spans[2 * t + 1] + (i - first[t]) * tg.dim();
    status[i] = tg.cache ? query_key(g, tg.view, keys[i], dst, ticks[t])
                         : whole_table_key(g, tg.table, tg.row_bytes(), keys[i], dst);
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

// trec_cache_write on host memory, with the kernel's arguments (the caller holds the
// writer lock, `exclusive`ly or shared, as begin_write says): sets[0..touched), set t's
// keys keys[starts[t]..starts[t+1]) with rows rows[src[i]], target [starts[touched]]
// scratch; adds the call's counts to counts[kWriteResults] (the busy keys last) and to
// meta.
inline void twin_write(const View& c, int32_t mode, bool exclusive, const int64_t* keys,
                       const int64_t* src, const int64_t* sets, const int64_t* starts,
                       int64_t touched, const uint8_t* rows, int32_t* target, int64_t* counts) {
  if (touched == 0) return;
  const int64_t tick = load_fresh(c.meta + kClock) + 1;
  const SerialGroup g;
  for (int64_t t = 0; t < touched; ++t) {
    const int64_t s = sets[t], b = starts[t], count = starts[t + 1] - b;
    int64_t local[kWriteCounts] = {0, 0, 0, 0, 0, 0, 0};
    if (!begin_write(c, s, exclusive, &local[kWRecovered])) {
      give_up_set(target + b, count, counts);
      continue;
    }
    plan_set(c, mode, s, keys + b, count, target + b, tick, local);
    copy_rows(g, c, s, src + b, count, target + b, rows);
    end_write(c, s);
    add_write_counts(c, local, counts);
  }
  if (mode == kModeInsert) advance_clock(c);
}

// One write (insert, update, erase) of one cache among several written together.
struct WritePart {
  View view;
  int32_t mode = kModeInsert;
  const int64_t* keys = nullptr;
  int64_t n = 0;
  const uint8_t* rows = nullptr;  // [n, view.row_bytes]; null for erase
};

// The keys that a write under the shared lock left in busy sets, with their rows, by part
// of the write: written again under the exclusive lock (ArrayMissCache).
struct BusyWrites {
  struct Part {
    size_t part = 0;
    std::vector<int64_t> keys;
    std::vector<uint8_t> rows;  // empty for erase
  };
  std::vector<Part> parts;
};

// Several caches' writes in one staging buffer, as gpu::write_many copies it to the device
// in one copy and launches trec_cache_write once per write, and twin_write_staged runs the
// twin on it: part p's grouped keys, sources, sets, starts (touched + 1) and rows, one part
// after the other, then every part's row targets (the kernel's scratch) and results
// (kWriteResults each), which are not uploaded. Offsets are 256-byte aligned.
class StagedWrites {
 public:
  enum Field { kKeys, kSrc, kSets, kStarts, kRows, kTarget, kCounts, kFields };

  // Groups every part's keys (group_writes) and lays the buffer out.
  void plan(const WritePart* parts, size_t n) {
    grouped_.resize(std::max(grouped_.size(), n));
    offsets_.assign(n * kFields, 0);
    size_t at = 0;
    auto take = [&](size_t bytes) {
      const size_t here = at;
      at += (bytes + 255) & ~size_t{255};
      return here;
    };
    for (size_t p = 0; p < n; ++p) {
      group_writes(parts[p].view, parts[p].keys, parts[p].n, &grouped_[p]);
      const GroupedWrites& g = grouped_[p];
      const size_t m = static_cast<size_t>(g.size()), t = static_cast<size_t>(g.touched());
      size_t* o = &offsets_[p * kFields];
      o[kKeys] = take(m * 8);
      o[kSrc] = take(m * 8);
      o[kSets] = take(t * 8);
      o[kStarts] = take((t + 1) * 8);
      o[kRows] = take(
          parts[p].rows != nullptr ? static_cast<size_t>(parts[p].n * parts[p].view.row_bytes) : 0);
    }
    upload_ = at;
    for (size_t p = 0; p < n; ++p) {
      offsets_[p * kFields + kTarget] = take(static_cast<size_t>(grouped_[p].size()) * 4);
    }
    counts_ = at;
    for (size_t p = 0; p < n; ++p) offsets_[p * kFields + kCounts] = take(8 * kWriteResults);
    total_ = at;
  }
  // Writes every part's fields into h (total() bytes) and zeroes the counts.
  void fill(char* h, const WritePart* parts, size_t n) const {
    for (size_t p = 0; p < n; ++p) {
      const GroupedWrites& g = grouped_[p];
      const size_t m = static_cast<size_t>(g.size()), t = static_cast<size_t>(g.touched());
      if (m == 0) continue;  // nothing to write: no launch reads its fields
      std::memcpy(h + at(p, kKeys), g.keys.data(), m * 8);
      std::memcpy(h + at(p, kSrc), g.src.data(), m * 8);
      std::memcpy(h + at(p, kSets), g.sets.data(), t * 8);
      std::memcpy(h + at(p, kStarts), g.starts.data(), (t + 1) * 8);
      if (parts[p].rows != nullptr) {
        std::memcpy(h + at(p, kRows), parts[p].rows,
                    static_cast<size_t>(parts[p].n * parts[p].view.row_bytes));
      }
    }
    std::memset(h + counts_, 0, total_ - counts_);
  }
  // Adds the keys of `part` (written as parts[p]) whose targets say busy to `busy` (null:
  // the write held the exclusive lock, where no set is busy).
  void collect_busy(size_t p, const int32_t* target, const WritePart& part,
                    BusyWrites* busy) const {
    if (busy == nullptr)
      throw std::logic_error("a write under the exclusive lock found a busy set");
    const GroupedWrites& g = grouped_[p];
    BusyWrites::Part left;
    left.part = p;
    const size_t rb = static_cast<size_t>(part.view.row_bytes);
    for (int64_t i = 0; i < g.size(); ++i) {
      if (target[i] != kBusyTarget) continue;
      left.keys.push_back(g.keys[i]);
      if (part.rows != nullptr) {
        const uint8_t* row = part.rows + static_cast<size_t>(g.src[i]) * rb;
        left.rows.insert(left.rows.end(), row, row + rb);
      }
    }
    if (!left.keys.empty()) busy->parts.push_back(std::move(left));
  }
  size_t at(size_t part, Field f) const { return offsets_[part * kFields + f]; }
  int64_t touched(size_t part) const { return grouped_[part].touched(); }
  int64_t distinct(size_t part) const { return grouped_[part].size(); }  // its keys, grouped
  size_t upload() const { return upload_; }  // the bytes before the first target
  size_t counts() const { return counts_; }  // where the counts start
  size_t total() const { return total_; }

 private:
  std::vector<GroupedWrites> grouped_;
  std::vector<size_t> offsets_;
  size_t upload_ = 0, counts_ = 0, total_ = 0;
};

// The writes of parts[0..n) as gpu::write_many runs them, on host memory: staged into one
// buffer by StagedWrites, then twin_write of each part on the staged fields (the caller
// holds every cache's writer lock, `exclusive`ly or shared); adds part p's counts to
// counts[p * kWriteCounts ...] and the keys left in busy sets to `busy` (shared only).
inline void twin_write_staged(const WritePart* parts, size_t n, int64_t* counts, bool exclusive,
                              BusyWrites* busy) {
  thread_local StagedWrites staged;
  thread_local std::vector<char> h;
  staged.plan(parts, n);
  h.resize(staged.total());
  staged.fill(h.data(), parts, n);
  for (size_t p = 0; p < n; ++p) {
    auto field = [&](StagedWrites::Field f) { return h.data() + staged.at(p, f); };
    auto* got = reinterpret_cast<int64_t*>(field(StagedWrites::kCounts));
    auto* target = reinterpret_cast<int32_t*>(field(StagedWrites::kTarget));
    twin_write(parts[p].view, parts[p].mode, exclusive,
               reinterpret_cast<const int64_t*>(field(StagedWrites::kKeys)),
               reinterpret_cast<const int64_t*>(field(StagedWrites::kSrc)),
               reinterpret_cast<const int64_t*>(field(StagedWrites::kSets)),
               reinterpret_cast<const int64_t*>(field(StagedWrites::kStarts)), staged.touched(p),
               parts[p].rows != nullptr
                   ? reinterpret_cast<const uint8_t*>(field(StagedWrites::kRows))
                   : nullptr,
               target, got);
    for (int k = 0; k < kWriteCounts; ++k) counts[p * kWriteCounts + k] += got[k];
    if (got[kWBusy] != 0) staged.collect_busy(p, target, parts[p], busy);
  }
}

// A whole write on host memory under the exclusive lock, as gpu::write_host is on the
// device: keys[0..n) staged as one part (twin_write_staged).
inline void twin_write_keys(const View& c, int32_t mode, const int64_t* keys, int64_t n,
                            const uint8_t* rows, int64_t* counts) {
  const WritePart part{c, mode, keys, n, rows};
  twin_write_staged(&part, 1, counts, true, nullptr);
}

// trec_cache_clear on host memory (the exclusive lock held); returns the sets healed.
inline int64_t twin_clear(const View& c) {
  int64_t recovered = 0;
  for (int64_t s = 0; s < c.num_sets; ++s) {
    begin_write(c, s, true, &recovered);
    for (int64_t w = 0; w < c.ways; ++w) c.valid[s * c.ways + w] = 0;
    end_write(c, s);
  }
  if (c.sketch != nullptr) std::fill_n(c.sketch, kSketchRows * c.sketch_width, uint8_t{0});
  c.meta[kIncs] = 0;
  c.meta[kRecovered] += recovered;
  return recovered;
}

// trec_cache_repair on host memory (the exclusive lock held); returns the sets healed.
inline int64_t twin_repair(const View& c) {
  int64_t recovered = 0;
  for (int64_t s = 0; s < c.num_sets; ++s) {
    if (c.seq[s] & 1) {
      begin_write(c, s, true, &recovered);
      end_write(c, s);
    }
  }
  c.meta[kRecovered] += recovered;
  return recovered;
}

}  // namespace xcache
}  // namespace triton_rec
