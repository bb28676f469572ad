// Hot loops of the whole-model request path (HugeCTR layout), without Python.
//
// Both functions are fast paths of a reference written in Python: they return false on
// any input the reference rejects, and the caller then runs the reference, which raises
// the error that names the problem (triton_rec/serving/hugectr_request.py, triton_rec/dense).
// So the messages live in one place; tests check that both accept the same inputs.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "hash_index.hpp"
#include "row_parts.hpp"

namespace triton_rec {

// Whether x[0..n) holds no NaN and no infinity. A loop that returns at the first one is
// scalar (a branch per value); this tests the exponent bits of a chunk at a time, a
// reduction the compiler vectorizes (a dense step's 53 k embedding values per request
// went from 17 us to a few).
inline bool all_finite(const float* x, int64_t n) noexcept {
  constexpr int64_t kChunk = 1024;
  for (int64_t a = 0; a < n; a += kChunk) {
    const int64_t b = a + kChunk < n ? a + kChunk : n;
    uint32_t bad = 0;
    for (int64_t i = a; i < b; ++i) {
      uint32_t u;
      std::memcpy(&u, x + i, 4);
      bad |= static_cast<uint32_t>((u & 0x7f800000u) == 0x7f800000u);
    }
    if (bad != 0) return false;
  }
  return true;
}

// Whether the CSR row pointers ptr[0..segments] give each segment exactly one of `rows`
// rows, in order (a one-hot table's slots): then the combiner's output is its input, bit
// for bit (a single row summed, and `mean` divides only counts above 1).
inline bool one_row_per_segment(const int64_t* ptr, int64_t segments, int64_t rows) noexcept {
  if (rows != segments) return false;
  for (int64_t s = 0; s <= segments; ++s) {
    if (ptr[s] != s) return false;
  }
  return true;
}

// HugeCTR's combiner over CSR segments (embedding_feature_combiner.cu): out[s] = sum of
// vectors[ptr[s] .. ptr[s+1]) in row order, in float32; `mean` divides by the count only
// when it is above 1; an empty segment gives zeros. False (nothing written) unless
// 0 <= ptr[0] <= ... <= ptr[segments] <= rows.
inline bool combine_segments(const float* vectors, int64_t rows, int64_t dim, const int64_t* ptr,
                             int64_t segments, bool mean, float* out) {
  if (segments < 0 || (segments > 0 && ptr[0] < 0)) return false;
  for (int64_t s = 0; s < segments; ++s) {
    if (ptr[s + 1] < ptr[s]) return false;
  }
  if (segments > 0 && ptr[segments] > rows) return false;
  for (int64_t s = 0; s < segments; ++s) {
    float* acc = out + s * dim;
    const int64_t a = ptr[s], b = ptr[s + 1];
    if (a == b) {
      std::memset(acc, 0, sizeof(float) * static_cast<size_t>(dim));
      continue;
    }
    std::memcpy(acc, vectors + a * dim, sizeof(float) * static_cast<size_t>(dim));
    for (int64_t r = a + 1; r < b; ++r) {
      const float* v = vectors + r * dim;
      for (int64_t d = 0; d < dim; ++d) acc[d] += v[d];
    }
    if (mean && b - a > 1) {
      const float n = static_cast<float>(b - a);
      for (int64_t d = 0; d < dim; ++d) acc[d] /= n;
    }
  }
  return true;
}

// Row pointers a part of widen_row_pointers takes at least (a table of 65,536 one-hot
// samples is one part's worth).
constexpr int64_t kWidenPointersPerPart = 65536;

// ROWINDEX of a HugeCTR request widened to int64 into out_ptrs (same layout: per table t a
// block of samples * slots[t] + 1 row pointers counted within that table's keys), and the
// start of each table's keys into key_offsets[0..tables]. False unless every block starts
// at 0 and never decreases. The caller has checked that rowindex holds
// sum_t(samples * slots[t] + 1) values. *one_per_slot (when given): whether every block is
// 0, 1, 2, ...: each slot of each sample holds exactly one key (one-hot tables, as
// MLPerf's DLRM has).
inline bool widen_row_pointers(const int32_t* rowindex, const int64_t* slots, int64_t tables,
                               int64_t samples, int64_t* key_offsets, int64_t* out_ptrs,
                               bool* one_per_slot = nullptr) {
  // One table's block: widened, and whether it is in order and 0, 1, 2, ... (no early
  // exit: the loop stays branch-free).
  auto widen = [&](int64_t block, int64_t len, bool* ordered, bool* same) {
    const int32_t* rp = rowindex + block;
    bool in_order = rp[0] == 0, identity = rp[0] == 0;
    for (int64_t j = 1; j < len; ++j) {
      in_order &= rp[j] >= rp[j - 1];
      identity &= rp[j] == j;
    }
    for (int64_t j = 0; j < len; ++j) out_ptrs[block + j] = rp[j];
    *ordered = in_order;
    *same = identity;
  };
  // A request of many row pointers widens its tables on the cores no other call is using
  // (IdleParts), a run of whole tables a part.
  int64_t pointers = 0;
  for (int64_t t = 0; t < tables; ++t) pointers += samples * slots[t] + 1;
  const IdleParts split(pointers / kWidenPointersPerPart);
  const int parts =
      static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(split.parts(), tables)));
  thread_local std::vector<uint8_t> flags;  // per table: in order, identity (the caller's)
  flags.assign(static_cast<size_t>(2 * tables), 0);
  uint8_t* flag = flags.data();  // what the parts write: not their own thread's `flags`
  auto tables_of = [&](int p) {
    const int64_t first = tables * p / parts, last = tables * (p + 1) / parts;
    int64_t block = 0;
    for (int64_t t = 0; t < first; ++t) block += samples * slots[t] + 1;
    for (int64_t t = first; t < last; ++t) {
      const int64_t len = samples * slots[t] + 1;
      bool ordered = false, same = false;
      widen(block, len, &ordered, &same);
      flag[2 * t] = ordered;
      flag[2 * t + 1] = same;
      block += len;
    }
  };
  if (parts <= 1) {
    tables_of(0);
  } else {
    RowPool::instance().run(parts, tables_of);
  }
  int64_t block = 0, total = 0;
  bool identity = true;
  key_offsets[0] = 0;
  for (int64_t t = 0; t < tables; ++t) {
    if (!flag[2 * t]) return false;
    identity = identity && flag[2 * t + 1];
    block += samples * slots[t] + 1;
    total += out_ptrs[block - 1];
    key_offsets[t + 1] = total;
  }
  if (one_per_slot != nullptr) *one_per_slot = identity;
  return true;
}

