// Open-addressing hash index over int64 keys and the fused probe + gather
// ("lookup") kernel. Header-only, no Python dependency.
//
// ============================ PERSISTED LAYOUT ==============================
// An index is a C-contiguous int64 array of shape (capacity, 2), native
// (little-endian) byte order; slot s occupies the two int64 words
//     slots[2*s + 0] = key
//     slots[2*s + 1] = row   (0-based row of the key in the table, or -1)
// * row == -1 marks an EMPTY slot. Keys may be any int64 value (including -1
//   and INT64_MIN), so emptiness is never encoded in the key word; the key
//   word of an empty slot is unspecified (build_index writes 0).
// * capacity = max(16, smallest power of two >= 2 * N)  (load factor <= 0.5);
//   see index_capacity().
// * home slot of key k: mix64(uint64(k)) & (capacity - 1), where mix64 is the
//   splitmix64 finalizer:
//       z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
//       z = (z ^ (z >> 27)) * 0x94d049bb133111eb
//       z =  z ^ (z >> 31)
// * collisions: linear probing, slot = (slot + 1) & (capacity - 1), until the
//   key or an empty slot is found. Keys are inserted in row order 0..N-1.
// * keys are unique; rows are exactly 0..N-1, each appearing once.
// Changing anything above changes the on-disk format.
// ============================================================================
//
// A table whose keys are a range (keys[i] == base + i for every row i, modulo 2^64) needs
// no index: its row is key - base. Native calls take such a table's *direct index*, an
// in-memory form that is never persisted: an int64 array of shape (1, 2) holding
// [base, N] (a capacity of 1, which no hash index has). See index_view().
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "hd.hpp"  // mix64, index_probe (also compiled into the GPU kernels)
#include "row_codec.hpp"

