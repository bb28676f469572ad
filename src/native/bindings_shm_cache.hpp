// The ShmCacheView class of triton_rec._native, which bindings_shm_cache.cpp registers and
// bindings_local_misses.cpp casts to (a LocalMisses in front of a shared-memory cache).
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "py_checks.hpp"
#include "shm_cache.hpp"

namespace triton_rec {
namespace bind {

namespace py = pybind11;
namespace tr = triton_rec;
using namespace triton_rec::pycheck;  // NOLINT: the argument checks

// ============================================================================
// ShmCacheView: the shared-memory embedding cache (shm_cache.hpp) over a
// writable Python buffer (an mmap.mmap of a /dev/shm file, or a numpy uint8
// array in tests). The view holds a buffer export (and so a reference to the
// buffer object) until release(), so the memory outlives every native call.
// ============================================================================
inline tr::CachePolicy parse_policy(const std::string& name) {
  if (name == "lru") return tr::CachePolicy::kLru;
  if (name == "tinylfu") return tr::CachePolicy::kTinyLfu;
  throw py::value_error("policy must be 'lru' or 'tinylfu', got '" + name + "'");
}

inline tr::ShmCacheParams make_params(int64_t num_sets, int64_t ways, int64_t vec_size,
                                      const std::string& policy, int64_t precision) {
  auto positive = [](int64_t v, const char* name) {
    if (v < 1) throw py::value_error(std::string(name) + " must be >= 1, got " + std::to_string(v));
  };
  positive(num_sets, "num_sets");
  positive(ways, "ways");
  positive(vec_size, "vec_size");
  tr::ShmCacheParams p;
  p.num_sets = static_cast<uint64_t>(num_sets);
  p.ways = static_cast<uint32_t>(std::min<int64_t>(ways, UINT32_MAX));
  p.vec_size = static_cast<uint32_t>(std::min<int64_t>(vec_size, UINT32_MAX));
  p.policy = parse_policy(policy);
  p.precision = require_precision(precision);
  return p;
}

class ShmCacheView {
 public:
  // Takes a writable, C-contiguous buffer export of `obj`.
  static Py_buffer get_buffer(const py::object& obj) {
    Py_buffer buf;
    if (PyObject_GetBuffer(obj.ptr(), &buf, PyBUF_WRITABLE) != 0) {
      PyErr_Clear();
      const std::string got = py::str(py::type::handle_of(obj).attr("__name__"));
      throw py::type_error(
          "buffer must be a writable C-contiguous buffer (mmap.mmap, numpy "
          "uint8 array, bytearray), got " +
          got);
    }
    return buf;
  }

  ShmCacheView(py::object obj, Py_buffer buf, tr::ShmCache cache)
      : obj_(std::move(obj)), buf_(buf), cache_(cache) {}
  ~ShmCacheView() {
    if (!released_) PyBuffer_Release(&buf_);
  }
  ShmCacheView(const ShmCacheView&) = delete;
  ShmCacheView& operator=(const ShmCacheView&) = delete;

  std::pair<uintptr_t, int64_t> address() const {
    if (released_) throw py::value_error("ShmCacheView is released");
    return {reinterpret_cast<uintptr_t>(buf_.buf), static_cast<int64_t>(buf_.len)};
  }

  static std::unique_ptr<ShmCacheView> initialize(py::object obj, int64_t num_sets, int64_t ways,
                                                  int64_t vec_size, const std::string& policy,
                                                  uint64_t checksum, int64_t precision) {
    const tr::ShmCacheParams p = make_params(num_sets, ways, vec_size, policy, precision);
    Py_buffer buf = get_buffer(obj);
    try {
      tr::ShmCache cache = [&] {
        py::gil_scoped_release release;
        return tr::ShmCache::initialize(buf.buf, static_cast<size_t>(buf.len), p, checksum);
      }();
      return std::make_unique<ShmCacheView>(std::move(obj), buf, cache);
    } catch (...) {
      PyBuffer_Release(&buf);
      throw;
    }
  }

  static std::unique_ptr<ShmCacheView> attach(py::object obj) {
    Py_buffer buf = get_buffer(obj);
    try {
      tr::ShmCache cache = tr::ShmCache::attach(buf.buf, static_cast<size_t>(buf.len));
      return std::make_unique<ShmCacheView>(std::move(obj), buf, cache);
    } catch (...) {
      PyBuffer_Release(&buf);
      throw;
    }
  }

