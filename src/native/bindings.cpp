// Thin pybind11 layer over hash_index.hpp: argument validation (dtype,
// C-contiguity, shape, writability; never a silent cast or copy), GIL release
// around bulk work, and exception translation. Module: triton_rec._native.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "hash_index.hpp"

namespace py = pybind11;
namespace tr = triton_rec;

namespace {

PyObject* g_duplicate_key_error = nullptr;  // triton_rec._native.DuplicateKeyError
PyObject* g_corrupt_index_error = nullptr;  // triton_rec._native.CorruptIndexError

struct DTypeSpec {
  const char* name;  // as in messages: "int64", "float32", "uint8 or bool"
  char kind1;
  char kind2;  // second accepted kind (0: none), same itemsize
  py::ssize_t itemsize;
};
constexpr DTypeSpec kInt64{"int64", 'i', 0, 8};
constexpr DTypeSpec kFloat32{"float32", 'f', 0, 4};
constexpr DTypeSpec kMask{"uint8 or bool", 'u', 'b', 1};

std::string tuple_str(const py::ssize_t* v, py::ssize_t n) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + (n == 1 ? ",)" : ")");
}
std::string shape_str(const py::array& a) { return tuple_str(a.shape(), a.ndim()); }

bool native_order(char byteorder) {
  const uint16_t probe = 1;
  const bool little = *reinterpret_cast<const uint8_t*>(&probe) == 1;
  return byteorder == '=' || byteorder == '|' || byteorder == (little ? '<' : '>');
}

// Checks, in this order: ndarray, dtype, ndim, C-contiguity, writability.
py::array require_array(const py::handle& obj, const char* name, const DTypeSpec& want, int ndim,
                        bool writable) {
  if (!py::isinstance<py::array>(obj)) {
    const std::string got = py::str(py::type::handle_of(obj).attr("__name__"));
    throw py::type_error(std::string(name) + " must be a numpy.ndarray of " + want.name +
                         ", got " + got);
  }
  auto a = py::reinterpret_borrow<py::array>(obj);
  const py::dtype dt = a.dtype();
  const bool kind_ok = dt.kind() == want.kind1 || (want.kind2 && dt.kind() == want.kind2);
  if (!kind_ok || dt.itemsize() != want.itemsize || !native_order(dt.byteorder())) {
    throw py::type_error(std::string(name) + " must be " + want.name + " C-contiguous, got " +
                         std::string(py::str(dt)));
  }
  if (a.ndim() != ndim) {
    throw py::value_error(std::string(name) + " must be " + std::to_string(ndim) +
                          "-D, got shape " + shape_str(a));
  }
  if (!(a.flags() & py::array::c_style)) {
    throw py::value_error(std::string(name) + " must be " + want.name +
                          " C-contiguous, got a non-contiguous array with strides " +
                          tuple_str(a.strides(), a.ndim()));
  }
  if (writable && !a.writeable()) {
    throw py::value_error(std::string(name) + " must be writable, got a read-only array");
  }
  return a;
}

void require_shape(const py::array& a, const char* name, std::initializer_list<py::ssize_t> want) {
  const py::ssize_t* got = a.shape();
  bool same = static_cast<size_t>(a.ndim()) == want.size();
  size_t d = 0;
  for (py::ssize_t w : want) same = same && got[d++] == w;
  if (!same) {
    throw py::value_error(std::string(name) + " has shape " + shape_str(a) + ", expected " +
                          tuple_str(want.begin(), static_cast<py::ssize_t>(want.size())));
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
               const py::handle& missing_obj, py::ssize_t num_threads) {
  const tr::IndexView ix = require_index(index_obj);
  py::array index = py::reinterpret_borrow<py::array>(index_obj);
  py::array vectors = require_array(vectors_obj, "vectors", kFloat32, 2, false);
  py::array keys = require_array(keys_obj, "keys", kInt64, 1, false);
  py::array out = require_array(out_obj, "out", kFloat32, 2, true);
  const py::ssize_t m = keys.shape(0), dim = vectors.shape(1);
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

  const tr::TableView table{static_cast<const float*>(vectors.data()), vectors.shape(0),
                            static_cast<size_t>(dim)};
  const auto* k = static_cast<const int64_t*>(keys.data());
  auto* o = static_cast<float*>(out.mutable_data());
  auto* mask = has_missing ? static_cast<uint8_t*>(missing.mutable_data()) : nullptr;
  py::gil_scoped_release release;
  return tr::lookup(ix, table, k, static_cast<size_t>(m), o, static_cast<float>(default_value),
                    mask, static_cast<size_t>(num_threads));
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() =
      "Native core of triton_rec: an open-addressing int64 hash index stored as a plain "
      "int64 (capacity, 2) numpy array (slot = (key, row), row -1 = empty; see "
      "src/native/hash_index.hpp for the persisted layout) and a fused probe + gather lookup.";
  // The docstrings below start with hand-written signatures (argument types in numpy terms).
  py::options options;
  options.disable_function_signatures();

  g_duplicate_key_error = PyErr_NewExceptionWithDoc(
      "triton_rec._native.DuplicateKeyError",
      "A table holds the same key twice (attributes: key, first_row, second_row).",
      PyExc_ValueError, nullptr);
  g_corrupt_index_error = PyErr_NewExceptionWithDoc(
      "triton_rec._native.CorruptIndexError",
      "An index slot holds an impossible row id (corrupt index or index/table mismatch).",
      PyExc_ValueError, nullptr);
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

  m.def("index_capacity", [](uint64_t num_keys) { return tr::index_capacity(num_keys); },
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

  m.def("lookup", &lookup, py::arg("index"), py::arg("vectors"), py::arg("keys"),
        py::arg("out"), py::arg("default_value"), py::arg("missing") = py::none(),
        py::arg("num_threads") = 1,
        "lookup(index, vectors: float32[N, D], keys: int64[M], out: float32[M, D], "
        "default_value: float, missing: uint8|bool[M] | None = None, num_threads: int = 1) -> int"
        "\n\n"
        "Fused probe + gather: out[i] = vectors[row of keys[i]], or default_value in every "
        "element when the key is absent (missing[i] = 1 then, else 0). Returns the number "
        "of absent keys. num_threads > 1 splits the keys across threads; output is identical.");
}
