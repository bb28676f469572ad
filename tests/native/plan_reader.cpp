// read_plan (src/triton_backend/trec/plan.cpp) as a C function of a shared library, which
// tests/unit/test_native_plan.py builds and loads with ctypes.PyDLL (so the GIL is held):
// it hands the reader NativePlan objects and reads back what the reader made of them, or
// why it refused them ("field: ..." for a PlanFieldError, which fails the model's load;
// "refused: ..." for a plan the native path leaves to Python).
#include <string>

#include "host.hpp"

namespace trec_host {

// What backend.cpp's interpreter.cpp gives: the pending Python exception's text (cleared).
std::string python_error() {
  PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
  PyErr_Fetch(&type, &value, &tb);
  std::string text = "unknown Python error";
  if (value != nullptr) {
    PyObject* s = PyObject_Str(value);
    const char* c = s != nullptr ? PyUnicode_AsUTF8(s) : nullptr;
    if (c != nullptr) text = c;
    Py_XDECREF(s);
  }
  PyErr_Clear();
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  return text;
}

}  // namespace trec_host

namespace {

template <class T>
std::string joined(const std::vector<T>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s;
}

// What the reader made of a plan, in the words test_native_plan.py compares.
std::string describe(const trec_host::NativePlan& p) {
  std::string s = "ok kind=";
  s += p.dense_only ? "dense" : p.hugectr ? "hugectr" : "hps";
  s += " batch=" + std::to_string(p.max_batch_size) + " output=" + p.output + " info=";
  for (size_t i = 0; i < p.info_outputs.size(); ++i) s += (i ? "," : "") + p.info_outputs[i];
  s += " device_id=" + std::to_string(p.device_id) + " maxnum=" + joined(p.maxnum) +
       " max_keys=" + std::to_string(p.max_keys) + " slots=" + joined(p.slots) + " mean=";
  for (size_t i = 0; i < p.mean.size(); ++i) s += (i ? "," : "") + std::to_string(p.mean[i]);
  s += " dense_dim=" + std::to_string(p.dense_dim) + " label_dim=" + std::to_string(p.label_dim) +
       " uint32=" + std::to_string(p.uint32_keys) + " limits=" + std::to_string(p.limit_des) + "," +
       std::to_string(p.limit_cat) + "," + std::to_string(p.limit_rows) +
       " vec_sizes=" + joined(p.vec_sizes) + " net=" + std::to_string(p.net != nullptr) +
       " gpu=" + std::to_string(p.gpu() ? p.gpu_device : -1) +
       " buckets=" + std::to_string(p.buckets.size()) +
       " emb_in=" + std::to_string(p.emb_in.size()) +
       " host_max_batch=" + std::to_string(p.host_max_batch) + " tables=";
  for (size_t i = 0; i < p.tables.size(); ++i) {
    const trec_host::NativeTable& t = p.tables[i];
    const char* where = t.device        ? (t.target.cache ? "device_cache" : "device_table")
                        : t.cache       ? "cache"
                        : t.index.slots ? "index"
                                        : "?";
    s += (i ? ";" : "") + std::to_string(t.dim) + "/" + std::to_string(t.default_value) + "/" +
         where + "/" +
         (t.misses   ? "misses"
          : t.finish ? "finish"
                     : "none");
  }
  return s;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const char* trec_read_plan(PyObject* plan) {
  static std::string out;
  try {
    std::unique_ptr<trec_host::NativePlan> p = trec_host::read_plan(plan);
    out = p ? describe(*p) : "none";
  } catch (const trec_host::PlanFieldError& e) {
    out = std::string("field: ") + e.what();
  } catch (const std::exception& e) {
    out = std::string("refused: ") + e.what();
  }
  return out.c_str();
}
