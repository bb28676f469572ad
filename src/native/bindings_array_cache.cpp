// The array cache's side of triton_rec._native that needs no GPU: the constants the kernels
// and their CPU twin share (array_cache_rules.hpp), the writer lock, the state view, and the
// CPU twin of the kernels (array_cache_twin.hpp), which CI runs. Registered by bindings.cpp.
#include "bindings_array_cache.hpp"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "array_cache_twin.hpp"
#include "gpu_ops.hpp"
#include "local_misses.hpp"
#include "writer_lock.hpp"

namespace py = pybind11;
namespace tr = triton_rec;
namespace xc = triton_rec::xcache;
namespace gpu = triton_rec::gpu;
using namespace triton_rec::bind;  // NOLINT: what the array cache's bindings share

namespace {

// The same inserts by the kernel's CPU twin (array_cache_twin.hpp), on host memory, through
// the same staging as gpu::write_many (twin_write_staged).
struct TwinInsert {
  void many(const xc::WritePart* parts, size_t n, int64_t* counts, bool exclusive,
            xc::BusyWrites* busy) const {
    xc::twin_write_staged(parts, n, counts, exclusive, busy);
  }
  const void* kind() const {
    static const char tag = 0;
    return &tag;
  }
};

}  // namespace

void register_array_cache(py::module_& m) {
  // -- constants both sides use (defined in array_cache_rules.hpp) ----------------------
  py::dict meta;
  // meta[] slots by name (the writer counters under the names ArrayEmbeddingCache.stats uses)
  const char* names[] = {"clock",    "incs",    "capacity",       "policy",
                         "ways",     "vec",     "magic",          "sketch_agings",
                         "inserts",  "updates", "evictions",      "rejected",
                         "overflow", "erased",  "recovered_sets", "precision"};
  for (int i = 0; i < xc::kMetaLen; ++i) meta[names[i]] = i;
  m.attr("ARRAY_CACHE_META") = meta;
  m.attr("ARRAY_CACHE_META_LEN") = static_cast<int>(xc::kMetaLen);
  m.attr("ARRAY_CACHE_SKETCH_ROWS") = xc::kSketchRows;
  m.attr("ARRAY_CACHE_SKETCH_MAX") = xc::kSketchMax;
  m.attr("ARRAY_CACHE_AGING_FACTOR") = xc::kAgingFactor;
  m.attr("ARRAY_CACHE_SKETCH_WIDTH_FACTOR") = xc::kSketchWidthFactor;
  m.attr("ARRAY_CACHE_MAX_WAYS") = xc::kMaxWays;
  m.attr("ARRAY_CACHE_SKETCH_SEEDS") = py::make_tuple(xc::sketch_seed(0), xc::sketch_seed(1),
                                                      xc::sketch_seed(2), xc::sketch_seed(3));
  m.attr("ARRAY_CACHE_WRITE_COUNTS") = py::make_tuple("inserted", "updated", "evicted", "rejected",
                                                      "overflow", "erased", "recovered");
  m.attr("ARRAY_CACHE_WRITE_MODES") = py::make_tuple("insert", "update", "erase");
  m.attr("ARRAY_CACHE_STATUS") = py::make_tuple("miss", "hit", "torn");

  py::class_<tr::WriterLock, std::shared_ptr<tr::WriterLock>>(
      m, "WriterLock",
      "WriterLock(fd: int) -- the writer lock of a cache that processes share "
      "(writer_lock.hpp): flock on the lock file fd (duplicated; -1: this process's threads "
      "only) plus a mutex. Python's writers and the native ones take the same lock: "
      "exclusively (acquire), or shared (acquire_shared: the native miss writes, which "
      "lock each set they write).")
      .def(py::init<int>(), py::arg("fd"))
      .def("acquire", &tr::WriterLock::lock, py::call_guard<py::gil_scoped_release>())
      .def("release", &tr::WriterLock::unlock)
      .def("acquire_shared", &tr::WriterLock::lock_shared, py::call_guard<py::gil_scoped_release>())
      .def("release_shared", &tr::WriterLock::unlock_shared)
      .def(
          "__enter__",
          [](tr::WriterLock& l) -> tr::WriterLock& {
            py::gil_scoped_release release;
            l.lock();
            return l;
          },
          py::return_value_policy::reference)
      .def("__exit__", [](tr::WriterLock& l, const py::args&) { l.unlock(); });

  py::class_<CacheView>(m, "CacheView",
                        "The device cache's state arrays (addresses) and geometry, as the "
                        "kernels and their CPU twin read them (array_cache_rules.hpp).")
      .def(py::init([](py::dict arrays, int64_t num_sets, int64_t ways, int64_t dim,
                       int64_t precision, int64_t policy, int64_t sketch_width) {
             return CacheView{
                 make_view(arrays, num_sets, ways, dim, precision, policy, sketch_width)};
           }),
           py::arg("arrays"), py::arg("num_sets"), py::arg("ways"), py::arg("dim"),
           py::arg("precision"), py::arg("policy"), py::arg("sketch_width"))
      .def_property_readonly("row_bytes", [](const CacheView& c) { return c.v.row_bytes; });

  // -- the CPU twin ---------------------------------------------------------------------
  m.def(
      "cache_twin_query",
      [](const CacheView& c, const py::array& keys, const py::array& out, const py::array& status) {
        const int64_t* kp = int64s(keys, "keys");
        const int64_t n = keys.shape(0);
        const auto [op, sp] = outputs(out, status, n, c.v.dim);
        py::gil_scoped_release release;
        xc::twin_query(c.v, kp, n, op, sp);
      },
      py::arg("view"), py::arg("keys"), py::arg("out"), py::arg("status"),
      "A cache query of trec_lookup_tables run on the CPU over state arrays in host memory.");
  m.def(
      "cache_twin_write",
      [](const CacheView& c, int32_t mode, const py::array& keys, const py::object& rows) {
        const WriteArgs w(c.v, mode, keys, rows);
        const int64_t *kp = w.keys, n = w.n;
        const uint8_t* rp = w.rows;
        int64_t counts[xc::kWriteCounts] = {0, 0, 0, 0, 0, 0, 0};
        {
          py::gil_scoped_release release;
          xc::twin_write_keys(c.v, mode, kp, n, rp, counts);
        }
        return counts_tuple(counts);
      },
      py::arg("view"), py::arg("mode"), py::arg("keys"), py::arg("rows"),
      "trec_cache_write run on the CPU (insert 0, update 1, erase 2); returns the counts "
      "of ARRAY_CACHE_WRITE_COUNTS.");
  m.def(
      "cache_twin_miss_cache",
      [](const CacheView& c,
         std::shared_ptr<tr::WriterLock> lock) -> std::shared_ptr<tr::MissCache> {
        if (!lock) throw py::value_error("the twin's miss cache needs a writer lock");
        return std::make_shared<ArrayMissCache<TwinInsert>>(TwinInsert{}, c.v, std::move(lock));
      },
      py::arg("view"), py::arg("lock"),
      "The cache of view (host memory) as LocalMisses inserts into it: the write kernel's "
      "insert run on the CPU, under lock.");
  m.def(
      "twin_lookup_tables",
      [](const py::list& tables, const py::list& keys, const py::list& outs,
         const py::list& statuses) {
        std::vector<gpu::LookupTarget> targets;
        for (const py::handle t : tables) {
          gpu::LookupTarget g;
          if (py::isinstance<CacheView>(t)) {
            g.view = t.cast<const CacheView&>().v;
          } else {
            const auto w = t.cast<py::tuple>();
            if (w.size() != 5) {
              throw py::value_error("a whole table: (index, rows, precision, dim, default_value)");
            }
            g.cache = 0;
            g.table = whole_table(w[0].cast<py::array>(), w[1].cast<py::array>(),
                                  w[2].cast<int64_t>(), w[3].cast<int64_t>(), w[4].cast<float>());
          }
          targets.push_back(g);
        }
        lookup_tables(
            targets, keys, outs, statuses,
            [](const gpu::LookupTarget* tg, size_t n, const int64_t* k, const int64_t* key_starts,
               const int64_t* out_starts, float* out, uint8_t* status) {
              std::vector<int64_t> spans(2 * n + 1);
              gpu::fill_lookup_spans(spans.data(), key_starts, out_starts, n);
              gpu::each_launch(n, key_starts, [&](size_t c0, size_t count) {
                xc::twin_lookup_tables(tg + c0, spans.data() + 2 * c0, static_cast<int>(count), k,
                                       out, status);
              });
            });
      },
      py::arg("tables"), py::arg("keys"), py::arg("out"), py::arg("status"),
      "trec_lookup_tables run on the CPU, in the same launches of at most 64 tables: tables "
      "are CacheViews (state arrays in host memory) or whole tables (index, rows, precision, "
      "dim, default_value); as gpu_lookup_tables.");
  m.def(
      "group_writes",
      [](const CacheView& c, const py::array& keys, int64_t repeat) {
        const int64_t* kp = int64s(keys, "keys");
        const int64_t n = keys.shape(0);
        if (repeat < 1) throw py::value_error("repeat must be at least 1");
        xc::GroupedWrites g;
        {
          py::gil_scoped_release release;
          for (int64_t r = 0; r < repeat; ++r) xc::group_writes(c.v, kp, n, &g);
        }
        auto arr = [](const std::vector<int64_t>& v) {
          py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
          std::copy(v.begin(), v.end(), a.mutable_data());
          return a;
        };
        return py::make_tuple(arr(g.keys), arr(g.src), arr(g.sets), arr(g.starts));
      },
      py::arg("view"), py::arg("keys"), py::arg("repeat") = 1,
      "What a write of keys to the cache gives its kernel (array_cache_twin.hpp "
      "group_writes): (keys, src, sets, starts): set sets[t] gets keys[starts[t]:starts[t+1]] "
      "(each distinct key once, its last occurrence src[i] in the batch; batch order within "
      "a set). repeat: run it that many times (a benchmark's timing without the arrays' "
      "making).");
  m.def("cache_twin_clear", [](const CacheView& c) { return xc::twin_clear(c.v); });
  m.def("cache_twin_repair", [](const CacheView& c) { return xc::twin_repair(c.v); });
}