namespace triton_rec {

constexpr int64_t kEmptyRow = -1;
constexpr uint64_t kMinCapacity = 16;
// Largest table build_index accepts (keeps capacity arithmetic far from overflow).
constexpr uint64_t kMaxKeys = uint64_t{1} << 60;
// lookup() never gives a thread fewer keys than this (thread start-up costs more).
constexpr size_t kMinKeysPerThread = 2048;

#if defined(__GNUC__) || defined(__clang__)
#define TRITON_REC_PREFETCH(p) __builtin_prefetch((p), 0, 3)
#else
#define TRITON_REC_PREFETCH(p) ((void)(p))
#endif

// Number of slots of the index of a table with `num_keys` keys.
inline uint64_t index_capacity(uint64_t num_keys) {
  if (num_keys > kMaxKeys) {
    throw std::length_error("too many keys for one index: " + std::to_string(num_keys));
  }
  uint64_t cap = kMinCapacity;
  while (cap < 2 * num_keys) cap <<= 1;
  return cap;
}

inline bool is_valid_capacity(uint64_t capacity) noexcept {
  return capacity >= kMinCapacity && (capacity & (capacity - 1)) == 0;
}

// The same key appears twice in the table.
class DuplicateKeyError : public std::runtime_error {
 public:
  DuplicateKeyError(int64_t key, int64_t first_row, int64_t second_row)
      : std::runtime_error("duplicate key " + std::to_string(key) + " at rows " +
                           std::to_string(first_row) + " and " + std::to_string(second_row)),
        key(key), first_row(first_row), second_row(second_row) {}
  int64_t key, first_row, second_row;
};

// An index slot holds a row id that cannot be valid (negative other than the
// empty marker, or >= number of rows of the table it is used with).
class CorruptIndexError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Read-only view of an index; capacity must satisfy is_valid_capacity().
struct IndexView {
  const int64_t* slots;
  uint64_t capacity;
  // a direct index (a range of keys): rows key - base for base <= key < base + rows
  bool direct = false;
  int64_t base = 0;
  uint64_t rows = 0;
  uint64_t mask() const noexcept { return capacity - 1; }
  const int64_t* slot(uint64_t s) const noexcept { return slots + 2 * s; }
};

// The view of an index array of `capacity` slots (2 words each): a hash index (capacity
// a power of two >= 16), or a direct one (capacity 1: [base, rows], rows >= 0). Throws
// std::invalid_argument for any other capacity or a negative row count.
inline IndexView index_view(const int64_t* words, uint64_t capacity) {
  if (capacity == 1) {
    if (words[1] < 0) {
      throw std::invalid_argument("direct index with a negative row count " +
                                  std::to_string(words[1]));
    }
    return IndexView{words, 1, true, words[0], static_cast<uint64_t>(words[1])};
  }
  if (!is_valid_capacity(capacity)) {
    throw std::invalid_argument("index capacity " + std::to_string(capacity) +
                                " is neither a power of two >= 16 nor 1 (a direct index)");
  }
  return IndexView{words, capacity};
}

// Row-major table of `rows` encoded rows (row_codec.hpp) of `fmt.dim` values each.
struct TableView {
  const void* data;
  int64_t rows;
  RowFormat fmt;
  const uint8_t* row(int64_t r) const noexcept {
    return static_cast<const uint8_t*>(data) + static_cast<size_t>(r) * fmt.row_bytes;
  }
};

namespace detail {

[[noreturn]] inline void throw_bad_row(uint64_t slot, int64_t key, int64_t row, int64_t num_rows) {
  std::string msg = "corrupt index: slot " + std::to_string(slot) + " maps key " +
                    std::to_string(key) + " to row " + std::to_string(row);
  if (num_rows >= 0) {
    msg +=
        ", but vectors has " + std::to_string(num_rows) + " rows (index built for another table?)";
  }
  throw CorruptIndexError(msg);
}

// Finds `key` starting at its home slot `h`; returns its row or kEmptyRow.
// `num_rows` < 0 disables the upper bound check. A (corrupt) index without any
// empty slot is scanned at most once, so this always terminates.
inline int64_t find(const IndexView& ix, int64_t key, uint64_t h, int64_t num_rows) {
  if (ix.direct) {  // modulo 2^64, as the range is: no overflow, every key answered once
    const uint64_t row = static_cast<uint64_t>(key) - static_cast<uint64_t>(ix.base);
    if (row >= ix.rows) return kEmptyRow;
    if (num_rows >= 0 && row >= static_cast<uint64_t>(num_rows)) {
      throw_bad_row(0, key, static_cast<int64_t>(row), num_rows);
    }
    return static_cast<int64_t>(row);
  }
  uint64_t slot = 0;
  const int64_t row = index_probe(ix.slots, ix.capacity, key, h, &slot);
  if (row != kEmptyRow && (row < 0 || (num_rows >= 0 && row >= num_rows))) {
    throw_bad_row(slot, key, row, num_rows);
  }
  return row;
}

inline void prefetch_bytes(const void* p, size_t bytes) noexcept {
  // Touch every cache line of [p, p + bytes), capped at 32 lines; the hardware
  // streamer picks up the rest of longer rows.
  constexpr uintptr_t kLine = 64;
  uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~(kLine - 1);
  const uintptr_t end = std::min(reinterpret_cast<uintptr_t>(p) + bytes, a + 32 * kLine);
  for (; a < end; a += kLine) TRITON_REC_PREFETCH(reinterpret_cast<const void*>(a));
}

}  // namespace detail

// Fills `slots` (2 * capacity int64 words; capacity from index_capacity(n) or any
// valid larger capacity) with the index of keys[0..n). Throws DuplicateKeyError
// (for the first repeated key in row order).
inline void build_index(const int64_t* keys, size_t n, int64_t* slots, uint64_t capacity) {
  if (!is_valid_capacity(capacity) || capacity < 2 * static_cast<uint64_t>(n)) {
    throw std::invalid_argument("build_index: capacity " + std::to_string(capacity) +
                                " is too small or not a power of two for " + std::to_string(n) +
                                " keys");
  }
  for (uint64_t s = 0; s < capacity; ++s) {
    slots[2 * s] = 0;
    slots[2 * s + 1] = kEmptyRow;
  }
  const uint64_t mask = capacity - 1;
  constexpr size_t kAhead = 16;
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {
      TRITON_REC_PREFETCH(slots + 2 * (mix64(static_cast<uint64_t>(keys[i + kAhead])) & mask));
    }
    const int64_t key = keys[i];
    uint64_t h = mix64(static_cast<uint64_t>(key)) & mask;
    for (;;) {
      int64_t* s = slots + 2 * h;
      if (s[1] == kEmptyRow) {
        s[0] = key;
        s[1] = static_cast<int64_t>(i);
        break;
      }
      if (s[0] == key) throw DuplicateKeyError(key, s[1], static_cast<int64_t>(i));
      h = (h + 1) & mask;
    }
  }
}

