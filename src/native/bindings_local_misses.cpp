// The misses of a cache in front of a node-local table (local_misses.hpp), answered in C++:
// LocalMisses, the background InsertQueue, finish_tables. Registered by bindings.cpp.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bindings_shm_cache.hpp"
#include "hash_index.hpp"
#include "local_misses.hpp"
#include "py_checks.hpp"

namespace py = pybind11;
namespace tr = triton_rec;
using triton_rec::bind::ShmCacheView;
using namespace triton_rec::pycheck;  // NOLINT: the argument checks

namespace {

// LocalMisses (local_misses.hpp): the misses of a shared cache in front of a node-local
// table, answered in C++ (CachedTable.finish_query for such tables; its address goes into
// the table's native plan). Holds the cache view, the table's arrays, the queue and the
// statistics array, so what the core points into outlives it.
class LocalMissesHandle {
 public:
  LocalMissesHandle(py::object view, const py::handle& index_obj, const py::handle& vectors_obj,
                    int64_t precision, double default_value, double threshold, bool deferrable,
                    py::object queue, const py::handle& stats_obj)
      : view_obj_(std::move(view)), index_(py::reinterpret_borrow<py::object>(index_obj)),
        vectors_(py::reinterpret_borrow<py::object>(vectors_obj)),
        stats_(py::reinterpret_borrow<py::object>(stats_obj)), queue_(std::move(queue)) {
    std::shared_ptr<const tr::MissCache> cache;
    if (py::isinstance<ShmCacheView>(view_obj_)) {
      shm_ = true;
      cache = std::make_shared<tr::ShmMissCache>(
          *ShmCacheView::Use(view_obj_.cast<const ShmCacheView&>()));
    } else if (py::isinstance<tr::MissCache>(view_obj_)) {
      cache = view_obj_.cast<std::shared_ptr<tr::MissCache>>();
    } else {
      throw py::type_error("cache must be a ShmCacheView or a MissCache");
    }
    const tr::IndexView ix = require_index(index_obj);
    const tr::Precision prec = require_precision(precision);
    py::array vectors = require_array(vectors_obj, "vectors", row_dtype(prec), 2, false);
    const py::ssize_t dim = dim_of_width(prec, vectors.shape(1), "vectors");
    py::array stats = require_array(stats_obj, "stats", kInt64, 1, true);
    if (stats.shape(0) < tr::kNumTableStats) {
      throw py::value_error("stats must hold " + std::to_string(tr::kNumTableStats) + " counters");
    }
    tr::InsertQueue* q = queue_.is_none() ? nullptr : queue_.cast<tr::InsertQueue*>();
    const tr::TableView table{vectors.data(), vectors.shape(0),
                              tr::RowFormat(prec, static_cast<size_t>(dim))};
    try {
      core_ = std::make_unique<tr::LocalMisses>(
          std::move(cache), ix, table, static_cast<float>(default_value),
          tr::MissRules{threshold, deferrable}, q, static_cast<int64_t*>(stats.mutable_data()));
    } catch (const std::invalid_argument& e) {
      throw py::value_error(e.what());
    }
  }

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(core_.get()); }
  const tr::LocalMisses& core() const { return *core_; }
  bool shm() const { return shm_; }
  const py::object& view() const { return view_obj_; }

