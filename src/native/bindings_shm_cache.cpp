// The shared-memory embedding cache of triton_rec._native (shm_cache.hpp): its error, its
// constants and the ShmCacheView class (bindings_shm_cache.hpp). Registered by bindings.cpp.
#include "bindings_shm_cache.hpp"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>

#include "py_checks.hpp"
#include "shm_cache.hpp"

namespace py = pybind11;
namespace tr = triton_rec;
using triton_rec::bind::make_params;
using triton_rec::bind::ShmCacheView;
using namespace triton_rec::pycheck;  // NOLINT: the argument checks

namespace {

PyObject* g_shm_cache_error = nullptr;  // triton_rec._native.ShmCacheError

}  // namespace

void register_shm_cache(py::module_& m) {
  // A triton_rec.errors.CacheError, and a RuntimeError as it always was.
  py::tuple bases = py::make_tuple(py::module_::import("triton_rec.errors").attr("CacheError"),
                                   py::handle(PyExc_RuntimeError));
  g_shm_cache_error = PyErr_NewExceptionWithDoc(
      "triton_rec._native.ShmCacheError",
      "A region is not an initialized shared cache, is malformed, or a lock cannot be used.",
      bases.ptr(), nullptr);
  if (!g_shm_cache_error) throw py::error_already_set();
  m.attr("ShmCacheError") = py::handle(g_shm_cache_error);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tr::ShmCacheError& e) {
      PyErr_SetString(g_shm_cache_error, e.what());
    }
  });
  m.attr("SHM_CACHE_LAYOUT_VERSION") = tr::kShmCacheLayoutVersion;
  m.attr("SHM_CACHE_MAX_WAYS") = tr::kShmCacheMaxWays;
  m.attr("SHM_CACHE_MAX_VEC_SIZE") = tr::kShmCacheMaxVecSize;
  m.attr("SHM_CACHE_ATTACH_SLOTS") = tr::kShmCacheAttachSlots;
  m.attr("SHM_CACHE_INITIALIZED_OFFSET") = tr::kShmCacheInitializedOffset;

  py::class_<ShmCacheView>(
      m, "ShmCacheView",
      "Set-associative embedding cache laid out inside a writable buffer (a shared mapping "
      "of a /dev/shm file; see src/native/shm_cache.hpp for the layout). Every method is "
      "thread- and process-safe: query is lock-free (per-set seqlocks), writers take a "
      "per-set process-shared robust mutex, and a writer killed mid-write is repaired by "
      "the next process that takes its set lock. Built with initialize() or attach().")
      .def_static(
          "required_bytes",
          [](int64_t num_sets, int64_t ways, int64_t vec_size, const std::string& policy,
             int64_t precision) {
            return tr::shm_cache_layout(make_params(num_sets, ways, vec_size, policy, precision))
                .total_bytes;
          },
          py::arg("num_sets"), py::arg("ways"), py::arg("vec_size"), py::arg("policy") = "lru",
          py::arg("precision") = 0,
          "required_bytes(num_sets: int, ways: int, vec_size: int, policy: str = 'lru', "
          "precision: int = 0) -> int"
          "\n\nBytes of the region for these parameters (num_sets a power of two, ways <= 64, "
          "policy 'lru' or 'tinylfu').")
      .def_static("initialize", &ShmCacheView::initialize, py::arg("buffer"), py::arg("num_sets"),
                  py::arg("ways"), py::arg("vec_size"), py::arg("policy") = "lru",
                  py::arg("checksum") = 0, py::arg("precision") = 0,
                  "initialize(buffer, num_sets: int, ways: int, vec_size: int, policy: str = "
                  "'lru', checksum: int = 0, precision: int = 0) -> ShmCacheView\n\n"
                  "precision: the code of the rows' encoding (RowCodec.code); insert/update "
                  "take rows in it, query decodes into float32. "
                  "Format the buffer as an empty cache (the 'initialized' flag is written last) "
                  "and return a view of it. No other process may use the buffer meanwhile.")
      .def_static("attach", &ShmCacheView::attach, py::arg("buffer"),
                  "attach(buffer) -> ShmCacheView\n\n"
                  "View of an already formatted buffer. Raises ShmCacheError if it is not an "
                  "initialized cache of this layout version, or is malformed or truncated.")
      .def("query", &ShmCacheView::query, py::arg("keys"), py::arg("out"), py::arg("hit_mask"),
           "query(keys: int64[M], out: float32[M, D], hit_mask: uint8|bool[M]) -> int\n\n"
           "out[i] = cached vector of keys[i] (decoded) and hit_mask[i] = 1, or hit_mask[i] = 0 "
           "(out[i] "
           "unspecified). Returns the number of hits. Lock-free; never returns a torn vector. "
           "Under TinyLFU every key counts as an access in the frequency sketch.")
      .def("insert", &ShmCacheView::insert, py::arg("keys"), py::arg("vectors"),
           "insert(keys: int64[M], vectors: rows[M]) -> (inserted, evicted, rejected)\n\n"
           "vectors: a row array of the cache's precision (float32 [M, D] for fp32). "
           "Insert keys in order (cached keys are overwritten: counted as updates). A full set "
           "evicts its least recently used way; under TinyLFU a new key is admitted into a "
           "full set only if it is more frequent than that victim (else rejected).")
      .def("update", &ShmCacheView::update, py::arg("keys"), py::arg("vectors"),
           "update(keys: int64[M], vectors: rows[M]) -> int\n\n"
           "Overwrite the vectors of keys already cached (no insertion, recency untouched); "
           "returns how many were cached.")
      .def("erase", &ShmCacheView::erase, py::arg("keys"),
           "erase(keys: int64[M]) -> int\n\nRemove keys; returns how many were cached.")
      .def("clear", &ShmCacheView::clear,
           "clear() -> None\n\nRemove every key (counters and TinyLFU sketch are kept).")
      .def("keys", &ShmCacheView::keys,
           "keys() -> int64[N]\n\nSnapshot of the cached keys (each set read consistently).")
      .def("size", &ShmCacheView::size, "size() -> int\n\nNumber of cached keys (a scan).")
      .def("stats", &ShmCacheView::stats,
           "stats() -> dict\n\nNode-wide counters (all processes): lookups, hits, misses, "
           "inserts, updates, evictions, rejected_admissions, erased, recovered_sets, "
           "sketch_agings.")
      .def_property_readonly("capacity", &ShmCacheView::capacity, "num_sets * ways")
      .def_property_readonly("num_sets", &ShmCacheView::num_sets)
      .def_property_readonly("ways", &ShmCacheView::ways)
      .def_property_readonly("vec_size", &ShmCacheView::vec_size)
      .def_property_readonly("precision", &ShmCacheView::precision,
                             "code of the rows' encoding (RowCodec.code)")
      .def_property_readonly("policy", &ShmCacheView::policy, "'lru' or 'tinylfu'")
      .def_property_readonly("checksum", &ShmCacheView::checksum)
      .def_property_readonly("nbytes", &ShmCacheView::nbytes, "bytes of the region in use")
      .def_property_readonly("released", &ShmCacheView::released)
      .def("release", &ShmCacheView::release,
           "release() -> None\n\nWait for calls running in other threads, then release the "
           "buffer; every later call raises ValueError.")
      .def("_register_token", &ShmCacheView::register_token, py::arg("token"),
           "_register_token(token: int) -> bool: claim a free attachment slot (False: table full)")
      .def("_unregister_token", &ShmCacheView::unregister_token, py::arg("token"),
           py::arg("all") = false,
           "_unregister_token(token: int, all: bool = False) -> int: free one (or every) slot "
           "holding token; returns slots freed")
      .def(
          "_address", [](const ShmCacheView& v) { return v.address(); },
          "_address() -> (int, int): base address and length of the mapped cache, for the "
          "native backend's hot path (valid while this view is not released)")
      .def("_tokens", &ShmCacheView::tokens, "_tokens() -> list[int]: attachment tokens in use")
      .def("_set_of", &ShmCacheView::set_of, py::arg("keys"),
           "_set_of(keys: int64[M]) -> int64[M]: set index of each key")
      .def("_estimate", &ShmCacheView::estimate, py::arg("keys"),
           "_estimate(keys: int64[M]) -> uint8[M]: TinyLFU frequency estimates (0 under lru)")
      .def("_debug_set_seq", &ShmCacheView::debug_set_seq, py::arg("set_index"),
           "_debug_set_seq(set_index: int) -> int: the set's seqlock counter (odd: being written)")
      .def("_debug_hold_set", &ShmCacheView::debug_hold_set, py::arg("set_index"),
           py::arg("seconds"),
           "_debug_hold_set(set_index: int, seconds: float) -> None\n\nTest hook: lock the set, "
           "start a write, tear every vector of the set and sleep holding the lock (GIL "
           "released), so that killing the process simulates a writer dying mid-write.")
      .def("__repr__", &ShmCacheView::repr);
}