// Writes the row of every key (kEmptyRow when absent) to out_rows; returns the
// number of absent keys. Throws CorruptIndexError for a negative row other than -1.
inline int64_t probe(const IndexView& ix, const int64_t* keys, size_t m, int64_t* out_rows) {
  constexpr size_t kAhead = 16;
  const uint64_t mask = ix.mask();
  int64_t missing = 0;
  for (size_t i = 0; i < m; ++i) {
    if (i + kAhead < m && !ix.direct) {
      TRITON_REC_PREFETCH(ix.slot(mix64(static_cast<uint64_t>(keys[i + kAhead])) & mask));
    }
    const int64_t row = detail::find(ix, keys[i], mix64(static_cast<uint64_t>(keys[i])) & mask, -1);
    out_rows[i] = row;
    missing += (row == kEmptyRow);
  }
  return missing;
}

// The probe of keys[0..m) as a software pipeline, per iteration i:
//   stage 1: hash key i, prefetch its home slot          (kSlotAhead keys ahead)
//   stage 2: probe key i - kSlotAhead, prefetch its row  (kRowAhead keys ahead)
//   stage 3: emit(i - kSlotAhead - kRowAhead, its row or kEmptyRow)
// so the slot and row of a key are (usually) in cache when emit touches them. emit is
// called once per key, in order. Throws CorruptIndexError for a row outside the table.
template <typename Emit>
inline void probe_pipelined(const IndexView& ix, const TableView& table, const int64_t* keys,
                            size_t m, Emit&& emit) {
  // (Prefetching encoded rows further ahead, up to 24 rows of <= 3 lines, measured no
  // different here: benchmarks/history/2026-11-24-embedding-precision.md.)
  constexpr size_t kSlotAhead = 16;
  constexpr size_t kRowAhead = 8;
  constexpr size_t kRing = 32;  // power of two > kSlotAhead + kRowAhead
  static_assert((kRing & (kRing - 1)) == 0 && kRing > kSlotAhead + kRowAhead, "ring size");

  const uint64_t mask = ix.mask();
  const size_t row_bytes = table.fmt.row_bytes;
  uint64_t home[kRing] = {};  // (unused by a direct index)
  int64_t rows[kRing];

  const bool direct = ix.direct;  // no slot to hash or to fetch
  auto stage1 = [&](size_t i) {
    if (direct) return;
    const uint64_t h = mix64(static_cast<uint64_t>(keys[i])) & mask;
    home[i & (kRing - 1)] = h;
    TRITON_REC_PREFETCH(ix.slot(h));
  };
  auto stage2 = [&](size_t i) {
    const int64_t row = detail::find(ix, keys[i], home[i & (kRing - 1)], table.rows);
    rows[i & (kRing - 1)] = row;
    if (row != kEmptyRow) {
      detail::prefetch_bytes(table.row(row), row_bytes);
    }
  };
  auto stage3 = [&](size_t i) { emit(i, rows[i & (kRing - 1)]); };

  constexpr size_t kLag = kSlotAhead + kRowAhead;
  size_t i = 0;
  // Prologue (also covers m < kLag).
  for (; i < std::min(m, kLag); ++i) {
    stage1(i);
    if (i >= kSlotAhead) stage2(i - kSlotAhead);
  }
  // Steady state: all three stages, no bounds checks.
  for (; i < m; ++i) {
    stage1(i);
    stage2(i - kSlotAhead);
    stage3(i - kLag);
  }
  // Drain.
  for (; i < m + kLag; ++i) {
    if (i >= kSlotAhead && i - kSlotAhead < m) stage2(i - kSlotAhead);
    if (i >= kLag) stage3(i - kLag);
  }
}