// regroup_hugectr's keys of a request whose every slot holds one key: a transpose of the
// [samples, sum(slots)] CATCOLUMN into one [samples, slots[t]] block per table, in runs of
// kRun samples whose source rows stay in the cache while each table takes its columns. A
// request of many samples splits its runs across the cores no other call is using, as the
// dense executor does (row_parts.hpp: idle cores, TRITON_REC_DENSE_THREADS), one part per
// kRegroupSamplesPerPart samples at most. 65,536 samples x 26 keys on the development
// machine (2 cores, memory-bound): 5.1 ms on one core, 4.3 ms over both.
constexpr int64_t kRegroupSamplesPerPart = 8192;

template <typename Key>
void regroup_one_per_slot(const Key* cat, const int64_t* slots, int64_t tables, int64_t samples,
                          const int64_t* key_offsets, int64_t* out_keys) {
  constexpr int64_t kRun = 256;
  int64_t width = 0;
  for (int64_t t = 0; t < tables; ++t) width += slots[t];
  auto runs = [&](int64_t first, int64_t last) {  // samples [first, last)
    for (int64_t i0 = first; i0 < last; i0 += kRun) {
      const int64_t i1 = i0 + kRun < last ? i0 + kRun : last;
      int64_t column = 0;
      for (int64_t t = 0; t < tables; ++t) {
        const int64_t st = slots[t];
        const Key* src = cat + i0 * width + column;
        int64_t* dst = out_keys + key_offsets[t] + i0 * st;
        if (st == 1) {
          for (int64_t i = 0; i < i1 - i0; ++i) dst[i] = static_cast<int64_t>(src[i * width]);
        } else {
          for (int64_t i = 0; i < i1 - i0; ++i, src += width, dst += st) {
            for (int64_t j = 0; j < st; ++j) dst[j] = static_cast<int64_t>(src[j]);
          }
        }
        column += st;
      }
    }
  };
  const IdleParts split(samples / kRegroupSamplesPerPart);
  const int parts = split.parts();
  if (parts == 1) {
    runs(0, samples);
    return;
  }
  const int64_t per = ((samples + parts - 1) / parts + kRun - 1) / kRun * kRun;  // whole runs
  RowPool::instance().run(parts, [&](int p) {
    const int64_t first = p * per, last = first + per < samples ? first + per : samples;
    if (first < last) runs(first, last);
  });
}

