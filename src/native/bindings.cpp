// Thin pybind11 layer over hash_index.hpp and shm_cache.hpp: argument validation (dtype,
// C-contiguity, shape, writability; never a silent cast or copy), GIL release
// around bulk work, and exception translation. Module: triton_rec._native.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dense_net.hpp"
#include "drain.hpp"
#include "hash_index.hpp"
#include "local_misses.hpp"
#include "parent_watchdog.hpp"
#include "py_checks.hpp"
#include "request_kernels.hpp"
#include "shm_cache.hpp"

namespace py = pybind11;
namespace tr = triton_rec;

void register_gpu(py::module_& m);  // bindings_gpu.cpp

namespace {

using namespace triton_rec::pycheck;  // NOLINT: the argument checks, shared with bindings_gpu.cpp

PyObject* g_duplicate_key_error = nullptr;  // triton_rec._native.DuplicateKeyError
PyObject* g_corrupt_index_error = nullptr;  // triton_rec._native.CorruptIndexError

// The dtype of a row array of precision p (triton_rec/precision.py).
const DTypeSpec& row_dtype(tr::Precision p) {
  return p == tr::Precision::kFp16 ? kFloat16 : p == tr::Precision::kInt8 ? kUInt8 : kFloat32;
}
// Elements per row of a row array holding rows of `dim` values.
py::ssize_t row_width(tr::Precision p, py::ssize_t dim) {
  return p == tr::Precision::kInt8 ? dim + static_cast<py::ssize_t>(tr::kInt8TrailerBytes) : dim;
}
// The number of values per row of a row array of `width` elements (ValueError if none).
py::ssize_t dim_of_width(tr::Precision p, py::ssize_t width, const char* name) {
  const py::ssize_t dim =
      p == tr::Precision::kInt8 ? width - static_cast<py::ssize_t>(tr::kInt8TrailerBytes) : width;
  if (dim < 1) {
    throw py::value_error(std::string(name) + " has " + std::to_string(width) +
                          " columns: too few for an int8 row (values, then 8 bytes of scale "
                          "and bias)");
  }
  return dim;
}
tr::Precision require_precision(int64_t code) {
  try {
    return tr::precision_of(code);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

// An output must not share bytes with another argument (would race / self-overwrite).
void require_disjoint(const py::array& out, const char* out_name, const py::array& other,
                      const char* other_name) {
  if (out.nbytes() == 0 || other.nbytes() == 0) return;
  const auto* a = static_cast<const char*>(out.data());
  const auto* b = static_cast<const char*>(other.data());
  if (a < b + other.nbytes() && b < a + out.nbytes()) {
    throw py::value_error(std::string(out_name) + " must not overlap " + other_name);
  }
}

tr::IndexView require_index(const py::handle& obj) {
  py::array a = require_array(obj, "index", kInt64, 2, false);
  const auto cap = static_cast<uint64_t>(a.shape(0));
  if (a.shape(1) != 2 || !tr::is_valid_capacity(cap)) {
    throw py::value_error("index has shape " + shape_str(a) +
                          ", expected (capacity, 2) with capacity a power of two >= 16");
  }
  return tr::IndexView{static_cast<const int64_t*>(a.data()), cap};
}

py::array build_index(const py::handle& keys_obj) {
  py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
  const auto n = static_cast<size_t>(keys.shape(0));
  const auto cap = static_cast<py::ssize_t>(tr::index_capacity(n));
  py::array_t<int64_t> index({cap, py::ssize_t{2}});
  const auto* k = static_cast<const int64_t*>(keys.data());
  int64_t* slots = index.mutable_data();
  {
    py::gil_scoped_release release;
    tr::build_index(k, n, slots, static_cast<uint64_t>(cap));
  }
  return std::move(index);
}

int64_t probe(const py::handle& index_obj, const py::handle& keys_obj,
              const py::handle& out_rows_obj) {
  const tr::IndexView ix = require_index(index_obj);
  py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
  py::array out_rows = require_array(out_rows_obj, "out_rows", kInt64, 1, true);
  require_shape(out_rows, "out_rows", {keys.shape(0)});
  require_disjoint(out_rows, "out_rows", keys, "keys");
  require_disjoint(out_rows, "out_rows", py::reinterpret_borrow<py::array>(index_obj), "index");

  const auto* k = static_cast<const int64_t*>(keys.data());
  auto* rows = static_cast<int64_t*>(out_rows.mutable_data());
  const auto m = static_cast<size_t>(keys.shape(0));
  py::gil_scoped_release release;
  return tr::probe(ix, k, m, rows);
}

int64_t lookup(const py::handle& index_obj, const py::handle& vectors_obj,
               const py::handle& keys_obj, const py::handle& out_obj, double default_value,
               const py::handle& missing_obj, py::ssize_t num_threads, int64_t precision) {
  const tr::IndexView ix = require_index(index_obj);
  const tr::Precision prec = require_precision(precision);
  py::array index = py::reinterpret_borrow<py::array>(index_obj);
  py::array vectors = require_array(vectors_obj, "vectors", row_dtype(prec), 2, false);
  py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
  py::array out = require_array(out_obj, "out", kFloat32, 2, true);
  const py::ssize_t m = keys.shape(0), dim = dim_of_width(prec, vectors.shape(1), "vectors");
  require_shape(out, "out", {m, dim});
  const bool has_missing = !missing_obj.is_none();
  py::array missing;  // (a default py::array is an empty float64 array, not null)
  if (has_missing) {
    missing = require_array(missing_obj, "missing", kMask, 1, true);
    require_shape(missing, "missing", {m});
  }
  if (num_threads < 1) {
    throw py::value_error("num_threads must be >= 1, got " + std::to_string(num_threads));
  }
  require_disjoint(out, "out", vectors, "vectors");
  require_disjoint(out, "out", keys, "keys");
  require_disjoint(out, "out", index, "index");
  if (has_missing) {
    require_disjoint(missing, "missing", out, "out");
    require_disjoint(missing, "missing", vectors, "vectors");
    require_disjoint(missing, "missing", keys, "keys");
    require_disjoint(missing, "missing", index, "index");
  }

  const tr::TableView table{vectors.data(), vectors.shape(0),
                            tr::RowFormat(prec, static_cast<size_t>(dim))};
  const auto* k = static_cast<const int64_t*>(keys.data());
  auto* o = static_cast<float*>(out.mutable_data());
  auto* mask = has_missing ? static_cast<uint8_t*>(missing.mutable_data()) : nullptr;
  py::gil_scoped_release release;
  return tr::lookup(ix, table, k, static_cast<size_t>(m), o, static_cast<float>(default_value),
                    mask, static_cast<size_t>(num_threads));
}

// Decodes a row array of precision `precision` into out (float32 [N, D]).
void decode_rows(const py::handle& rows_obj, const py::handle& out_obj, int64_t precision,
                 bool portable) {
  const tr::Precision prec = require_precision(precision);
  py::array rows = require_array(rows_obj, "rows", row_dtype(prec), 2, false);
  py::array out = require_array(out_obj, "out", kFloat32, 2, true);
  const py::ssize_t n = rows.shape(0), dim = dim_of_width(prec, rows.shape(1), "rows");
  require_shape(out, "out", {n, dim});
  require_disjoint(out, "out", rows, "rows");
  const tr::DecodeFn decode = tr::decoder_for(prec, portable);
  const auto* r = static_cast<const uint8_t*>(rows.data());
  auto* o = static_cast<float*>(out.mutable_data());
  const size_t rb = tr::row_bytes_of(prec, static_cast<size_t>(dim));
  py::gil_scoped_release release;
  for (py::ssize_t i = 0; i < n; ++i) decode(r + i * rb, o + i * dim, static_cast<size_t>(dim));
}

bool combine_segments(const py::handle& vectors_obj, const py::handle& ptr_obj, bool mean,
                      const py::handle& out_obj) {
  py::array vectors = require_array(vectors_obj, "vectors", kFloat32, 2, false);
  py::array ptr = require_array(ptr_obj, "row_ptr", kInt64, 1, false);
  py::array out = require_array(out_obj, "out", kFloat32, 2, true);
  if (ptr.shape(0) < 1) throw py::value_error("row_ptr must hold at least one value");
  const py::ssize_t segments = ptr.shape(0) - 1, dim = vectors.shape(1);
  require_shape(out, "out", {segments, dim});
  require_disjoint(out, "out", vectors, "vectors");
  require_disjoint(out, "out", ptr, "row_ptr");
  const auto* v = static_cast<const float*>(vectors.data());
  const auto* p = static_cast<const int64_t*>(ptr.data());
  auto* o = static_cast<float*>(out.mutable_data());
  const py::ssize_t rows = vectors.shape(0);
  py::gil_scoped_release release;
  return tr::combine_segments(v, rows, dim, p, segments, mean, o);
}

// Per segment [bounds[j], bounds[j+1]) of keys: (distinct keys, distinct keys that hit).
py::array_t<int64_t> distinct_hit_counts(const py::handle& keys_obj, const py::handle& hit_obj,
                                         const py::handle& bounds_obj) {
  py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
  py::array hit = require_array(hit_obj, "hit", kMask, 1, false);
  py::array bounds = require_array(bounds_obj, "bounds", kInt64, 1, false);
  const py::ssize_t n = keys.shape(0);
  require_shape(hit, "hit", {n});
  if (bounds.shape(0) < 1) throw py::value_error("bounds must hold at least one value");
  const auto* b = static_cast<const int64_t*>(bounds.data());
  const py::ssize_t segments = bounds.shape(0) - 1;
  int64_t longest = 0;
  if (b[0] != 0 || b[segments] != n) throw py::value_error("bounds must run from 0 to len(keys)");
  for (py::ssize_t j = 0; j < segments; ++j) {
    if (b[j + 1] < b[j]) throw py::value_error("bounds must not decrease");
    longest = std::max<int64_t>(longest, b[j + 1] - b[j]);
  }
  py::array_t<int64_t> out({segments, py::ssize_t(2)});
  auto* o = out.mutable_data();
  const auto* k = static_cast<const int64_t*>(keys.data());
  const auto* h = static_cast<const uint8_t*>(hit.data());
  const uint64_t capacity = tr::index_capacity(static_cast<uint64_t>(longest));
  {
    py::gil_scoped_release release;
    std::vector<int64_t> scratch(capacity);
    std::vector<uint8_t> used(capacity);
    for (py::ssize_t j = 0; j < segments; ++j) {
      tr::count_distinct_hits(k + b[j], h + b[j], b[j + 1] - b[j], scratch.data(), used.data(),
                              capacity, o + 2 * j, o + 2 * j + 1);
    }
  }
  return out;
}

bool regroup_hugectr(const py::handle& cat_obj, const py::handle& rowindex_obj,
                     const py::handle& slots_obj, int64_t samples, const py::handle& out_keys_obj,
                     const py::handle& key_offsets_obj, const py::handle& out_ptrs_obj) {
  py::array cat = py::reinterpret_borrow<py::array>(cat_obj);
  const bool wide = py::isinstance<py::array>(cat_obj) && cat.dtype().kind() == 'i';
  cat = require_array(cat_obj, "catcolumn", wide ? kInt64 : kUInt32, 1, false);
  py::array rowindex = require_array(rowindex_obj, "rowindex", kInt32, 1, false);
  py::array slots = require_array(slots_obj, "slots", kInt64, 1, false);
  py::array out_keys = require_array(out_keys_obj, "out_keys", kInt64, 1, true);
  py::array offsets = require_array(key_offsets_obj, "key_offsets", kInt64, 1, true);
  py::array out_ptrs = require_array(out_ptrs_obj, "out_ptrs", kInt64, 1, true);
  const py::ssize_t tables = slots.shape(0);
  const auto* s = static_cast<const int64_t*>(slots.data());
  if (samples < 1) throw py::value_error("samples must be >= 1");
  py::ssize_t rows = 0;
  for (py::ssize_t t = 0; t < tables; ++t) {
    if (s[t] < 1) throw py::value_error("slots must be >= 1");
    rows += samples * s[t] + 1;
  }
  require_shape(rowindex, "rowindex", {rows});
  require_shape(out_keys, "out_keys", {cat.shape(0)});
  require_shape(offsets, "key_offsets", {tables + 1});
  require_shape(out_ptrs, "out_ptrs", {rows});
  for (const py::array* a : {&cat, &rowindex, &slots}) {
    require_disjoint(out_keys, "out_keys", *a, "an input");
    require_disjoint(offsets, "key_offsets", *a, "an input");
    require_disjoint(out_ptrs, "out_ptrs", *a, "an input");
  }
  const auto* ri = static_cast<const int32_t*>(rowindex.data());
  auto* ok = static_cast<int64_t*>(out_keys.mutable_data());
  auto* ko = static_cast<int64_t*>(offsets.mutable_data());
  auto* op = static_cast<int64_t*>(out_ptrs.mutable_data());
  const py::ssize_t n = cat.shape(0);
  const void* c = cat.data();
  py::gil_scoped_release release;
  if (wide) {
    return tr::regroup_hugectr(static_cast<const int64_t*>(c), n, ri, s, tables, samples, ok, ko,
                               op);
  }
  return tr::regroup_hugectr(static_cast<const uint32_t*>(c), n, ri, s, tables, samples, ok, ko,
                             op);
}

}  // namespace

// Defined at the end of this file: the ShmCacheView class (shm_cache.hpp).
void register_shm_cache(py::module_& m);
void register_dense_net(py::module_& m);
void register_local_misses(py::module_& m);

PYBIND11_MODULE(_native, m) {
  m.doc() =
      "Native core of triton_rec: an open-addressing int64 hash index stored as a plain "
      "int64 (capacity, 2) numpy array (slot = (key, row), row -1 = empty; see "
      "src/native/hash_index.hpp for the persisted layout) and a fused probe + gather lookup.";
  // The docstrings below start with hand-written signatures (argument types in numpy terms).
  py::options options;
  options.disable_function_signatures();

  // Every error a user can see derives from triton_rec.errors.TritonRecError (the
  // package's one root; errors.py imports nothing, so this import cannot cycle), and
  // still from the builtin class it always was.
  py::module_ errors = py::module_::import("triton_rec.errors");
  py::tuple value_error_bases =
      py::make_tuple(errors.attr("TritonRecError"), py::handle(PyExc_ValueError));
  g_duplicate_key_error = PyErr_NewExceptionWithDoc(
      "triton_rec._native.DuplicateKeyError",
      "A table holds the same key twice (attributes: key, first_row, second_row).",
      value_error_bases.ptr(), nullptr);
  g_corrupt_index_error = PyErr_NewExceptionWithDoc(
      "triton_rec._native.CorruptIndexError",
      "An index slot holds an impossible row id (corrupt index or index/table mismatch).",
      value_error_bases.ptr(), nullptr);
  if (!g_duplicate_key_error || !g_corrupt_index_error) throw py::error_already_set();
  // The module keeps them alive; the globals hold one extra (never released) reference.
  m.attr("DuplicateKeyError") = py::handle(g_duplicate_key_error);
  m.attr("CorruptIndexError") = py::handle(g_corrupt_index_error);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const tr::DuplicateKeyError& e) {
      py::object exc = py::handle(g_duplicate_key_error)(e.what());
      exc.attr("key") = e.key;
      exc.attr("first_row") = e.first_row;
      exc.attr("second_row") = e.second_row;
      PyErr_SetObject(g_duplicate_key_error, exc.ptr());
    } catch (const tr::CorruptIndexError& e) {
      PyErr_SetString(g_corrupt_index_error, e.what());
    }
  });

  m.attr("EMPTY_ROW") = tr::kEmptyRow;
  m.attr("MIN_CAPACITY") = tr::kMinCapacity;

  py::class_<tr::DrainMap>(m, "DrainMap",
                           "The drained stop's shared words (src/native/drain.hpp): a mapped "
                           "64-byte file; triton_rec.triton.drain wraps it.")
      .def(py::init<const std::string&>(), py::arg("path"))
      .def_property_readonly("draining", &tr::DrainMap::draining)
      .def_property_readonly("in_flight", &tr::DrainMap::in_flight)
      .def("start_draining", &tr::DrainMap::start_draining)
      .def("enter", &tr::DrainMap::enter,
           "enter() -> bool: count an execute in flight; True if it must refuse (draining)")
      .def("leave", &tr::DrainMap::leave, "leave(): the execute counted by enter() is done");
  m.attr("DRAIN_FILE_BYTES") = tr::kDrainFileBytes;
  m.attr("STOPPING_MESSAGE") = tr::kStoppingMessage;

  m.def("start_parent_watchdog", &tr::start_parent_watchdog, py::arg("grace_seconds"),
        py::arg("exit_code") = 1, py::arg("poll_ms") = 100,
        "start_parent_watchdog(grace_seconds: float, exit_code: int = 1, poll_ms: int = 100) "
        "-> bool\n\n"
        "Once per process: a native thread (no GIL, no lock) that calls _exit(exit_code) when "
        "the parent process has been gone for grace_seconds. Returns False if already started.");

  m.def("combine_segments", &combine_segments, py::arg("vectors"), py::arg("row_ptr"),
        py::arg("mean"), py::arg("out"),
        "combine_segments(vectors: float32[N, D], row_ptr: int64[S+1], mean: bool, "
        "out: float32[S, D]) -> bool\n\n"
        "HugeCTR's slot combiner: out[s] = float32 sum of vectors[row_ptr[s]:row_ptr[s+1]] "
        "in row order, divided by the count when mean and the count is above 1; zeros for an "
        "empty segment. Returns False, writing nothing, unless row_ptr is non-decreasing "
        "within [0, N] (the caller then explains the error).");

  m.def("distinct_hit_counts", &distinct_hit_counts, py::arg("keys"), py::arg("hit"),
        py::arg("bounds"),
        "Per segment [bounds[j], bounds[j+1]) of keys: (distinct keys, distinct keys whose hit "
        "flag is set), as int64 [segments, 2]; HPS's hit rate counts each key once.");
  m.def("regroup_hugectr", &regroup_hugectr, py::arg("catcolumn"), py::arg("rowindex"),
        py::arg("slots"), py::arg("samples"), py::arg("out_keys"), py::arg("key_offsets"),
        py::arg("out_ptrs"),
        "regroup_hugectr(catcolumn: int64|uint32[K], rowindex: int32[R], slots: int64[T], "
        "samples: int, out_keys: int64[K], key_offsets: int64[T+1], out_ptrs: int64[R]) -> bool"
        "\n\n"
        "A HugeCTR request's keys table-major (sample-major CATCOLUMN regrouped), each table's "
        "start, and ROWINDEX widened. Returns False unless every table's block of "
        "samples*slots[t]+1 row pointers starts at 0, never decreases, and the blocks count "
        "exactly K keys (the caller then explains the error).");

  m.def(
      "index_capacity", [](uint64_t num_keys) { return tr::index_capacity(num_keys); },
      py::arg("num_keys"),
      "index_capacity(num_keys: int) -> int\n\n"
      "Number of slots of the index of a table with num_keys keys: "
      "max(16, next power of two >= 2 * num_keys).");

  m.def("build_index", &build_index, py::arg("keys"),
        "build_index(keys: int64[N]) -> int64[capacity, 2]\n\n"
        "Build the hash index of a table whose row i has key keys[i]. Raises "
        "DuplicateKeyError (a ValueError) naming the key and both rows on a repeated key.");

  m.def("probe", &probe, py::arg("index"), py::arg("keys"), py::arg("out_rows"),
        "probe(index, keys: int64[M], out_rows: int64[M]) -> int\n\n"
        "Write the row of each key to out_rows (-1 when absent); return the number absent.");

  m.def("lookup", &lookup, py::arg("index"), py::arg("vectors"), py::arg("keys"), py::arg("out"),
        py::arg("default_value"), py::arg("missing") = py::none(), py::arg("num_threads") = 1,
        py::arg("precision") = 0,
        "lookup(index, vectors: rows[N], keys: int64[M], out: float32[M, D], "
        "default_value: float, missing: uint8|bool[M] | None = None, num_threads: int = 1, "
        "precision: int = 0) -> int"
        "\n\n"
        "Fused probe + gather + decode: out[i] = decoded vectors[row of keys[i]] (vectors: a "
        "row array of the precision code, RowCodec.code), or default_value in every "
        "element when the key is absent (missing[i] = 1 then, else 0). Returns the number "
        "of absent keys. num_threads > 1 splits the keys across threads; output is identical.");

  m.def("decode_rows", &decode_rows, py::arg("rows"), py::arg("out"), py::arg("precision"),
        py::arg("portable") = false,
        "decode_rows(rows, out: float32[N, D], precision: int, portable: bool = False) -> None"
        "\n\n"
        "The native decoder of the fused gathers (row_codec.hpp) over a row array; portable "
        "forces the plain C++ version instead of the CPU's SIMD one.");
  py::tuple precisions(static_cast<size_t>(tr::kNumPrecisions));
  for (uint32_t i = 0; i < tr::kNumPrecisions; ++i) precisions[i] = tr::kPrecisionNames[i];
  m.attr("PRECISIONS") = precisions;
  m.attr("INT8_TRAILER_BYTES") = tr::kInt8TrailerBytes;
  m.attr("SIMD_DECODE") = [] {
    const tr::DecodeFn simd = tr::decoder_for(tr::Precision::kFp16);
    return simd != tr::decoder_for(tr::Precision::kFp16, true);
  }();

  register_shm_cache(m);
  register_local_misses(m);
  register_dense_net(m);
}