// Fused probe + gather for keys[0..m): out[i, :] = table row of keys[i], decoded in the
// same pass (row_codec.hpp), or default_value everywhere when the key is absent (then
// missing[i] = 1, else 0, when `missing` is non-null). Returns the number of absent keys.
inline int64_t lookup_range(const IndexView& ix, const TableView& table, const int64_t* keys,
                            size_t m, float* out, float default_value, uint8_t* missing) {
  const size_t dim = table.fmt.dim;
  const size_t row_bytes = table.fmt.row_bytes;
  const bool fp32 = table.fmt.is_fp32();
  const DecodeFn decode = table.fmt.decode;
  int64_t n_missing = 0;
  probe_pipelined(ix, table, keys, m, [&](size_t i, int64_t row) {
    float* dst = out + i * dim;
    if (row != kEmptyRow) {
      if (fp32) {
        std::memcpy(dst, table.row(row), row_bytes);
      } else {
        decode(table.row(row), dst, dim);
      }
      if (missing) missing[i] = 0;
    } else {
      std::fill_n(dst, dim, default_value);
      if (missing) missing[i] = 1;
      ++n_missing;
    }
  });
  return n_missing;
}

// The encoded rows of keys[0..m) as the table holds them: for each key found (in order)
// its key appended to found_keys and its row bytes to found_rows; `on_found(i, row bytes)`
// and `on_absent(i)` are called per key, in order. Pipelined as lookup_range.
template <typename OnFound, typename OnAbsent>
inline void gather_rows(const IndexView& ix, const TableView& table, const int64_t* keys, size_t m,
                        std::vector<int64_t>* found_keys, std::vector<uint8_t>* found_rows,
                        OnFound&& on_found, OnAbsent&& on_absent) {
  const size_t row_bytes = table.fmt.row_bytes;
  found_keys->clear();
  found_rows->resize(m * row_bytes);
  uint8_t* dst = found_rows->data();
  probe_pipelined(ix, table, keys, m, [&](size_t i, int64_t row) {
    if (row == kEmptyRow) {
      on_absent(i);
      return;
    }
    std::memcpy(dst, table.row(row), row_bytes);
    on_found(i, dst);
    found_keys->push_back(keys[i]);
    dst += row_bytes;
  });
  found_rows->resize(found_keys->size() * row_bytes);
}

// lookup_range() over keys[0..m), split into up to `num_threads` contiguous
// chunks run on std::threads (the calling thread takes the first chunk). An
// exception from any chunk is rethrown here, after all threads have joined (the
// one of the lowest chunk wins). The output is identical for any num_threads.
inline int64_t lookup(const IndexView& ix, const TableView& table, const int64_t* keys, size_t m,
                      float* out, float default_value, uint8_t* missing, size_t num_threads = 1) {
  size_t chunks = std::max<size_t>(1, std::min(num_threads, m / kMinKeysPerThread));
  if (chunks == 1) return lookup_range(ix, table, keys, m, out, default_value, missing);

  std::vector<int64_t> counts(chunks, 0);
  std::vector<std::exception_ptr> errors(chunks);
  auto run = [&](size_t c) {
    const size_t b = m * c / chunks, e = m * (c + 1) / chunks;
    try {
      counts[c] = lookup_range(ix, table, keys + b, e - b, out + b * table.fmt.dim, default_value,
                               missing ? missing + b : nullptr);
    } catch (...) {
      errors[c] = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(chunks - 1);
  size_t inline_from = chunks;  // chunks [inline_from, chunks) run here if a thread fails to start
  for (size_t c = 1; c < chunks; ++c) {
    try {
      workers.emplace_back(run, c);
    } catch (...) {
      inline_from = c;
      break;
    }
  }
  run(0);
  for (size_t c = inline_from; c < chunks; ++c) run(c);
  for (auto& w : workers) w.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  return total;
}

}  // namespace triton_rec