// Regroups a HugeCTR request by table. CATCOLUMN is sample-major (sample 0's keys of
// table 0, of table 1, ..., then sample 1's); ROWINDEX holds per table t a block of
// samples * slots[t] + 1 row pointers starting at 0, counted within that table's keys.
// Writes every key table-major into out_keys (widened to int64), the start of each
// table's keys into key_offsets[0..tables], and the row pointers as int64 into out_ptrs
// (same layout as ROWINDEX). False unless every block starts at 0, never decreases, and
// the blocks' key counts add up to exactly `keys`. The caller has checked the lengths:
// rowindex holds sum_t(samples * slots[t] + 1) values.
template <typename Key>
bool regroup_hugectr(const Key* cat, int64_t keys, const int32_t* rowindex, const int64_t* slots,
                     int64_t tables, int64_t samples, int64_t* out_keys, int64_t* key_offsets,
                     int64_t* out_ptrs) {
  bool one_per_slot = false;
  if (!widen_row_pointers(rowindex, slots, tables, samples, key_offsets, out_ptrs, &one_per_slot)) {
    return false;
  }
  if (key_offsets[tables] != keys) return false;
  if (one_per_slot) {
    regroup_one_per_slot(cat, slots, tables, samples, key_offsets, out_keys);
    return true;
  }
  // Sample i's keys of table t are rp_t[i*s_t] .. rp_t[(i+1)*s_t) within that table.
  int64_t pos = 0;
  for (int64_t i = 0; i < samples; ++i) {
    int64_t b = 0;
    for (int64_t t = 0; t < tables; ++t) {
      const int64_t* rp = out_ptrs + b;
      const int64_t first = rp[i * slots[t]], last = rp[(i + 1) * slots[t]];
      int64_t* dst = out_keys + key_offsets[t] + first;
      for (int64_t k = 0; k < last - first; ++k) dst[k] = static_cast<int64_t>(cat[pos + k]);
      pos += last - first;
      b += samples * slots[t] + 1;
    }
  }
  return true;
}

// HPS's hit rate of one lookup counts each key once (embedding_cache.cpp, UniqueOp):
// writes the number of distinct keys of keys[0..n) to *distinct and how many of them
// hit (hit[i] != 0; a key's copies share one hit flag) to *distinct_hits. One pass
// over an open-addressing set in `scratch` (capacity: a power of two >= 2n, given as
// `capacity`; its words are overwritten); slot emptiness is kept in `used`.
inline void count_distinct_hits(const int64_t* keys, const uint8_t* hit, int64_t n,
                                int64_t* scratch, uint8_t* used, uint64_t capacity,
                                int64_t* distinct, int64_t* distinct_hits) {
  const uint64_t mask = capacity - 1;
  std::memset(used, 0, capacity);
  int64_t d = 0, dh = 0;
  for (int64_t i = 0; i < n; ++i) {
    uint64_t s = mix64(static_cast<uint64_t>(keys[i])) & mask;
    while (used[s] && scratch[s] != keys[i]) s = (s + 1) & mask;
    if (!used[s]) {
      used[s] = 1;
      scratch[s] = keys[i];
      ++d;
      dh += hit[i] != 0;
    }
  }
  *distinct = d;
  *distinct_hits = dh;
}

}  // namespace triton_rec
