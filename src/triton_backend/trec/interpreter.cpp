// The embedded interpreter: started once per server, the engine (triton_rec) imported.
#include <dlfcn.h>

#include <fstream>

#include "host.hpp"

namespace trec_host {

// The text of the pending Python exception (cleared): str(e), or its type's name.
std::string python_error() {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  std::string text = "unknown Python error";
  if (value != nullptr) {
    Ref s(PyObject_Str(value));
    const char* c = s ? PyUnicode_AsUTF8(s.p) : nullptr;
    if (c != nullptr && *c) {
      text = c;
    } else if (type != nullptr) {
      text = reinterpret_cast<PyTypeObject*>(type)->tp_name;
    }
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return text;
}

std::string g_backend_name;
std::string g_backend_dir;
PyObject* g_inprocess = nullptr;

// The interpreter of the project's environment: the launcher writes its path to
// <backend-dir>/<name>/trec_python; else $TRITON_REC_PYTHON; else python3 on PATH.
std::string python_executable() {
  std::ifstream f(g_backend_dir + "/trec_python");
  std::string line;
  if (f && std::getline(f, line) && !line.empty()) return line;
  const char* env = std::getenv("TRITON_REC_PYTHON");
  return env != nullptr && *env ? env : "python3";
}

TRITONSERVER_Error* start_python() {
  // libpython came in as this library's dependency, with local symbols; extension
  // modules (numpy, triton_rec._native) need its symbols global.
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&Py_InitializeFromConfig), &info) != 0 &&
      info.dli_fname != nullptr) {
    dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_GLOBAL);
  }
  if (!Py_IsInitialized()) {
    PyConfig config;
    PyConfig_InitPythonConfig(&config);
    config.install_signal_handlers = 0;  // SIGINT/SIGTERM stay the server's
    config.parse_argv = 0;
    const std::string exe = python_executable();
    PyStatus st = PyConfig_SetBytesString(&config, &config.program_name, exe.c_str());
    if (!PyStatus_Exception(st)) st = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(st)) {
      return error(TRITONSERVER_ERROR_INTERNAL,
                   "triton-rec native backend: cannot start Python (" + exe +
                       "): " + (st.err_msg != nullptr ? st.err_msg : "unknown error"));
    }
    PyEval_SaveThread();  // the GIL is taken per call from here on
  }
  Gil gil;
  g_inprocess = PyImport_ImportModule("triton_rec.triton.inprocess");
  if (g_inprocess == nullptr) {
    return error(TRITONSERVER_ERROR_INTERNAL,
                 "triton-rec native backend: cannot import triton_rec (is the server started "
                 "from the project's environment?): " +
                     python_error());
  }
  return nullptr;
}

}  // namespace trec_host
