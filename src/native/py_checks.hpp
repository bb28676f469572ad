// Argument checks of the pybind11 layer (bindings.cpp, bindings_gpu.cpp): dtype,
// dimensions, C-contiguity, writability, shape; never a silent cast or copy.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <initializer_list>
#include <string>

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

}  // namespace pycheck
}  // namespace triton_rec
