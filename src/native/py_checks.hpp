// Argument checks of the pybind11 layer (bindings*.cpp): dtype, dimensions, C-contiguity,
// writability, shape, row arrays of a precision, hash indexes; never a silent cast or copy.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "hash_index.hpp"
#include "row_codec.hpp"

namespace triton_rec {
namespace pycheck {

namespace py = pybind11;

struct DTypeSpec {
  const char* name;  // as in messages: "int64", "float32", "uint8 or bool"
  char kind1;
  char kind2;  // second accepted kind (0: none), same itemsize
  py::ssize_t itemsize;
};
inline constexpr DTypeSpec kInt64{"int64", 'i', 0, 8};
inline constexpr DTypeSpec kFloat32{"float32", 'f', 0, 4};
inline constexpr DTypeSpec kMask{"uint8 or bool", 'u', 'b', 1};
inline constexpr DTypeSpec kInt32{"int32", 'i', 0, 4};
inline constexpr DTypeSpec kUInt32{"uint32", 'u', 0, 4};
inline constexpr DTypeSpec kFloat16{"float16", 'f', 0, 2};
inline constexpr DTypeSpec kUInt8{"uint8", 'u', 0, 1};

inline std::string tuple_str(const py::ssize_t* v, py::ssize_t n) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < n; ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + (n == 1 ? ",)" : ")");
}
inline std::string shape_str(const py::array& a) { return tuple_str(a.shape(), a.ndim()); }

inline bool native_order(char byteorder) {
  const uint16_t probe = 1;
  const bool little = *reinterpret_cast<const uint8_t*>(&probe) == 1;
  return byteorder == '=' || byteorder == '|' || byteorder == (little ? '<' : '>');
}

// Checks, in this order: ndarray, dtype, ndim, C-contiguity, writability.
inline py::array require_array(const py::handle& obj, const char* name, const DTypeSpec& want,
                               int ndim, bool writable) {
  if (!py::isinstance<py::array>(obj)) {
    const std::string got = py::str(py::type::handle_of(obj).attr("__name__"));
    throw py::type_error(std::string(name) + " must be a numpy.ndarray of " + want.name + ", got " +
                         got);
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

inline void require_shape(const py::array& a, const char* name,
                          std::initializer_list<py::ssize_t> want) {
  const py::ssize_t* got = a.shape();
  bool same = static_cast<size_t>(a.ndim()) == want.size();
  size_t d = 0;
  for (py::ssize_t w : want) same = same && got[d++] == w;
  if (!same) {
    throw py::value_error(std::string(name) + " has shape " + shape_str(a) + ", expected " +
                          tuple_str(want.begin(), static_cast<py::ssize_t>(want.size())));
  }
}

// The dtype of a row array of precision p (triton_rec/precision.py).
inline const DTypeSpec& row_dtype(Precision p) {
  return p == Precision::kFp16 ? kFloat16 : p == Precision::kInt8 ? kUInt8 : kFloat32;
}
// Elements per row of a row array holding rows of `dim` values.
inline py::ssize_t row_width(Precision p, py::ssize_t dim) {
  return p == Precision::kInt8 ? dim + static_cast<py::ssize_t>(kInt8TrailerBytes) : dim;
}
// The number of values per row of a row array of `width` elements (ValueError if none).
inline py::ssize_t dim_of_width(Precision p, py::ssize_t width, const char* name) {
  const py::ssize_t dim =
      p == Precision::kInt8 ? width - static_cast<py::ssize_t>(kInt8TrailerBytes) : width;
  if (dim < 1) {
    throw py::value_error(std::string(name) + " has " + std::to_string(width) +
                          " columns: too few for an int8 row (values, then 8 bytes of scale "
                          "and bias)");
  }
  return dim;
}
inline Precision require_precision(int64_t code) {
  try {
    return precision_of(code);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

// An output must not share bytes with another argument (would race / self-overwrite).
inline void require_disjoint(const py::array& out, const char* out_name, const py::array& other,
                             const char* other_name) {
  if (out.nbytes() == 0 || other.nbytes() == 0) return;
  const auto* a = static_cast<const char*>(out.data());
  const auto* b = static_cast<const char*>(other.data());
  if (a < b + other.nbytes() && b < a + out.nbytes()) {
    throw py::value_error(std::string(out_name) + " must not overlap " + other_name);
  }
}

// A hash index, or a direct one (hash_index.hpp: [[base, rows]]).
inline IndexView require_index(const py::handle& obj) {
  py::array a = require_array(obj, "index", kInt64, 2, false);
  const auto cap = static_cast<uint64_t>(a.shape(0));
  if (a.shape(1) != 2 || (cap != 1 && !is_valid_capacity(cap))) {
    throw py::value_error("index has shape " + shape_str(a) +
                          ", expected (capacity, 2) with capacity a power of two >= 16, "
                          "or (1, 2) for a direct index");
  }
  try {
    return index_view(static_cast<const int64_t*>(a.data()), cap);
  } catch (const std::invalid_argument& e) {
    throw py::value_error(e.what());
  }
}

}  // namespace pycheck
}  // namespace triton_rec