  // Marks the view unusable, waits for calls still running in other threads and
  // releases the buffer export (after which e.g. mmap.close() succeeds).
  void release() {
    if (released_) return;
    released_ = true;
    {
      py::gil_scoped_release release;
      while (inflight_.load() != 0) std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    PyBuffer_Release(&buf_);
  }
  bool released() const { return released_; }

  // Keeps the region mapped for the duration of one call (constructed with the GIL held).
  class Use {
   public:
    explicit Use(const ShmCacheView& v) : v_(v) {
      if (v.released_) throw py::value_error("ShmCacheView is released");
      v_.inflight_.fetch_add(1);
    }
    ~Use() { v_.inflight_.fetch_sub(1); }
    const tr::ShmCache& operator*() const { return v_.cache_; }
    const tr::ShmCache* operator->() const { return &v_.cache_; }

   private:
    const ShmCacheView& v_;
  };

  int64_t query(const py::handle& keys_obj, const py::handle& out_obj,
                const py::handle& hit_obj) const {
    Use c(*this);
    py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
    py::array out = require_array(out_obj, "out", kFloat32, 2, true);
    py::array hit = require_array(hit_obj, "hit_mask", kMask, 1, true);
    const py::ssize_t m = keys.shape(0);
    require_shape(out, "out", {m, static_cast<py::ssize_t>(c->vec_size())});
    require_shape(hit, "hit_mask", {m});
    require_disjoint(out, "out", keys, "keys");
    require_disjoint(hit, "hit_mask", keys, "keys");
    require_disjoint(hit, "hit_mask", out, "out");
    require_outside(out, "out");
    require_outside(hit, "hit_mask");
    const auto* k = static_cast<const int64_t*>(keys.data());
    auto* o = static_cast<float*>(out.mutable_data());
    auto* h = static_cast<uint8_t*>(hit.mutable_data());
    py::gil_scoped_release release;
    return c->query(k, static_cast<size_t>(m), o, h);
  }

  py::tuple insert(const py::handle& keys_obj, const py::handle& vectors_obj) const {
    Use c(*this);
    py::array keys, vectors;
    std::tie(keys, vectors) = keys_and_vectors(*c, keys_obj, vectors_obj);
    tr::InsertResult r;
    {
      py::gil_scoped_release release;
      r = c->insert(static_cast<const int64_t*>(keys.data()), static_cast<size_t>(keys.shape(0)),
                    vectors.data());
    }
    return py::make_tuple(r.inserted, r.evicted, r.rejected);
  }

  int64_t update(const py::handle& keys_obj, const py::handle& vectors_obj) const {
    Use c(*this);
    py::array keys, vectors;
    std::tie(keys, vectors) = keys_and_vectors(*c, keys_obj, vectors_obj);
    py::gil_scoped_release release;
    return c->update(static_cast<const int64_t*>(keys.data()), static_cast<size_t>(keys.shape(0)),
                     vectors.data());
  }

  int64_t erase(const py::handle& keys_obj) const {
    Use c(*this);
    py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
    py::gil_scoped_release release;
    return c->erase(static_cast<const int64_t*>(keys.data()), static_cast<size_t>(keys.shape(0)));
  }

  void clear() const {
    Use c(*this);
    py::gil_scoped_release release;
    c->clear();
  }

  py::array keys() const {
    Use c(*this);
    std::vector<int64_t> ks;
    {
      py::gil_scoped_release release;
      ks = c->keys();
    }
    py::array_t<int64_t> out(static_cast<py::ssize_t>(ks.size()));
    if (!ks.empty()) std::memcpy(out.mutable_data(), ks.data(), ks.size() * sizeof(int64_t));
    return std::move(out);
  }

  uint64_t size() const {
    Use c(*this);
    py::gil_scoped_release release;
    return c->size();
  }

  py::dict stats() const {
    Use c(*this);
    const tr::ShmCacheStats s = c->stats();
    py::dict d;
    d["lookups"] = s.lookups;
    d["hits"] = s.hits;
    d["misses"] = s.misses;
    d["inserts"] = s.inserts;
    d["updates"] = s.updates;
    d["evictions"] = s.evictions;
    d["rejected_admissions"] = s.rejected_admissions;
    d["erased"] = s.erased;
    d["recovered_sets"] = s.recovered_sets;
    d["sketch_agings"] = s.sketch_agings;
    return d;
  }

  uint64_t capacity() const { return Use(*this)->capacity(); }
  uint64_t num_sets() const { return Use(*this)->num_sets(); }
  uint32_t ways() const { return Use(*this)->ways(); }
  uint32_t vec_size() const { return Use(*this)->vec_size(); }
  int64_t precision() const { return static_cast<int64_t>(Use(*this)->format().precision); }
  std::string policy() const { return tr::policy_name(Use(*this)->policy()); }
  uint64_t checksum() const { return Use(*this)->checksum(); }
  uint64_t nbytes() const { return Use(*this)->total_bytes(); }

  // ---- attachment tokens and test hooks ------------------------------------------
  bool register_token(int64_t token) const { return Use(*this)->register_token(token); }
  int64_t unregister_token(int64_t token, bool all) const {
    return Use(*this)->unregister_token(token, all);
  }
  py::list tokens() const {
    py::list out;
    for (int64_t t : Use(*this)->tokens()) out.append(t);
    return out;
  }

  py::array set_of(const py::handle& keys_obj) const {
    Use c(*this);
    py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
    py::array_t<int64_t> out(keys.shape(0));
    const auto* k = static_cast<const int64_t*>(keys.data());
    int64_t* o = out.mutable_data();
    for (py::ssize_t i = 0; i < keys.shape(0); ++i) o[i] = static_cast<int64_t>(c->set_of(k[i]));
    return std::move(out);
  }

  py::array estimate(const py::handle& keys_obj) const {
    Use c(*this);
    py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
    py::array_t<uint8_t> out(keys.shape(0));
    const auto* k = static_cast<const int64_t*>(keys.data());
    uint8_t* o = out.mutable_data();
    for (py::ssize_t i = 0; i < keys.shape(0); ++i) o[i] = static_cast<uint8_t>(c->estimate(k[i]));
    return std::move(out);
  }

  uint64_t debug_set_seq(uint64_t s) const { return Use(*this)->debug_set_seq(s); }

  void debug_hold_set(uint64_t s, double seconds) const {
    Use c(*this);
    py::gil_scoped_release release;
    c->debug_hold_set(s, seconds);
  }

  std::string repr() const {
    if (released_) return "<ShmCacheView (released)>";
    const tr::ShmCache& c = cache_;
    return "<ShmCacheView policy=" + std::string(tr::policy_name(c.policy())) +
           " capacity=" + std::to_string(c.capacity()) + " (" + std::to_string(c.num_sets()) +
           " sets x " + std::to_string(c.ways()) +
           " ways) vec_size=" + std::to_string(c.vec_size()) +
           " precision=" + std::to_string(static_cast<int>(c.format().precision)) +
           " nbytes=" + std::to_string(c.total_bytes()) + ">";
  }

 private:
  std::pair<py::array, py::array> keys_and_vectors(const tr::ShmCache& c,
                                                   const py::handle& keys_obj,
                                                   const py::handle& vectors_obj) const {
    py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
    const tr::Precision p = c.format().precision;
    py::array vectors = require_array(vectors_obj, "vectors", row_dtype(p), 2, false);
    require_shape(vectors, "vectors",
                  {keys.shape(0), row_width(p, static_cast<py::ssize_t>(c.vec_size()))});
    require_outside(vectors, "vectors");
    return {keys, vectors};
  }

  // An argument must not live inside the cache region itself.
  void require_outside(const py::array& a, const char* name) const {
    if (a.nbytes() == 0) return;
    const auto* p = static_cast<const char*>(a.data());
    const auto* b = static_cast<const char*>(buf_.buf);
    if (p < b + buf_.len && b < p + a.nbytes()) {
      throw py::value_error(std::string(name) + " must not overlap the cache region");
    }
  }

  py::object obj_;
  Py_buffer buf_;
  tr::ShmCache cache_;
  bool released_ = false;
  mutable std::atomic<int> inflight_{0};
};

}  // namespace bind
}  // namespace triton_rec