// ============================================================================
// ShmCacheView: the shared-memory embedding cache (shm_cache.hpp) over a
// writable Python buffer (an mmap.mmap of a /dev/shm file, or a numpy uint8
// array in tests). The view holds a buffer export (and so a reference to the
// buffer object) until release(), so the memory outlives every native call.
// ============================================================================
namespace {

PyObject* g_shm_cache_error = nullptr;  // triton_rec._native.ShmCacheError

tr::CachePolicy parse_policy(const std::string& name) {
  if (name == "lru") return tr::CachePolicy::kLru;
  if (name == "tinylfu") return tr::CachePolicy::kTinyLfu;
  throw py::value_error("policy must be 'lru' or 'tinylfu', got '" + name + "'");
}

tr::ShmCacheParams make_params(int64_t num_sets, int64_t ways, int64_t vec_size,
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

}  // namespace

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

// ============================================================================
// DenseNet: the native dense executor (dense_net.hpp), for tests and tools; the native
// Triton backend runs the same class on the request path.
// ============================================================================
namespace {

struct PyDenseNet {
  py::object owner;  // holds the weight arrays the program points to
  tr::DenseNet net;
};

}  // namespace

void register_dense_net(py::module_& m) {
  py::class_<PyDenseNet>(m, "DenseNet",
                         "DenseNet(program: int64[N], owner, gemm='auto') -- the native executor "
                         "of a HugeCTRNetwork.native_program(); `owner` keeps its weights alive; "
                         "`gemm` names the matrix-product kernel (gemm_kernels())")
      .def(py::init([](py::array_t<int64_t, py::array::c_style> program, py::object owner,
                       const std::string& gemm) {
             try {
               return new PyDenseNet{
                   std::move(owner),
                   tr::DenseNet(program.data(), static_cast<size_t>(program.size()),
                                tr::gemm_kernel(gemm))};
             } catch (const std::invalid_argument& e) {
               throw py::value_error(e.what());
             }
           }),
           py::arg("program"), py::arg("owner"), py::arg("gemm") = "auto")
      .def_property_readonly(
          "gemm", [](const PyDenseNet& self) { return std::string(self.net.kernel().name); },
          "The kernel its matrix products run on.")
      .def_property_readonly(
          "steps",
          [](const PyDenseNet& self) {
            py::list ops;
            for (int64_t op : self.net.steps()) ops.append(op);
            return ops;
          },
          "The op code of each step it runs (a ReLU or Concat folded into the step that "
          "produces or reads its tensor is not one).")
      .def(
          "predict",
          [](const PyDenseNet& self, py::array_t<float, py::array::c_style> dense,
             const py::list& embeddings) {
            const tr::DenseNet& net = self.net;
            if (dense.ndim() != 2 || dense.shape(1) != net.dense_dim()) {
              throw py::value_error("dense must be [batch, dense_dim]");
            }
            const int64_t batch = dense.shape(0);
            if (embeddings.size() != net.num_tables()) {
              throw py::value_error("one embedding array per table expected");
            }
            std::vector<py::array_t<float, py::array::c_style>> held;
            std::vector<const float*> emb;
            for (size_t t = 0; t < embeddings.size(); ++t) {
              held.emplace_back(py::array_t<float, py::array::c_style>::ensure(embeddings[t]));
              if (!held.back() || held.back().size() != batch * net.table_width(t)) {
                throw py::value_error("embeddings[" + std::to_string(t) +
                                      "] must be float32 [batch, slots, vec_size]");
              }
              emb.push_back(held.back().data());
            }
            py::array_t<float> out({batch, net.label_dim()});
            float* o = out.mutable_data();
            const float* d = dense.data();
            {
              py::gil_scoped_release release;
              // reused from call to call, as an instance's is on the request path
              thread_local tr::DenseNet::Workspace ws;
              net.predict(batch, d, emb, o, &ws);
            }
            return out;
          },
          py::arg("dense"), py::arg("embeddings"),
          "predict(dense: float32[B, dense_dim], embeddings: list of float32[B, slots, vec]) "
          "-> float32[B, label_dim]");
  // Each kernel of DLRM's interaction on its own, for tests/unit/test_native_dense.py
  // (the executor itself takes the CPU's widest, interaction_rows).
  m.def(
      "interaction_kernels",
      []() {
        py::list k;
        k.append("auto");
        for (const tr::InteractionKernel& each : tr::interaction_kernels()) k.append(each.name);
        return k;
      },
      "The interaction kernels this CPU runs (names for interaction()).");
  m.def(
      "interaction",
      [](py::array_t<float, py::array::c_style> mlp, py::array_t<float, py::array::c_style> emb,
         const std::string& kernel) {
        if (mlp.ndim() != 2 || emb.ndim() != 3 || emb.shape(0) != mlp.shape(0) ||
            emb.shape(2) != mlp.shape(1)) {
          throw py::value_error("mlp and emb must be float32 [rows, dim] and [rows, slots, dim]");
        }
        const int64_t rows = mlp.shape(0), dim = mlp.shape(1), slots = emb.shape(1);
        const int64_t n = slots + 1, width = dim + n * (n - 1) / 2 + 1;
        tr::InteractionFn fn = nullptr;
        if (kernel == "auto") fn = tr::interaction_rows;
        for (const tr::InteractionKernel& each : tr::interaction_kernels()) {
          if (kernel == each.name) fn = each.fn;
        }
        if (fn == nullptr) throw py::value_error("no interaction kernel " + kernel + " here");
        py::array_t<float> out({rows, width});
        {
          py::gil_scoped_release release;
          std::vector<tr::SlotSource> sources(static_cast<size_t>(slots));
          tr::contiguous_slots(emb.data(), slots, dim, sources.data());
          fn(rows, dim, slots, width, mlp.data(), sources.data(), out.mutable_data());
        }
        return out;
      },
      py::arg("mlp"), py::arg("emb"), py::arg("kernel") = "auto",
      "interaction(mlp: float32[R, d], emb: float32[R, S, d], kernel) -> float32[R, width]: "
      "DLRM's interaction by one kernel (see interaction_kernels()).");
  register_gpu(m);
  m.def(
      "gemm_kernels",
      []() {
        py::list k;
        for (const tr::GemmKernel& g : tr::gemm_kernels()) k.append(g.name);
        return k;
      },
      "The matrix-product kernels this CPU runs, the widest (the default) first (gemm.hpp).");
}
