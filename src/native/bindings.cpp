// Thin pybind11 layer over the native core: argument validation (dtype, C-contiguity,
// shape, writability; never a silent cast or copy: py_checks.hpp), GIL release around bulk
// work, and exception translation. Module: triton_rec._native. This file: the module, its
// errors, the hash index, the fused lookup, the request kernels, the drain and the watchdog;
// its other groups are registered from bindings_<group>.cpp (shm_cache, local_misses,
// dense_net, array_cache, gpu).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "drain.hpp"
#include "hash_index.hpp"
#include "parent_watchdog.hpp"
#include "plan_fields.hpp"
#include "py_checks.hpp"
#include "request_kernels.hpp"

namespace py = pybind11;
namespace tr = triton_rec;

namespace {

using namespace triton_rec::pycheck;  // NOLINT: the argument checks, shared by bindings*.cpp

PyObject* g_duplicate_key_error = nullptr;  // triton_rec._native.DuplicateKeyError
PyObject* g_corrupt_index_error = nullptr;  // triton_rec._native.CorruptIndexError

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

// The module's other groups, each in its file (bindings_<group>.cpp).
void register_shm_cache(py::module_& m);
void register_local_misses(py::module_& m);
void register_dense_net(py::module_& m);
void register_array_cache(py::module_& m);
void register_gpu(py::module_& m);
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

  // The fields the native backend reads of each dataclass of a native plan (plan_fields.hpp;
  // triton_rec/serving/native_plan.py: tests hold them equal to the dataclasses').
  py::dict plan_fields;
  for (const tr::plan_fields::PlanType* t : tr::plan_fields::kPlanTypes) {
    py::tuple names(static_cast<size_t>(t->count));
    for (int i = 0; i < t->count; ++i) names[i] = t->fields[i];
    plan_fields[t->name] = names;
  }
  m.attr("PLAN_FIELDS") = plan_fields;

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
  register_array_cache(m);
  register_gpu(m);
}