  void finish(const py::handle& keys_obj, const py::handle& out_obj, const py::handle& hit_obj,
              int64_t hits, uint64_t query_ns, const py::handle& bounds_obj,
              const py::handle& exact_obj, const py::handle& defaults_obj) const {
    std::optional<ShmCacheView::Use> use;  // a shared-memory cache stays mapped meanwhile
    if (shm_) use.emplace(view_obj_.cast<const ShmCacheView&>());
    py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
    py::array out = require_array(out_obj, "out", kFloat32, 2, true);
    py::array hit = require_array(hit_obj, "hit", kMask, 1, false);
    py::array bounds = require_array(bounds_obj, "bounds", kInt64, 1, false);
    const py::ssize_t m = keys.shape(0), segments = bounds.shape(0) - 1;
    require_shape(out, "out", {m, static_cast<py::ssize_t>(core_->dim())});
    require_shape(hit, "hit", {m});
    if (segments < 1) throw py::value_error("bounds must hold at least two values");
    const auto* b = static_cast<const int64_t*>(bounds.data());
    if (b[0] != 0 || b[segments] != m) throw py::value_error("bounds must run from 0 to len(keys)");
    for (py::ssize_t j = 0; j < segments; ++j) {
      if (b[j + 1] < b[j]) throw py::value_error("bounds must not decrease");
    }
    py::array exact = require_array(exact_obj, "exact", kMask, 1, false);
    require_shape(exact, "exact", {segments});
    py::array defaults = require_array(defaults_obj, "defaults", kInt64, 2, true);
    require_shape(defaults, "defaults", {segments, tr::kNumDefaultCauses});
    const auto* h = static_cast<const uint8_t*>(hit.data());
    int64_t counted = 0;
    for (py::ssize_t i = 0; i < m; ++i) counted += h[i] != 0;
    if (counted != hits) throw py::value_error("hits disagrees with hit");
    require_disjoint(out, "out", keys, "keys");
    const auto* k = static_cast<const int64_t*>(keys.data());
    auto* o = static_cast<float*>(out.mutable_data());
    const auto* e = static_cast<const uint8_t*>(exact.data());
    auto* d = static_cast<int64_t*>(defaults.mutable_data());
    py::gil_scoped_release release;
    core_->finish(k, m, o, h, hits, query_ns, b, segments, e, d);
  }

 private:
  // declared first, destroyed last: what core_ points into
  py::object view_obj_, index_, vectors_, stats_, queue_;
  bool shm_ = false;  // view_obj_ is a ShmCacheView (else a MissCache)
  std::unique_ptr<tr::LocalMisses> core_;
};

// The misses of one request's tables answered as a GPU instance answers them (gpu_paths.cpp):
// each table's LocalMisses::finish with its inserts gathered (PendingInserts), then written
// together. tables[i] is the query of keys[i] into outs[i] with hit[i]; exact for every
// table; each key answered with the default adds to defaults[cause].
void finish_tables(const py::list& misses, const py::list& keys, const py::list& outs,
                   const py::list& hits, bool exact, const py::handle& defaults_obj) {
  const size_t n = misses.size();
  if (keys.size() != n || outs.size() != n || hits.size() != n) {
    throw py::value_error("misses, keys, outs and hits must have one entry per table");
  }
  py::array defaults = require_array(defaults_obj, "defaults", kInt64, 1, true);
  require_shape(defaults, "defaults", {tr::kNumDefaultCauses});
  struct Table {
    const tr::LocalMisses* core;
    const int64_t* keys;
    int64_t m, hits;
    float* out;
    const uint8_t* hit;
  };
  std::vector<Table> tables;
  std::vector<py::array> held;         // the arrays stay alive while the GIL is released
  std::deque<ShmCacheView::Use> uses;  // shared-memory caches stay mapped meanwhile
  for (size_t i = 0; i < n; ++i) {
    const auto& h = misses[i].cast<const LocalMissesHandle&>();
    if (h.shm()) uses.emplace_back(h.view().cast<const ShmCacheView&>());
    py::array k = require_array(keys[i], "keys", kInt64, 1, false);
    py::array o = require_array(outs[i], "out", kFloat32, 2, true);
    py::array t = require_array(hits[i], "hit", kMask, 1, false);
    const py::ssize_t m = k.shape(0);
    require_shape(o, "out", {m, static_cast<py::ssize_t>(h.core().dim())});
    require_shape(t, "hit", {m});
    const auto* tp = static_cast<const uint8_t*>(t.data());
    int64_t counted = 0;
    for (py::ssize_t j = 0; j < m; ++j) counted += tp[j] != 0;
    tables.push_back({&h.core(), static_cast<const int64_t*>(k.data()), m, counted,
                      static_cast<float*>(o.mutable_data()), tp});
    held.insert(held.end(), {k, o, t});
  }
  auto* d = static_cast<int64_t*>(defaults.mutable_data());
  const uint8_t want = exact ? 1 : 0;
  py::gil_scoped_release release;
  tr::PendingInserts pending;
  for (const Table& t : tables) {
    if (t.hits == t.m) continue;  // all hit: nothing to answer (as settle_gpu_table)
    t.core->finish(t.keys, t.m, t.out, t.hit, t.hits, 0, nullptr, 0, &want, d, &pending);
  }
  pending.flush();
}

}  // namespace

