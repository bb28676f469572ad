// What the array cache's bindings (bindings_array_cache.cpp: its CPU twin) and the GPU's
// (bindings_gpu.cpp: the kernels) share: their argument checks, the cache's state view
// (CacheView), whole tables, a request's lookups of several tables, and the cache as
// LocalMisses inserts into it (ArrayMissCache, over the write kernel or its twin).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "array_cache_twin.hpp"
#include "gpu_ops.hpp"
#include "local_misses.hpp"
#include "py_checks.hpp"
#include "writer_lock.hpp"

namespace triton_rec {
namespace bind {

namespace py = pybind11;
namespace tr = triton_rec;
namespace xc = triton_rec::xcache;
namespace gpu = triton_rec::gpu;

// -- argument checks (never a silent cast or copy) ---------------------------------------

using namespace triton_rec::pycheck;  // NOLINT: the checks bindings.cpp uses too

// A 1-D int64 array's data (keys, row ids).
inline const int64_t* int64s(const py::array& a, const char* name) {
  return static_cast<const int64_t*>(require_array(a, name, kInt64, 1, false).data());
}

// A lookup's outputs: float32 out [n, dim] and uint8 status [n], writable.
inline std::pair<float*, uint8_t*> outputs(const py::array& out, const py::array& status, int64_t n,
                                           int64_t dim) {
  py::array o = require_array(out, "out", kFloat32, 2, true);
  require_shape(o, "out", {n, dim});
  py::array s = require_array(status, "status", kUInt8, 1, true);
  require_shape(s, "status", {n});
  return {static_cast<float*>(o.mutable_data()), static_cast<uint8_t*>(s.mutable_data())};
}

// Encoded rows: any C-contiguous array of exactly n * row_bytes bytes.
inline const uint8_t* rows_of(const py::array& rows, int64_t n, int64_t row_bytes) {
  if (!(rows.flags() & py::array::c_style)) throw py::value_error("rows must be C-contiguous");
  if (static_cast<int64_t>(rows.nbytes()) != n * row_bytes) {
    throw py::value_error("rows must hold " + std::to_string(n) + " rows of " +
                          std::to_string(row_bytes) + " bytes, got " +
                          std::to_string(rows.nbytes()) + " bytes");
  }
  return static_cast<const uint8_t*>(rows.data());
}

// -- the cache's state, as the kernels and the twin see it -----------------------------------

inline xc::View make_view(py::dict a, int64_t num_sets, int64_t ways, int64_t dim,
                          int64_t precision, int64_t policy, int64_t sketch_width) {
  const gpu::StateAddresses s = gpu::state_addresses([&](const char* k) -> uintptr_t {
    return a.contains(k) ? a[k].cast<uintptr_t>() : uintptr_t{0};
  });
  try {
    return gpu::make_view(s, num_sets, ways, dim, precision, policy, sketch_width);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

// A write's arguments, checked: the keys, and the rows (none for an erase) of the cache's
// row size.
struct WriteArgs {
  const int64_t* keys;
  int64_t n;
  const uint8_t* rows = nullptr;
  py::array held;  // the rows array (kept while the write runs)
  WriteArgs(const xc::View& v, int32_t mode, const py::array& k, const py::object& r)
      : keys(int64s(k, "keys")), n(k.shape(0)) {
    if (mode < xc::kModeInsert || mode > xc::kModeErase) throw py::value_error("bad write mode");
    if (mode == xc::kModeErase) return;
    held = py::array::ensure(r);
    if (!held) throw py::value_error("rows must be an array");
    rows = rows_of(held, n, v.row_bytes);
  }
};

struct CacheView {
  xc::View v;
};

// A whole table's index (the node store's layout: int64 [capacity, 2], capacity a power of
// two >= 16) and rows (C-contiguous, whole rows of precision x dim), checked, as a
// WholeTable over the arrays' host memory (the twin's; a DeviceTable copies it to the device).
inline xc::WholeTable whole_table(const py::array& index, const py::array& vectors,
                                  int64_t precision, int64_t dim, float default_value) {
  const auto* slots =
      static_cast<const int64_t*>(require_array(index, "index", kInt64, 2, false).data());
  if (index.shape(1) != 2) throw py::value_error("index must be int64 [capacity, 2]");
  const uint64_t cap = static_cast<uint64_t>(index.shape(0));
  if (cap < 16 || (cap & (cap - 1)) != 0)
    throw py::value_error("index capacity must be a power of two >= 16");
  if (!(vectors.flags() & py::array::c_style))
    throw py::value_error("vectors must be C-contiguous");
  if (precision < 0 || precision > 2 || dim < 1) throw py::value_error("bad precision or dim");
  const int64_t row_bytes = tr::encoded_row_bytes(static_cast<uint32_t>(precision), dim);
  if (vectors.nbytes() % row_bytes != 0) throw py::value_error("vectors do not hold whole rows");
  xc::WholeTable t;
  t.slots = slots;
  t.capacity = cap;
  t.vectors = static_cast<const uint8_t*>(vectors.data());
  t.rows = static_cast<int64_t>(vectors.nbytes()) / row_bytes;
  t.precision = precision;
  t.dim = dim;
  t.default_value = default_value;
  return t;
}

// The lookups of several tables as a request holds them: keys[t] of targets[t] one after
// the other, answered by run(targets, tables, keys, key_starts, out_starts, out, status)
// (GIL released), then split into outs[t] [n_t, dim_t] and statuses[t] [n_t].
template <class Run>
inline void lookup_tables(const std::vector<gpu::LookupTarget>& targets, const py::list& keys,
                          const py::list& outs, const py::list& statuses, Run&& run) {
  const size_t n = targets.size();
  if (n == 0 || keys.size() != n || outs.size() != n || statuses.size() != n) {
    throw py::value_error("one keys, out and status array per table");
  }
  std::vector<int64_t> all, key_starts(n + 1, 0), out_starts(n + 1, 0);
  for (size_t t = 0; t < n; ++t) {
    const py::array a = keys[t].cast<py::array>();
    const int64_t* kp = int64s(a, "keys");
    const int64_t m = a.shape(0);
    outputs(outs[t].cast<py::array>(), statuses[t].cast<py::array>(), m, targets[t].dim());
    all.insert(all.end(), kp, kp + m);
    key_starts[t + 1] = key_starts[t] + m;
    out_starts[t + 1] = out_starts[t] + m * targets[t].dim();
  }
  std::vector<float> out(static_cast<size_t>(out_starts[n]));
  std::vector<uint8_t> status(all.size());
  {
    py::gil_scoped_release release;
    run(targets.data(), n, all.data(), key_starts.data(), out_starts.data(), out.data(),
        status.data());
  }
  for (size_t t = 0; t < n; ++t) {
    const auto [op, sp] = outputs(outs[t].cast<py::array>(), statuses[t].cast<py::array>(),
                                  key_starts[t + 1] - key_starts[t], targets[t].dim());
    std::copy(out.begin() + out_starts[t], out.begin() + out_starts[t + 1], op);
    std::copy(status.begin() + key_starts[t], status.begin() + key_starts[t + 1], sp);
  }
}

inline py::tuple counts_tuple(const int64_t* c) {
  py::tuple t(static_cast<size_t>(xc::kWriteCounts));
  for (int i = 0; i < xc::kWriteCounts; ++i) t[i] = c[i];
  return t;
}

// The T of `key` in this process, made with args at its first use and shared while anyone
// holds it: the InsertBatcher of a cache (key: where its state starts; its instances'
// MissCaches share it) and the PartsBatcher of a kind of cache (MissCache::kind).
template <class T, class... Args>
inline std::shared_ptr<T> one_per(const void* key, Args&&... args) {
  static std::mutex mutex;
  static std::map<const void*, std::weak_ptr<T>> made;
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = made.begin(); it != made.end();) {  // forget those gone
    it = it->second.expired() ? made.erase(it) : std::next(it);
  }
  std::shared_ptr<T> t = made[key].lock();
  if (!t) {
    t = std::make_shared<T>(std::forward<Args>(args)...);
    made[key] = t;
  }
  return t;
}

// A cache of array_cache_rules.hpp's layout as LocalMisses inserts into it
// (local_misses.hpp): the instances' inserts gathered by the cache's InsertBatcher (a
// request's tables by the PartsBatcher of its kind), each write by `Writer` (the write
// kernel on a lane of the pool, or the kernel's CPU twin): under the caches' writer locks
// held shared, the kernel locking each set it writes, so writers of other threads and
// processes write beside it; the keys of sets it found held past the wait are written
// again under the lock held exclusively, which heals a set a dead writer left. So a GPU
// instance's misses are answered by the same C++ as a CPU instance's, and CI runs it in
// front of the twin.
template <class Writer>
class ArrayMissCache final : public tr::MissCache {
 public:
  ArrayMissCache(Writer writer, const xc::View& v, std::shared_ptr<tr::WriterLock> lock)
      : writer_(std::move(writer)), v_(v), lock_(std::move(lock)),
        batcher_(one_per<tr::InsertBatcher>(v.meta, static_cast<size_t>(v.row_bytes))),
        parts_batcher_(one_per<tr::PartsBatcher>(writer_.kind())) {}
  tr::RowFormat format() const override {
    return tr::RowFormat(tr::precision_of(v_.precision), static_cast<size_t>(v_.dim));
  }
  void insert(const int64_t* keys, size_t n, const uint8_t* rows) const override {
    batcher_->insert(keys, n, rows, &ArrayMissCache::write, const_cast<ArrayMissCache*>(this));
  }
  const void* kind() const override { return writer_.kind(); }
  // The inserts of several caches of this kind (a request's tables) in one write, with
  // the parts of other requests waiting meanwhile (PartsBatcher).
  void insert_together(const tr::PendingInsert* parts, size_t n) const override {
    parts_batcher_->insert(parts, n, &ArrayMissCache::write_parts, this);
  }

 private:
  static void write_parts(const void* self, const tr::PendingInsert* parts, size_t n) {
    std::vector<xc::WritePart> writes(n);
    std::vector<const ArrayMissCache*> caches(n);
    for (size_t i = 0; i < n; ++i) {
      caches[i] = static_cast<const ArrayMissCache*>(parts[i].cache);
      writes[i] = xc::WritePart{caches[i]->v_, xc::kModeInsert, parts[i].keys,
                                static_cast<int64_t>(parts[i].n), parts[i].rows};
    }
    static_cast<const ArrayMissCache*>(self)->write_shared(writes, caches);
  }

  static void write(void* self, const int64_t* keys, size_t n, const uint8_t* rows) {
    auto* c = static_cast<const ArrayMissCache*>(self);
    std::vector<xc::WritePart> writes{
        xc::WritePart{c->v_, xc::kModeInsert, keys, static_cast<int64_t>(n), rows}};
    c->write_shared(writes, {c});
  }

  // One write of writes[i] (to caches[i]'s cache) under every cache's writer lock held
  // shared, each lock file once and in WriterLock::order; then the keys left in busy sets,
  // a cache at a time under its lock held exclusively.
  void write_shared(const std::vector<xc::WritePart>& writes,
                    const std::vector<const ArrayMissCache*>& caches) const {
    std::vector<tr::WriterLock*> locks;
    for (const ArrayMissCache* c : caches) locks.push_back(c->lock_.get());
    std::sort(locks.begin(), locks.end(), [](const tr::WriterLock* a, const tr::WriterLock* b) {
      return a->order() < b->order();
    });
    // one lock per lock file: the parts of one cache may come from several instances,
    // each with its own WriterLock on that file (and a thread blocks on a second flock of
    // a file it holds through another descriptor)
    locks.erase(std::unique(locks.begin(), locks.end(),
                            [](const tr::WriterLock* a, const tr::WriterLock* b) {
                              return a->order() == b->order();
                            }),
                locks.end());
    std::vector<int64_t> counts(writes.size() * xc::kWriteCounts, 0);
    xc::BusyWrites busy;
    {
      struct Held {  // unlocks what it locked, in reverse, also when a write throws
        std::vector<tr::WriterLock*> locked;
        ~Held() {
          for (auto it = locked.rbegin(); it != locked.rend(); ++it) (*it)->unlock_shared();
        }
      } held;
      held.locked.reserve(locks.size());  // no allocation between a lock and its record
      for (tr::WriterLock* l : locks) {
        l->lock_shared();
        held.locked.push_back(l);
      }
      writer_.many(writes.data(), writes.size(), counts.data(), false, &busy);
    }
    for (const xc::BusyWrites::Part& left : busy.parts) {
      const xc::WritePart again{writes[left.part].view, writes[left.part].mode, left.keys.data(),
                                static_cast<int64_t>(left.keys.size()),
                                left.rows.empty() ? nullptr : left.rows.data()};
      std::lock_guard<tr::WriterLock> hold(*caches[left.part]->lock_);
      writer_.many(&again, 1, counts.data() + left.part * xc::kWriteCounts, true, nullptr);
    }
  }

  Writer writer_;
  xc::View v_;
  std::shared_ptr<tr::WriterLock> lock_;
  std::shared_ptr<tr::InsertBatcher> batcher_;
  std::shared_ptr<tr::PartsBatcher> parts_batcher_;
};

}  // namespace bind
}  // namespace triton_rec
