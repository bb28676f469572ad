// A request answered by the hosted model.py (triton_rec.triton.inprocess), the GIL taken:
// what the native checks do not accept, and every request of a model without a plan.
#include <cstring>
#include <deque>

#include "host.hpp"

namespace trec_host {

// The Triton type of a buffer-protocol element (struct format character and size).
TRITONSERVER_DataType triton_type(const char* format, Py_ssize_t itemsize) {
  char f = format != nullptr ? format[0] : 'B';
  if (f == '<' || f == '=' || f == '@' || f == '!') f = format[1];
  switch (f) {
    case '?':
      return TRITONSERVER_TYPE_BOOL;
    case 'e':
      return TRITONSERVER_TYPE_FP16;
    case 'f':
      return TRITONSERVER_TYPE_FP32;
    case 'd':
      return TRITONSERVER_TYPE_FP64;
    case 'b':
      return TRITONSERVER_TYPE_INT8;
    case 'B':
      return TRITONSERVER_TYPE_UINT8;
    case 'h':
      return TRITONSERVER_TYPE_INT16;
    case 'H':
      return TRITONSERVER_TYPE_UINT16;
    case 'i':
    case 'l':
    case 'q':
      return itemsize == 4 ? TRITONSERVER_TYPE_INT32 : TRITONSERVER_TYPE_INT64;
    case 'I':
    case 'L':
    case 'Q':
      return itemsize == 4 ? TRITONSERVER_TYPE_UINT32 : TRITONSERVER_TYPE_UINT64;
    default:
      return TRITONSERVER_TYPE_INVALID;
  }
}

// Copies of split inputs, kept until the Python call returns (a deque: they never move).
struct InputStore {
  std::deque<std::vector<char>> copies;
};

// The request as inprocess.RawRequest: ({name: (dtype, shape, memoryview)}, {parameter:
// value}); nullptr with
// `why` set when an input cannot be read (not in CPU memory).
PyObject* raw_request(TRITONBACKEND_Request* request, InputStore* store, std::string* why) {
  Ref dict(PyDict_New());
  uint32_t count = 0;
  if (auto* e = TRITONBACKEND_RequestInputCount(request, &count)) {
    *why = TRITONSERVER_ErrorMessage(e);
    drop(e);
    return nullptr;
  }
  for (uint32_t i = 0; i < count; ++i) {
    In in;
    const char* name = nullptr;
    TRITONSERVER_Error* e = TRITONBACKEND_RequestInputByIndex(request, i, &in.input);
    if (e == nullptr) e = describe(&in, &name);
    if (e != nullptr) {
      *why = TRITONSERVER_ErrorMessage(e);
      drop(e);
      return nullptr;
    }
    const void* data = data_of(in, in.buffers == 1 ? nullptr : &store->copies.emplace_back());
    if (data == nullptr) {
      *why = std::string("input ") + name + " is not readable from CPU memory";
      return nullptr;
    }
    Ref shp(PyTuple_New(in.dims));
    for (uint32_t d = 0; d < in.dims; ++d) {
      PyTuple_SET_ITEM(shp.p, d, PyLong_FromLongLong(in.shape[d]));
    }
    // read-only: the hosted model never writes into Triton's buffers
    Ref view(PyMemoryView_FromMemory(static_cast<char*>(const_cast<void*>(data)),
                                     static_cast<Py_ssize_t>(in.bytes), PyBUF_READ));
    Ref entry(Py_BuildValue("(sOO)", TRITONSERVER_DataTypeString(in.type), shp.p, view.p));
    if (!entry || PyDict_SetItemString(dict.p, name, entry.p) != 0) {
      *why = python_error();
      return nullptr;
    }
  }
  // The request parameters, as {key: bool|int|float|str} (bytes parameters are left out).
  Ref params(PyDict_New());
  each_parameter(request, [&](const char* key, TRITONSERVER_ParameterType type, const void* v) {
    Ref value(
        type == TRITONSERVER_PARAMETER_BOOL  ? PyBool_FromLong(*static_cast<const bool*>(v))
        : type == TRITONSERVER_PARAMETER_INT ? PyLong_FromLongLong(*static_cast<const int64_t*>(v))
        : type == TRITONSERVER_PARAMETER_DOUBLE ? PyFloat_FromDouble(*static_cast<const double*>(v))
        : type == TRITONSERVER_PARAMETER_STRING
            ? PyUnicode_DecodeUTF8(
                  static_cast<const char*>(v),
                  static_cast<Py_ssize_t>(std::strlen(static_cast<const char*>(v))), "replace")
            : nullptr);
    if (value.p != nullptr) PyDict_SetItemString(params.p, key, value.p);
    return true;
  });
  PyErr_Clear();
  return Py_BuildValue("(OO)", dict.p, params.p);
}

// Fills `response` from an inprocess.RawResponse; returns the error to send (or null).
TRITONSERVER_Error* fill_response(TRITONBACKEND_Response* response, PyObject* raw) {
  PyObject* msg = PyTuple_GetItem(raw, 0);
  if (msg != Py_None) {
    const long code = PyLong_AsLong(PyTuple_GetItem(raw, 1));
    return error(static_cast<TRITONSERVER_Error_Code>(code), PyUnicode_AsUTF8(msg));
  }
  PyObject* outputs = PyTuple_GetItem(raw, 2);
  for (Py_ssize_t i = 0; i < PyList_Size(outputs); ++i) {
    PyObject* item = PyList_GetItem(outputs, i);
    const char* name = PyUnicode_AsUTF8(PyTuple_GetItem(item, 0));
    Py_buffer view;
    if (PyObject_GetBuffer(PyTuple_GetItem(item, 1), &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) !=
        0) {
      return error(TRITONSERVER_ERROR_INTERNAL,
                   "output " + std::string(name) + ": " + python_error());
    }
    std::vector<int64_t> shape(view.shape, view.shape + view.ndim);
    const TRITONSERVER_DataType type = triton_type(view.format, view.itemsize);
    void* buffer = nullptr;
    TRITONSERVER_Error* e =
        type == TRITONSERVER_TYPE_INVALID
            ? error(TRITONSERVER_ERROR_INTERNAL,
                    "output " + std::string(name) + ": unsupported type")
            : output_buffer(response, name, type, shape.data(), static_cast<uint32_t>(shape.size()),
                            static_cast<uint64_t>(view.len), &buffer);
    if (e == nullptr && view.len > 0) std::memcpy(buffer, view.buf, static_cast<size_t>(view.len));
    PyBuffer_Release(&view);
    if (e != nullptr) return e;
  }
  PyObject* params = PyTuple_GetItem(raw, 3);
  PyObject *key = nullptr, *value = nullptr;
  Py_ssize_t pos = 0;
  while (PyDict_Next(params, &pos, &key, &value)) {
    const char* k = PyUnicode_AsUTF8(key);
    if (k == nullptr) continue;
    TRITONSERVER_Error* e = nullptr;
    if (PyBool_Check(value)) {
      e = TRITONBACKEND_ResponseSetBoolParameter(response, k, value == Py_True);
    } else if (PyLong_Check(value)) {
      e = TRITONBACKEND_ResponseSetIntParameter(response, k, PyLong_AsLongLong(value));
    } else if (PyFloat_Check(value)) {
      e = TRITONBACKEND_ResponseSetDoubleParameter(response, k, PyFloat_AsDouble(value));
    } else if (PyUnicode_Check(value)) {
      e = TRITONBACKEND_ResponseSetStringParameter(response, k, PyUnicode_AsUTF8(value));
    }
    drop(e);
  }
  PyErr_Clear();
  return nullptr;
}

// Answers requests[r] for every r in `which` through the hosted model (GIL taken here);
// (*ok)[r]: whether request r succeeded.
void python_path(const InstanceState& st, TRITONBACKEND_Request** requests,
                 const std::vector<uint32_t>& which, std::vector<char>* ok) {
  std::vector<TRITONBACKEND_Response*> responses(ok->size(), nullptr);
  for (uint32_t r : which) {
    if (auto* e = TRITONBACKEND_ResponseNew(&responses[r], requests[r])) {
      drop(e);
      responses[r] = nullptr;
    }
  }
  Gil gil;
  InputStore store;
  Ref list(PyList_New(0));
  std::vector<uint32_t> slots;  // the request of each list entry
  for (uint32_t r : which) {
    if (responses[r] == nullptr) continue;
    std::string why;
    Ref raw(raw_request(requests[r], &store, &why));
    if (!raw) {
      (*ok)[r] = send(responses[r], error(TRITONSERVER_ERROR_INVALID_ARG,
                                          "model '" + st.model_name + "': " + why));
      continue;
    }
    PyList_Append(list.p, raw.p);
    slots.push_back(r);
  }
  if (slots.empty()) return;
  Ref answers(PyObject_CallMethod(st.hosted, "execute", "O", list.p));
  if (!answers || !PyList_Check(answers.p) ||
      PyList_Size(answers.p) != static_cast<Py_ssize_t>(slots.size())) {
    const std::string why = answers ? "wrong number of responses" : python_error();
    for (uint32_t r : slots) {
      (*ok)[r] =
          send(responses[r], error(TRITONSERVER_ERROR_INTERNAL,
                                   "model '" + st.model_name + "': inference failed: " + why));
    }
    return;
  }
  for (size_t j = 0; j < slots.size(); ++j) {
    const uint32_t r = slots[j];
    (*ok)[r] = send(responses[r], fill_response(responses[r], PyList_GetItem(answers.p, j)));
  }
}

}  // namespace trec_host