void register_local_misses(py::module_& m) {
  py::tuple stat_names(static_cast<size_t>(tr::kNumTableStats)),
      causes(static_cast<size_t>(tr::kNumDefaultCauses));
  for (int i = 0; i < tr::kNumTableStats; ++i) stat_names[i] = tr::kTableStatNames[i];
  for (int i = 0; i < tr::kNumDefaultCauses; ++i) causes[i] = tr::kDefaultCauseNames[i];
  py::tuple info(static_cast<size_t>(tr::kNumDefaultCauses));
  for (int i = 0; i < tr::kNumDefaultCauses; ++i) info[i] = tr::kDefaultInfo[i];
  m.attr("TABLE_STAT_FIELDS") = stat_names;
  m.attr("DEFAULT_CAUSES") = causes;
  m.attr("DEFAULT_INFO") = info;
  m.attr("EXACT_PARAMETER") = tr::kExactParameter;

  py::class_<tr::InsertQueue>(
      m, "InsertQueue",
      "InsertQueue(max_pending: int) -- the background inserter of node-local tables "
      "(src/native/local_misses.hpp): one native thread; at most max_pending batches wait, "
      "beyond that a batch is dropped.")
      .def(py::init([](int64_t max_pending) {
             if (max_pending < 1) throw py::value_error("max_pending must be >= 1");
             return std::make_unique<tr::InsertQueue>(static_cast<size_t>(max_pending));
           }),
           py::arg("max_pending"))
      .def("drain", &tr::InsertQueue::drain, py::arg("timeout"),
           py::call_guard<py::gil_scoped_release>(),
           "drain(timeout: float) -> bool: wait until every queued batch is inserted")
      .def("close", &tr::InsertQueue::close, py::call_guard<py::gil_scoped_release>(),
           "close() -> None: stop the thread, dropping queued batches (idempotent)")
      .def_property_readonly("pending", &tr::InsertQueue::pending,
                             "batches queued or being inserted")
      .def_property_readonly("failures", &tr::InsertQueue::failures,
                             "(batches whose insert failed, the last failure's message)");

  py::class_<tr::MissCache, std::shared_ptr<tr::MissCache>>(
      m, "MissCache",
      "A cache as LocalMisses inserts into it, other than a ShmCacheView: a device cache "
      "(DeviceCache.miss_cache) or its CPU twin (cache_twin_miss_cache).");

  py::class_<LocalMissesHandle>(
      m, "LocalMisses",
      "LocalMisses(cache: ShmCacheView | MissCache, index, vectors, precision: int, "
      "default_value: float, hit_rate_threshold: float, deferrable: bool, "
      "queue: InsertQueue | None, stats: "
      "int64[len(TABLE_STAT_FIELDS)]) -- the misses of a cache in front of a "
      "node-local table, by HPS's rules, in C++ (src/native/local_misses.hpp).")
      .def(py::init<py::object, const py::handle&, const py::handle&, int64_t, double, double, bool,
                    py::object, const py::handle&>(),
           py::arg("cache"), py::arg("index"), py::arg("vectors"), py::arg("precision"),
           py::arg("default_value"), py::arg("hit_rate_threshold"), py::arg("deferrable"),
           py::arg("queue"), py::arg("stats"))
      .def("finish", &LocalMissesHandle::finish, py::arg("keys"), py::arg("out"), py::arg("hit"),
           py::arg("hits"), py::arg("query_ns"), py::arg("bounds"), py::arg("exact"),
           py::arg("defaults"),
           "finish(keys: int64[M], out: float32[M, D], hit: uint8[M], hits: int, query_ns: int, "
           "bounds: int64[R+1], exact: uint8[R], defaults: int64[R, 2]) -> None\n\n"
           "CachedTable.finish_query for a node-local table: counts the lookup, answers the "
           "misses (hit[i] == 0) into out, adds each request's default answers by cause.")
      .def_property_readonly("address", &LocalMissesHandle::address,
                             "the core's address, for the native backend's plan");
  m.def("finish_tables", &finish_tables, py::arg("misses"), py::arg("keys"), py::arg("outs"),
        py::arg("hits"), py::arg("exact"), py::arg("defaults"),
        "finish_tables(misses: list[LocalMisses], keys: list[int64[M_t]], outs: "
        "list[float32[M_t, D_t]], hits: list[uint8[M_t]], exact: bool, defaults: int64[2]) "
        "-> None\n\n"
        "One request's tables as a GPU instance answers their misses: each table's "
        "LocalMisses.finish with the rows fetched for its cache gathered, then written "
        "together (the device caches of one kind in one write), before returning.");
}
