// The native backend of `hps` and `hugectr` (issue 14): one library, installed by the
// launcher as <backend-dir>/hps/libtriton_hps.so and <backend-dir>/hugectr/libtriton_hugectr.so.
//
// Control plane: it embeds the interpreter of the project's environment once per server
// and hosts each model instance's TritonPythonModel (the backend's own model.py) through
// triton_rec.triton.inprocess, which plays triton_python_backend_utils in-process. So the
// engine stays the single place of the semantics (ps.json, stores, caches, tiers, refresh,
// updates, metrics, every error text), and no request crosses a process boundary.
//
// Data plane: when the hosted model hands over a native plan (a model whose tables are
// node-local: a CPU shared cache, or the mapped table without a cache), a request is
// validated and answered here without the GIL: the shared cache (shm_cache.hpp) or the
// table index (hash_index.hpp) writes the vectors straight into Triton's response buffer,
// and a cache's misses are answered by HPS's rules by the table's LocalMisses
// (local_misses.hpp: the fetch, the hit-rate rule, the background insert queue). Python
// is entered only for what is not the hot path: a request the checks here do not accept
// (Python then names what is wrong, with today's messages), the misses of a cache in
// front of a tier store or on a GPU (the plan's `finish` handler), and every request of a
// model without a plan. Each such call is counted (trec_python_calls_total).
#include <Python.h>
#include <dlfcn.h>
#include <pthread.h>
#include <strings.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend_util.hpp"
#include "blas.hpp"
#include "dense_net.hpp"
#include "drain.hpp"
#include "gpu_ops.hpp"
#include "hash_index.hpp"
#include "local_misses.hpp"
#include "request_kernels.hpp"
#include "shm_cache.hpp"
#include "triton_api.h"

namespace {

namespace tr = triton_rec;
using trec_backend::drop;
using trec_backend::now_ns;
using trec_backend::read_cpu;

// -- small helpers ----------------------------------------------------------------------

TRITONSERVER_Error* error(TRITONSERVER_Error_Code code, const std::string& msg) {
  return TRITONSERVER_ErrorNew(code, msg.c_str());
}

// Holds the GIL for a scope.
class Gil {
 public:
  Gil() : state_(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(state_); }
  Gil(const Gil&) = delete;
  Gil& operator=(const Gil&) = delete;

 private:
  PyGILState_STATE state_;
};

// Owns one reference.
struct Ref {
  PyObject* p = nullptr;
  explicit Ref(PyObject* o = nullptr) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  explicit operator bool() const { return p != nullptr; }
};

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

const char* dtype_name(TRITONSERVER_DataType t) {
  switch (t) {
    case TRITONSERVER_TYPE_BOOL:
      return "BOOL";
    case TRITONSERVER_TYPE_UINT8:
      return "UINT8";
    case TRITONSERVER_TYPE_UINT16:
      return "UINT16";
    case TRITONSERVER_TYPE_UINT32:
      return "UINT32";
    case TRITONSERVER_TYPE_UINT64:
      return "UINT64";
    case TRITONSERVER_TYPE_INT8:
      return "INT8";
    case TRITONSERVER_TYPE_INT16:
      return "INT16";
    case TRITONSERVER_TYPE_INT32:
      return "INT32";
    case TRITONSERVER_TYPE_INT64:
      return "INT64";
    case TRITONSERVER_TYPE_FP16:
      return "FP16";
    case TRITONSERVER_TYPE_FP32:
      return "FP32";
    case TRITONSERVER_TYPE_FP64:
      return "FP64";
    case TRITONSERVER_TYPE_BYTES:
      return "BYTES";
    case TRITONSERVER_TYPE_BF16:
      return "BF16";
    default:
      return "INVALID";
  }
}

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

// -- the process: one interpreter, one inprocess module ---------------------------------

std::string g_backend_name;  // "hps", "hugectr": which model.py this library hosts
std::string g_backend_dir;   // <backend-dir>/<name>
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

// -- the native plan of an hps instance -------------------------------------------------

using tr::TableStat;

// A request's keys answered with the default value, by cause (tr::DefaultCause, the
// columns LocalMisses adds to), sent as tr::kDefaultInfo.
struct Defaults {
  int64_t by_cause[tr::kNumDefaultCauses] = {0, 0};
  int64_t not_found() const { return by_cause[tr::kCauseNotFound]; }
  int64_t async() const { return by_cause[tr::kCauseAsync]; }
};
using tr::kDefaultInfo;
using tr::kExactParameter;

struct NativeTable {
  int64_t dim = 0;
  float default_value = 0;
  int64_t* stats = nullptr;
  std::optional<tr::ShmCache> cache;  // the shared cache, when the table has one
  // a cache's misses: in C++ (a node-local table), else the engine's handler in Python
  // (CachedTable.native_finish: a tier store, a device cache), borrowed from the plan
  const tr::LocalMisses* misses = nullptr;
  PyObject* finish = nullptr;
  tr::IndexView index{nullptr, 0};
  tr::TableView vectors{nullptr, 0, {}};
  // KIND_GPU: the device cache (misses by the engine's rules) or a whole table on the
  // device (static, uvm)
  bool device = false;
  tr::gpu::LookupTarget target{};

  void count(TableStat s, int64_t v) const { tr::count(stats, s, v); }
};

struct NativePlan {
  Ref source;  // the plan's dict: what `finish` handlers and arrays belong to
  // the interface: hps (KEYS/NUMKEYS), hugectr (DES/CATCOLUMN/ROWINDEX), or dense
  // (DES/EMBEDDINGS/ROWINDEX: the dense step of an ensemble; `hugectr` set too, no tables)
  bool hugectr = false, dense_only = false;
  bool parameters = true;  // the response parameters of hps and hugectr (NumSample, ...)
  std::vector<NativeTable> tables;
  int64_t max_batch_size = 0;
  std::string output;
  std::vector<std::string> info_outputs;
  int32_t device_id = 0;
  // hps
  std::vector<int64_t> maxnum;
  int64_t max_keys = 0;  // KEYS elements of the largest valid request
  // hugectr
  std::vector<int64_t> slots;
  std::vector<bool> mean;
  int64_t total_slots = 0, dense_dim = 0, label_dim = 1;
  bool uint32_keys = false;
  int64_t limit_des = 0, limit_cat = 0, limit_rows = 0;  // elements of the largest valid request
  std::vector<int64_t> vec_sizes;  // dense: the width of each table's vectors in EMBEDDINGS
  std::unique_ptr<tr::DenseNet> net;
  Ref program;  // the int64 program array the net was decoded from (kept alive)
  // KIND_GPU: the kernels and this instance's stream with its staging; a hugectr model's
  // dense network as CUDA graphs (DenseGraphs.native_plan): inputs, and per batch bucket
  // (ascending) its size, graph and output
  std::shared_ptr<tr::gpu::Kernels> kernels;
  std::unique_ptr<tr::gpu::Lane> lane;
  struct Bucket {
    int64_t batch;
    tr::cuda::CUgraphExec graph;
    tr::cuda::CUdeviceptr out;
  };
  std::vector<Bucket> buckets;
  tr::cuda::CUdeviceptr dense_in = 0;
  std::vector<tr::cuda::CUdeviceptr> emb_in;
  int64_t host_max_batch = 0;  // requests of at most this many samples: `net` on the host
  bool gpu() const { return kernels != nullptr; }
};

// One field of a plan (src: triton_rec/serving/native_plan.py): an attribute of a
// NativePlan or TablePlan, or a key of the dicts inside them (the GPU entries); nullptr
// when absent or None. Borrowed: the plan object holds it for as long as the plan lives.
PyObject* field(PyObject* o, const char* name) {
  PyObject* v = nullptr;
  if (PyDict_Check(o)) {
    v = PyDict_GetItemString(o, name);
  } else {
    v = PyObject_GetAttrString(o, name);
    if (v == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    Py_DECREF(v);  // an instance attribute: the object keeps its own reference
  }
  return v == Py_None ? nullptr : v;
}

int64_t as_int(PyObject* o) { return o != nullptr ? PyLong_AsLongLong(o) : -1; }

uintptr_t as_address(PyObject* o) {
  return o != nullptr ? static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(o)) : 0;
}

// The "gpu" entry of a plan: the device and the kernels' module (bytes); this instance's
// kernels and lane.
void read_gpu(PyObject* gpu, NativePlan* plan) {
  const int device = static_cast<int>(as_int(field(gpu, "device")));
  PyObject* image = field(gpu, "image");
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (image == nullptr || PyBytes_AsStringAndSize(image, &data, &size) != 0) {
    PyErr_Clear();
    throw std::runtime_error("native plan: the GPU entry has no kernel image");
  }
  auto dev = std::make_shared<tr::cuda::Device>(device);
  plan->kernels = std::make_shared<tr::gpu::Kernels>(dev, std::string(data, size));
  plan->lane = std::make_unique<tr::gpu::Lane>(plan->kernels);
}

// A table's "device_cache" (ArrayEmbeddingCache.native_plan) or "device_table"
// (DeviceTableCache.native_plan) entry.
void read_device_table(PyObject* t, tr::Precision precision, NativeTable* nt) {
  nt->device = true;
  if (PyObject* c = field(t, "device_cache")) {
    PyObject* arrays = field(c, "arrays");
    const tr::gpu::StateAddresses a =
        tr::gpu::state_addresses([&](const char* k) { return as_address(field(arrays, k)); });
    PyErr_Clear();  // no sketch: fine
    auto num = [&](const char* k) { return as_int(field(c, k)); };
    nt->target.cache = true;
    nt->target.view = tr::gpu::make_view(a, num("num_sets"), num("ways"), num("dim"),
                                         num("precision"), num("policy"), num("sketch_width"));
    if (nt->target.view.dim != nt->dim ||
        nt->target.view.precision != static_cast<int64_t>(precision)) {
      throw std::runtime_error("native plan: the device cache's vec_size or precision differs");
    }
    return;
  }
  PyObject* d = field(t, "device_table");
  if (d == nullptr) throw std::runtime_error("native plan: a GPU table has no device entry");
  nt->target.cache = false;
  tr::gpu::DeviceTable& tb = nt->target.table;
  tb.slots = reinterpret_cast<const int64_t*>(as_address(field(d, "slots")));
  tb.capacity = static_cast<uint64_t>(as_int(field(d, "capacity")));
  tb.vectors = reinterpret_cast<const uint8_t*>(as_address(field(d, "vectors")));
  tb.rows = as_int(field(d, "rows"));
  tb.precision = static_cast<int64_t>(precision);
  tb.dim = nt->dim;
  tb.default_value = nt->default_value;
  if (tb.slots == nullptr || tb.vectors == nullptr || tb.capacity < 16 ||
      (tb.capacity & (tb.capacity - 1)) != 0) {
    throw std::runtime_error("native plan: bad device table");
  }
}

// A hugectr model's "dense_gpu" entry (DenseGraphs.native_plan).
void read_dense_gpu(PyObject* g, NativePlan* plan) {
  plan->dense_in = as_address(field(g, "dense_in"));
  plan->host_max_batch = std::max<int64_t>(0, as_int(field(g, "host_max_batch")));
  PyObject* emb = field(g, "emb_in");
  for (Py_ssize_t i = 0; emb != nullptr && i < PyList_Size(emb); ++i) {
    plan->emb_in.push_back(as_address(PyList_GetItem(emb, i)));
  }
  PyObject* buckets = field(g, "buckets");
  for (Py_ssize_t i = 0; buckets != nullptr && i < PyList_Size(buckets); ++i) {
    PyObject* b = PyList_GetItem(buckets, i);
    plan->buckets.push_back(
        {as_int(PyTuple_GetItem(b, 0)),
         reinterpret_cast<tr::cuda::CUgraphExec>(as_address(PyTuple_GetItem(b, 1))),
         as_address(PyTuple_GetItem(b, 2))});
  }
  if (PyErr_Occurred()) throw std::runtime_error(python_error());
  if (plan->dense_in == 0 || plan->emb_in.size() != plan->slots.size() || plan->buckets.empty() ||
      plan->buckets.back().batch < plan->max_batch_size) {
    throw std::runtime_error("native plan: bad GPU dense network");
  }
}

// (address, size) tuple -> its two integers
bool pair(PyObject* t, uintptr_t* a, int64_t* b) {
  if (t == nullptr || !PyTuple_Check(t) || PyTuple_Size(t) != 2) return false;
  *a = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(PyTuple_GetItem(t, 0)));
  *b = PyLong_AsLongLong(PyTuple_GetItem(t, 1));
  return !PyErr_Occurred();
}

// Reads the dict of HostedModel.native_plan() (GIL held); nullptr if None. Throws a
// message on a malformed plan (a bug on the Python side).
std::unique_ptr<NativePlan> read_plan(PyObject* d) {
  if (d == Py_None) return nullptr;
  auto plan = std::make_unique<NativePlan>();
  Py_INCREF(d);
  plan->source.p = d;
  auto get = [&](const char* k) {
    PyObject* v = field(d, k);
    if (v == nullptr) throw std::runtime_error(std::string("native plan has no '") + k + "'");
    return v;
  };
  auto ints = [&](const char* k) {
    std::vector<int64_t> v;
    PyObject* list = get(k);
    for (Py_ssize_t i = 0; i < PyList_Size(list); ++i) v.push_back(as_int(PyList_GetItem(list, i)));
    return v;
  };
  const std::string kind = PyUnicode_AsUTF8(get("kind"));
  plan->dense_only = kind == "dense";
  plan->hugectr = kind == "hugectr" || plan->dense_only;
  plan->parameters = !plan->dense_only;
  plan->max_batch_size = as_int(get("max_batch_size"));
  plan->device_id = static_cast<int32_t>(as_int(get("device_id")));
  plan->output = PyUnicode_AsUTF8(get("output"));
  PyObject* gpu = field(d, "gpu");
  if (gpu != nullptr && gpu != Py_None) read_gpu(gpu, plan.get());
  PyObject* info = get("info_outputs");
  for (Py_ssize_t i = 0; i < PyList_Size(info); ++i) {
    plan->info_outputs.emplace_back(PyUnicode_AsUTF8(PyList_GetItem(info, i)));
  }
  if (plan->hugectr) {
    plan->slots = ints("slots");
    for (int64_t s : plan->slots) plan->total_slots += s;
    PyObject* mean = get("mean");
    for (Py_ssize_t i = 0; i < PyList_Size(mean); ++i) {
      plan->mean.push_back(PyList_GetItem(mean, i) == Py_True);
    }
    plan->dense_dim = as_int(get("dense_dim"));
    plan->label_dim = as_int(get("label_dim"));
    if (plan->dense_only) {
      plan->vec_sizes = ints("vec_sizes");
    } else {
      plan->uint32_keys = std::string(PyUnicode_AsUTF8(get("key_type"))) == "UINT32";
    }
    PyObject* limits = get("limits");
    plan->limit_des = as_int(field(limits, "DES"));
    plan->limit_cat = as_int(field(limits, plan->dense_only ? "EMBEDDINGS" : "CATCOLUMN"));
    plan->limit_rows = as_int(field(limits, "ROWINDEX"));
    PyObject* dense_gpu = field(d, "dense_gpu");
    if (dense_gpu != nullptr && dense_gpu != Py_None) {
      if (!plan->gpu()) throw std::runtime_error("native plan: a GPU network without kernels");
      read_dense_gpu(dense_gpu, plan.get());
    }
  }
  if (plan->hugectr && plan->gpu() && plan->buckets.empty()) {
    throw std::runtime_error("native plan: GPU tables need the network on the GPU too");
  }
  PyObject* program_obj = field(d, "program");
  const bool host_dense =
      plan->host_max_batch > 0 && program_obj != nullptr && program_obj != Py_None;
  if (plan->hugectr && (plan->buckets.empty() || host_dense)) {
    PyObject* program = get("program");
    Py_buffer view;
    if (PyObject_GetBuffer(program, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
      throw std::runtime_error("native plan: the dense program is not a buffer");
    }
    try {
      if (view.itemsize != 8) throw std::invalid_argument("dense program is not int64");
      plan->net = std::make_unique<tr::DenseNet>(static_cast<const int64_t*>(view.buf),
                                                 static_cast<size_t>(view.len / 8));
    } catch (const std::exception& x) {
      PyBuffer_Release(&view);
      throw std::runtime_error(std::string("native plan: ") + x.what());
    }
    PyBuffer_Release(&view);
    Py_INCREF(program);
    plan->program.p = program;
    if (plan->net->dense_dim() != plan->dense_dim || plan->net->label_dim() != plan->label_dim ||
        plan->net->num_tables() != plan->slots.size()) {
      throw std::runtime_error("native plan: the dense program disagrees with the model");
    }
  } else if (!plan->hugectr) {
    plan->maxnum = ints("maxnum");
    int64_t per_sample = 0;
    for (int64_t m : plan->maxnum) per_sample += m;
    plan->max_keys = plan->max_batch_size * per_sample;
  }
  PyObject* tables = get("tables");
  for (Py_ssize_t i = 0; i < PyList_Size(tables); ++i) {
    PyObject* t = PyList_GetItem(tables, i);
    NativeTable nt;
    nt.dim = as_int(field(t, "vec_size"));
    const tr::Precision precision = tr::precision_of(as_int(field(t, "precision")));
    nt.default_value = static_cast<float>(PyFloat_AsDouble(field(t, "default_value")));
    nt.stats = reinterpret_cast<int64_t*>(
        static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(field(t, "stats"))));
    uintptr_t addr = 0;
    int64_t n = 0;
    if (field(t, "device_cache") != nullptr || field(t, "device_table") != nullptr) {
      read_device_table(t, precision, &nt);
    } else if (PyObject* c = field(t, "cache")) {
      if (!pair(c, &addr, &n)) throw std::runtime_error("native plan: bad cache address");
      nt.cache = tr::ShmCache::attach(reinterpret_cast<void*>(addr), static_cast<size_t>(n));
      if (static_cast<int64_t>(nt.cache->vec_size()) != nt.dim ||
          nt.cache->format().precision != precision) {
        throw std::runtime_error("native plan: the cache's vec_size or precision differs");
      }
    } else {
      if (!pair(field(t, "index"), &addr, &n)) {
        throw std::runtime_error("native plan: bad index address");
      }
      nt.index = tr::IndexView{reinterpret_cast<const int64_t*>(addr), static_cast<uint64_t>(n)};
      if (!pair(field(t, "vectors"), &addr, &n)) {
        throw std::runtime_error("native plan: bad vectors address");
      }
      nt.vectors = tr::TableView{reinterpret_cast<const void*>(addr), n,
                                 tr::RowFormat(precision, static_cast<size_t>(nt.dim))};
    }
    if (nt.cache || (nt.device && nt.target.cache)) {  // a cache: its miss handler
      PyObject* misses = field(t, "misses");
      nt.finish = field(t, "finish");
      if (misses != nullptr && nt.cache) {
        nt.misses = reinterpret_cast<const tr::LocalMisses*>(as_address(misses));
        if (nt.misses == nullptr || nt.misses->dim() != nt.dim) {
          throw std::runtime_error("native plan: bad miss handler");
        }
      } else if (nt.finish == nullptr || !PyCallable_Check(nt.finish)) {
        throw std::runtime_error("native plan: a cache without a miss handler");
      }
    }
    if (PyErr_Occurred()) throw std::runtime_error(python_error());
    plan->tables.push_back(nt);
  }
  for (const NativeTable& nt : plan->tables) {
    if (nt.device != plan->gpu()) {
      throw std::runtime_error("native plan: GPU and host tables mixed in one model");
    }
  }
  const size_t per_table = plan->hugectr ? plan->slots.size() : plan->maxnum.size();
  const size_t listed = plan->dense_only ? plan->vec_sizes.size() : plan->tables.size();
  if (listed != per_table || (plan->hugectr && plan->mean.size() != per_table) ||
      (plan->dense_only && (!plan->tables.empty() || plan->gpu() || !plan->net))) {
    throw std::runtime_error("native plan: the per-table lists differ in length");
  }
  return plan;
}

// -- model and instance state -----------------------------------------------------------

struct ModelState {
  std::string name, config_json, repository;
  uint64_t version = 0;
};

struct InstanceState {
  std::string model_name;
  PyObject* hosted = nullptr;  // inprocess.HostedModel
  std::unique_ptr<NativePlan> plan;
};

// -- the Python path: any request, through the hosted model's execute ----------------------

// One input of a request and its properties.
struct In {
  TRITONBACKEND_Input* input = nullptr;
  TRITONSERVER_DataType type = TRITONSERVER_TYPE_INVALID;
  const int64_t* shape = nullptr;
  uint32_t dims = 0, buffers = 0;
  uint64_t bytes = 0;
};

// Fills the properties of `in->input` (and its name); Triton's error if unreadable.
TRITONSERVER_Error* describe(In* in, const char** name) {
  return TRITONBACKEND_InputProperties(in->input, name, &in->type, &in->shape, &in->dims,
                                       &in->bytes, &in->buffers);
}

// The input `name` and its properties; false if it is absent or unreadable.
bool find(TRITONBACKEND_Request* request, const char* name, In* in) {
  if (auto* e = TRITONBACKEND_RequestInput(request, name, &in->input)) return drop(e), false;
  const char* n = nullptr;
  if (auto* e = describe(in, &n)) return drop(e), false;
  return true;
}

// The data of `in`: Triton's own buffer when it is one piece in CPU memory, else a copy
// in `copy`; nullptr if it cannot be read.
const void* data_of(const In& in, std::vector<char>* copy) {
  static const int64_t empty = 0;
  if (in.bytes == 0) return &empty;
  if (in.buffers == 1) {
    const void* b = nullptr;
    uint64_t size = 0;
    TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
    int64_t mt_id = 0;
    if (auto* e = TRITONBACKEND_InputBuffer(in.input, 0, &b, &size, &mt, &mt_id)) {
      return drop(e), nullptr;
    }
    return mt == TRITONSERVER_MEMORY_GPU || size != in.bytes ? nullptr : b;
  }
  copy->resize(in.bytes);
  return read_cpu(in.input, in.buffers, in.bytes, copy->data()) ? copy->data() : nullptr;
}

// Copies of split inputs, kept until the Python call returns (a deque: they never move).
struct InputStore {
  std::deque<std::vector<char>> copies;
};

// Calls fn(key, type, value) for each parameter of `request` until fn returns false;
// false if the parameters cannot be read.
template <typename Fn>
bool each_parameter(TRITONBACKEND_Request* request, Fn&& fn) {
  uint32_t count = 0;
  if (auto* e = TRITONBACKEND_RequestParameterCount(request, &count)) {
    drop(e);
    return false;
  }
  for (uint32_t i = 0; i < count; ++i) {
    const char* key = nullptr;
    TRITONSERVER_ParameterType type;
    const void* value = nullptr;
    if (auto* e = TRITONBACKEND_RequestParameter(request, i, &key, &type, &value)) {
      drop(e);
      return false;
    }
    if (key != nullptr && !fn(key, type, value)) break;
  }
  return true;
}

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
    Ref entry(Py_BuildValue("(sOO)", dtype_name(in.type), shp.p, view.p));
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
    TRITONBACKEND_Output* output = nullptr;
    void* buffer = nullptr;
    TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
    int64_t mt_id = 0;
    TRITONSERVER_Error* e =
        type == TRITONSERVER_TYPE_INVALID
            ? error(TRITONSERVER_ERROR_INTERNAL,
                    "output " + std::string(name) + ": unsupported type")
            : TRITONBACKEND_ResponseOutput(response, &output, name, type, shape.data(),
                                           static_cast<uint32_t>(shape.size()));
    if (e == nullptr) {
      e = TRITONBACKEND_OutputBuffer(output, &buffer, static_cast<uint64_t>(view.len), &mt, &mt_id);
    }
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

// Sends `err` (owned) or the filled response; false if the request failed.
bool send(TRITONBACKEND_Response* response, TRITONSERVER_Error* err) {
  const bool ok = err == nullptr;
  drop(TRITONBACKEND_ResponseSend(response, TRITONSERVER_RESPONSE_COMPLETE_FINAL, err));
  drop(err);
  return ok;
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

// -- the native path: an hps request answered without Python --------------------------

struct Scratch {  // per thread: reused buffers of the hot path
  std::vector<int64_t> keys, key_starts, ptrs;
  std::vector<int32_t> counts;
  std::vector<uint8_t> hit;
  std::vector<char> copy[3];  // split inputs, made contiguous
  std::vector<float> vectors;
  std::vector<std::vector<float>> combined;
  std::vector<const float*> embeddings;  // the combined blocks, as the network takes them
  tr::DenseNet::Workspace dense;
};
thread_local Scratch t_scratch;

// A hosted call on the native path failed: the request's error (as run_requests words it).
struct Failed {
  std::string why;
};

// The misses of table `t`'s cache query (hit[i] == 0; `hits` hit, in query_ns): by the
// table's handler, which answers them into `out` by HPS's rules and adds the keys it
// answered with the default value to *d. In C++ for a node-local table (LocalMisses, no
// GIL); else the engine's handler in Python (CachedTable.native_finish).
void finish_query(const InstanceState& st, size_t t, const int64_t* keys, int64_t n, float* out,
                  uint8_t* hit, int64_t hits, uint64_t query_ns, bool exact, Defaults* d) {
  const NativeTable& nt = st.plan->tables[t];
  if (nt.misses != nullptr) {
    const uint8_t want = exact ? 1 : 0;
    nt.misses->finish(keys, n, out, hit, hits, query_ns, nullptr, 0, &want, d->by_cause);
    return;
  }
  Gil gil;
  Ref k(PyMemoryView_FromMemory(reinterpret_cast<char*>(const_cast<int64_t*>(keys)), n * 8,
                                PyBUF_READ));
  Ref o(PyMemoryView_FromMemory(reinterpret_cast<char*>(out), n * nt.dim * 4, PyBUF_WRITE));
  Ref h(PyMemoryView_FromMemory(reinterpret_cast<char*>(hit), n, PyBUF_WRITE));
  Ref r(PyObject_CallFunction(nt.finish, "OOOLKO", k.p, o.p, h.p, static_cast<long long>(hits),
                              static_cast<unsigned long long>(query_ns),
                              exact ? Py_True : Py_False));
  long long not_found = 0, deferred = 0;
  if (!r || !PyArg_ParseTuple(r.p, "LL", &not_found, &deferred)) throw Failed{python_error()};
  d->by_cause[tr::kCauseNotFound] += not_found;
  d->by_cause[tr::kCauseAsync] += deferred;
}

// The vectors of keys[0..n) of table t into out [n, dim]: the shared cache (its misses by
// the table's handler) or the mapped table. What CachedTable.lookup does.
void lookup_table(const InstanceState& st, size_t t, const int64_t* keys, int64_t n, float* out,
                  Scratch* s, bool exact, Defaults* d) {
  if (n == 0) return;
  const NativeTable& nt = st.plan->tables[t];
  if (nt.cache) {
    s->hit.resize(static_cast<size_t>(n));
    const uint64_t t0 = now_ns();
    const int64_t hits = nt.cache->query(keys, static_cast<size_t>(n), out, s->hit.data());
    const uint64_t q = now_ns() - t0;
    if (hits == n) {
      nt.count(tr::kLookups, n);
      nt.count(tr::kHits, n);
      nt.count(tr::kCacheNs, static_cast<int64_t>(q));
    } else {
      finish_query(st, t, keys, n, out, s->hit.data(), hits, q, exact, d);
    }
    return;
  }
  const uint64_t t0 = now_ns();
  const int64_t absent = tr::lookup(nt.index, nt.vectors, keys, static_cast<size_t>(n), out,
                                    nt.default_value, nullptr);
  d->by_cause[tr::kCauseNotFound] += absent;
  if (absent) nt.count(tr::kNotFound, absent);
  nt.count(tr::kLookups, n);
  nt.count(tr::kMisses, n);
  nt.count(tr::kSyncFetched, n);
  nt.count(tr::kStoreNs, static_cast<int64_t>(now_ns() - t0));
}

// -- the GPU path (KIND_GPU): the instance's stream, keys in, one kernel per table --------

// After table t's lookup on the GPU (its statuses and answers in host memory): the table's
// statistics, and a cache's misses answered by the engine's rules (finish_query writes
// their answers into `out`).
void settle_gpu_table(const InstanceState& st, size_t t, const int64_t* keys, int64_t n, float* out,
                      uint8_t* status, uint64_t ns, bool exact, Defaults* d) {
  const NativeTable& nt = st.plan->tables[t];
  int64_t hits = 0, corrupt = 0;
  for (int64_t i = 0; i < n; ++i) {
    hits += status[i] == tr::xcache::kHit;
    corrupt += status[i] == tr::xcache::kCorrupt;
  }
  if (!nt.target.cache) {  // static / uvm: the whole table; what it lacks no tier holds
    if (corrupt != 0) throw std::runtime_error("corrupt device table: a slot names no row");
    const int64_t absent = n - hits;
    d->by_cause[tr::kCauseNotFound] += absent;
    if (absent) nt.count(tr::kNotFound, absent);
    nt.count(tr::kLookups, n);
    nt.count(tr::kHits, hits);
    nt.count(tr::kMisses, absent);
    nt.count(tr::kCacheNs, static_cast<int64_t>(ns));
    return;
  }
  if (hits == n) {
    nt.count(tr::kLookups, n);
    nt.count(tr::kHits, n);
    nt.count(tr::kCacheNs, static_cast<int64_t>(ns));
    return;
  }
  for (int64_t i = 0; i < n; ++i) status[i] = status[i] == tr::xcache::kHit;  // torn: a miss
  finish_query(st, t, keys, n, out, status, hits, ns, exact, d);
}

// An hps request on the GPU: keys[0..n_keys) of every table -> answer (floats), through
// pinned staging: one copy in, one kernel per table, one copy out, one synchronization.
void hps_gpu(const InstanceState& st, const int64_t* keys, int64_t n_keys, const int32_t* counts,
             int64_t floats, float* answer, bool exact, Defaults* d) {
  const NativePlan& plan = *st.plan;
  tr::gpu::Lane& lane = *plan.lane;
  lane.enter();
  const size_t kb = static_cast<size_t>(n_keys) * 8, fb = static_cast<size_t>(floats) * 4;
  const tr::gpu::Lane::Parts parts{kb, fb, static_cast<size_t>(n_keys)};
  char* h = lane.host(parts);
  const tr::cuda::CUdeviceptr dv = lane.device(parts);
  const size_t o1 = parts.offsets[1], o2 = parts.offsets[2];
  const uint64_t t0 = now_ns();
  std::memcpy(h, keys, kb);
  lane.to_device(dv, h, kb);
  int64_t kpos = 0, fpos = 0;
  for (size_t t = 0; t < plan.tables.size(); ++t) {
    tr::gpu::launch_lookup(lane, plan.tables[t].target, dv + kpos * 8, counts[t],
                           dv + o1 + fpos * 4, dv + o2 + kpos);
    kpos += counts[t];
    fpos += counts[t] * plan.tables[t].dim;
  }
  lane.to_host(h + o1, dv + o1, fb);
  lane.to_host(h + o2, dv + o2, static_cast<size_t>(n_keys));
  lane.sync();
  const uint64_t ns = now_ns() - t0;
  auto* out = reinterpret_cast<float*>(h + o1);
  auto* status = reinterpret_cast<uint8_t*>(h + o2);
  kpos = fpos = 0;
  for (size_t t = 0; t < plan.tables.size(); ++t) {
    settle_gpu_table(st, t, keys + kpos, counts[t], out + fpos, status + kpos, ns, exact, d);
    kpos += counts[t];
    fpos += counts[t] * plan.tables[t].dim;
  }
  std::memcpy(answer, out, fb);
}

// Where each table's vectors go when the keys of a regrouped hugectr request (s.key_starts)
// are looked up: offsets in floats, one past the last table's end.
std::vector<int64_t> vector_offsets(const NativePlan& plan, const Scratch& s) {
  std::vector<int64_t> voff(plan.tables.size() + 1, 0);
  for (size_t t = 0; t < plan.tables.size(); ++t) {
    voff[t + 1] = voff[t] + (s.key_starts[t + 1] - s.key_starts[t]) * plan.tables[t].dim;
  }
  return voff;
}

// Launches every table's lookup of a regrouped hugectr request: its keys (from `keys`, all
// tables' as in s.keys) into vectors + voff[t] floats and status (one per key).
void launch_hugectr_lookups(const NativePlan& plan, tr::gpu::Lane& lane, const Scratch& s,
                            const std::vector<int64_t>& voff, tr::cuda::CUdeviceptr keys,
                            tr::cuda::CUdeviceptr vectors, tr::cuda::CUdeviceptr status) {
  for (size_t t = 0; t < plan.tables.size(); ++t) {
    const int64_t first = s.key_starts[t], count = s.key_starts[t + 1] - first;
    tr::gpu::launch_lookup(lane, plan.tables[t].target, keys + first * 8, count,
                           vectors + voff[t] * 4, status + first);
  }
}

// A hugectr request of few samples (at most host_max_batch) on a GPU instance: the lookups
// on the GPU (the cache), then the slots combined and the network run on the host, where
// such a batch is fastest (DenseGraphs.calibrate).
void hugectr_gpu_host_dense(const InstanceState& st, Scratch& s, int64_t n, int64_t n_cat,
                            const float* des, float* answer, bool exact, Defaults* d) {
  const NativePlan& plan = *st.plan;
  tr::gpu::Lane& lane = *plan.lane;
  lane.enter();
  const size_t tables = plan.tables.size();
  const std::vector<int64_t> voff = vector_offsets(plan, s);
  const size_t kb = static_cast<size_t>(n_cat) * 8, vb = static_cast<size_t>(voff[tables]) * 4;
  const tr::gpu::Lane::Parts parts{kb, vb, static_cast<size_t>(n_cat)};
  char* h = lane.host(parts);
  const tr::cuda::CUdeviceptr dv = lane.device(parts);
  const auto& o = parts.offsets;
  const uint64_t t0 = now_ns();
  std::memcpy(h, s.keys.data(), kb);
  lane.to_device(dv, h, kb);
  launch_hugectr_lookups(plan, lane, s, voff, dv, dv + o[1], dv + o[2]);
  lane.to_host(h + o[1], dv + o[1], vb);
  lane.to_host(h + o[2], dv + o[2], static_cast<size_t>(n_cat));
  lane.sync();
  const uint64_t ns = now_ns() - t0;
  auto* vectors = reinterpret_cast<float*>(h + o[1]);
  auto* status = reinterpret_cast<uint8_t*>(h + o[2]);
  s.combined.resize(tables);
  s.embeddings.clear();
  int64_t block = 0;
  for (size_t t = 0; t < tables; ++t) {
    const int64_t first = s.key_starts[t], count = s.key_starts[t + 1] - first;
    const int64_t dim = plan.tables[t].dim, segments = n * plan.slots[t];
    settle_gpu_table(st, t, s.keys.data() + first, count, vectors + voff[t], status + first, ns,
                     exact, d);
    auto& combined = s.combined[t];
    combined.resize(static_cast<size_t>(segments * dim));
    if (!tr::combine_segments(vectors + voff[t], count, dim, s.ptrs.data() + block, segments,
                              plan.mean[t], combined.data())) {
      throw std::runtime_error("row pointers outside the table's keys");
    }
    s.embeddings.push_back(combined.data());
    block += segments + 1;
  }
  plan.net->predict(n, des, s.embeddings, answer, &s.dense, tr::find_sgemm());
}

// A hugectr request on the GPU (keys regrouped by table in s.keys, row pointers in s.ptrs,
// rows rows of them): the lookups, each slot combined into the network's input, the
// network's graph for the smallest bucket that holds n samples, one synchronization.
// When a cache missed, its vectors come to the host for the engine's rules and go back,
// and the slots and the network run again.
void hugectr_gpu(const InstanceState& st, const Scratch& s, int64_t n, int64_t n_cat, int64_t rows,
                 const float* des, float* answer, bool exact, Defaults* d) {
  const NativePlan& plan = *st.plan;
  tr::gpu::Lane& lane = *plan.lane;
  lane.enter();
  const size_t tables = plan.tables.size();
  const std::vector<int64_t> voff = vector_offsets(plan, s);
  const size_t kb = static_cast<size_t>(n_cat) * 8, pb = static_cast<size_t>(rows) * 8;
  const size_t db = static_cast<size_t>(n * plan.dense_dim) * 4;
  const size_t vb = static_cast<size_t>(voff[tables]) * 4,
               ob = static_cast<size_t>(n * plan.label_dim) * 4;
  const tr::gpu::Lane::Parts parts{kb, pb, db, vb, static_cast<size_t>(n_cat), ob};
  char* h = lane.host(parts);
  const tr::cuda::CUdeviceptr dv = lane.device(parts);
  const auto& o = parts.offsets;
  const uint64_t t0 = now_ns();
  std::memcpy(h, s.keys.data(), kb);
  std::memcpy(h + o[1], s.ptrs.data(), pb);
  std::memcpy(h + o[2], des, db);
  lane.to_device(dv, h, o[2]);  // keys and row pointers
  lane.to_device(plan.dense_in, h + o[2], db);
  launch_hugectr_lookups(plan, lane, s, voff, dv, dv + o[3], dv + o[4]);
  const auto& bucket = *std::find_if(plan.buckets.begin(), plan.buckets.end(),
                                     [&](const auto& b) { return b.batch >= n; });
  auto dense = [&] {
    int64_t block = 0;
    for (size_t t = 0; t < tables; ++t) {
      const int64_t segments = n * plan.slots[t];
      tr::gpu::launch_combine(lane, dv + o[3] + voff[t] * 4, dv + o[1] + block * 8, segments,
                              plan.tables[t].dim, plan.mean[t], plan.emb_in[t]);
      block += segments + 1;
    }
    tr::gpu::launch_graph(lane, bucket.graph);
    lane.to_host(h + o[5], bucket.out, ob);
  };
  dense();
  lane.to_host(h + o[4], dv + o[4], static_cast<size_t>(n_cat));
  lane.sync();
  const uint64_t ns = now_ns() - t0;
  auto* status = reinterpret_cast<uint8_t*>(h + o[4]);
  auto* vectors = reinterpret_cast<float*>(h + o[3]);
  std::vector<char> missed(tables, 0);
  bool any = false;
  for (size_t t = 0; t < tables; ++t) {  // a cache that missed: its vectors to the host
    const uint8_t* first = status + s.key_starts[t];
    const uint8_t* last = status + s.key_starts[t + 1];
    if (!plan.tables[t].target.cache ||
        std::all_of(first, last, [](uint8_t v) { return v == tr::xcache::kHit; })) {
      continue;
    }
    missed[t] = 1;
    any = true;
    lane.to_host(h + o[3] + voff[t] * 4, dv + o[3] + voff[t] * 4,
                 static_cast<size_t>(voff[t + 1] - voff[t]) * 4);
  }
  if (any) lane.sync();
  for (size_t t = 0; t < tables; ++t) {
    const int64_t first = s.key_starts[t], count = s.key_starts[t + 1] - first;
    settle_gpu_table(st, t, s.keys.data() + first, count, vectors + voff[t], status + first, ns,
                     exact, d);
    if (missed[t]) {
      lane.to_device(dv + o[3] + voff[t] * 4, h + o[3] + voff[t] * 4,
                     static_cast<size_t>(voff[t + 1] - voff[t]) * 4);
    }
  }
  if (any) {
    dense();
    lane.sync();
  }
  std::memcpy(answer, h + o[5], ob);
}

// A response with the answer `shape` (FP32) allocated; *buffer is where it goes.
TRITONSERVER_Error* answer(TRITONBACKEND_Response* response, const NativePlan& plan,
                           const std::vector<int64_t>& shape, float** buffer) {
  int64_t floats = 1;
  for (int64_t d : shape) floats *= d;
  TRITONBACKEND_Output* output = nullptr;
  void* b = nullptr;
  TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
  int64_t mt_id = 0;
  TRITONSERVER_Error* err =
      TRITONBACKEND_ResponseOutput(response, &output, plan.output.c_str(), TRITONSERVER_TYPE_FP32,
                                   shape.data(), static_cast<uint32_t>(shape.size()));
  if (err == nullptr) {
    err = TRITONBACKEND_OutputBuffer(output, &b, static_cast<uint64_t>(floats) * 4, &mt, &mt_id);
  }
  if (err == nullptr && mt == TRITONSERVER_MEMORY_GPU) {
    err = error(TRITONSERVER_ERROR_UNSUPPORTED, "GPU output buffer");
  }
  *buffer = static_cast<float*>(b);
  return err;
}

// The request parameter "exact": 1 true, 0 false or absent, -1 anything else (the Python
// path then names the problem). A bool, or the string "true"/"false" (glue.exact_requested).
int exact_of(TRITONBACKEND_Request* request) {
  int exact = 0;
  const bool read =
      each_parameter(request, [&](const char* key, TRITONSERVER_ParameterType type, const void* v) {
        if (std::strcmp(key, kExactParameter) != 0) return true;
        const auto* text = static_cast<const char*>(v);
        exact = type == TRITONSERVER_PARAMETER_BOOL     ? (*static_cast<const bool*>(v) ? 1 : 0)
                : type != TRITONSERVER_PARAMETER_STRING ? -1
                : strcasecmp(text, "true") == 0         ? 1
                : strcasecmp(text, "false") == 0        ? 0
                                                        : -1;
        return false;  // found
      });
  return read ? exact : -1;
}

// HPS's NumSample / DeviceID and the keys answered with the default value: response
// parameters, and the INT32 outputs declared; sends.
bool finish_response(const NativePlan& plan, TRITONBACKEND_Response* response,
                     TRITONSERVER_Error* err, int64_t samples, const Defaults& d) {
  for (const std::string& info : plan.info_outputs) {
    if (err != nullptr) break;
    const int64_t v64 = info == "NumSample"       ? samples
                        : info == kDefaultInfo[0] ? d.not_found()
                        : info == kDefaultInfo[1] ? d.async()
                                                  : plan.device_id;
    const int32_t v = static_cast<int32_t>(v64);
    const int64_t one = 1;
    TRITONBACKEND_Output* output = nullptr;
    void* buffer = nullptr;
    TRITONSERVER_MemoryType mt = TRITONSERVER_MEMORY_CPU;
    int64_t mt_id = 0;
    err = TRITONBACKEND_ResponseOutput(response, &output, info.c_str(), TRITONSERVER_TYPE_INT32,
                                       &one, 1);
    if (err == nullptr) err = TRITONBACKEND_OutputBuffer(output, &buffer, 4, &mt, &mt_id);
    if (err == nullptr) std::memcpy(buffer, &v, 4);
  }
  if (err == nullptr && plan.parameters) {
    drop(TRITONBACKEND_ResponseSetIntParameter(response, "NumSample", samples));
    drop(TRITONBACKEND_ResponseSetIntParameter(response, "DeviceID", plan.device_id));
    drop(TRITONBACKEND_ResponseSetIntParameter(response, kDefaultInfo[0], d.not_found()));
    drop(TRITONBACKEND_ResponseSetIntParameter(response, kDefaultInfo[1], d.async()));
  }
  return send(response, err);
}

// Runs `work` (the lookups and the rest) and turns its failure into the request's error.
template <typename Work>
TRITONSERVER_Error* guarded(const InstanceState& st, Work&& work) {
  try {
    work();
    return nullptr;
  } catch (const Failed& f) {
    return error(TRITONSERVER_ERROR_INTERNAL,
                 "model '" + st.model_name + "': inference failed: " + f.why);
  } catch (const std::exception& x) {
    return error(TRITONSERVER_ERROR_INTERNAL,
                 "model '" + st.model_name + "': inference failed: " + x.what());
  }
}

// What the native path did with a request: answered it (its response sent), failed it (an
// error response sent), or handed it over untouched to the Python path, which answers
// what the native checks refused, naming the problem (and serves what is not native).
enum class Native { kAnswered, kFailed, kHandedOver };

// The hps interface: KEYS (INT64, table-major) and NUMKEYS (INT32 [T] or [1, T]).
// Every check of LookupSession.parse_request and of the input limits; on any failure
// kHandedOver (nothing sent): the Python path answers, naming what is wrong.
Native hps_path(const InstanceState& st, TRITONBACKEND_Request* request) {
  const NativePlan& plan = *st.plan;
  Scratch& s = t_scratch;
  In keys_in, counts_in;
  if (!find(request, "KEYS", &keys_in) || !find(request, "NUMKEYS", &counts_in))
    return Native::kHandedOver;
  const int64_t tables = static_cast<int64_t>(plan.tables.size());
  const int64_t* shape = counts_in.shape;
  const bool shape_ok = (counts_in.dims == 1 && shape[0] == tables) ||
                        (counts_in.dims == 2 && shape[0] == 1 && shape[1] == tables);
  if (keys_in.type != TRITONSERVER_TYPE_INT64 || counts_in.type != TRITONSERVER_TYPE_INT32 ||
      !shape_ok || counts_in.bytes != 4 * uint64_t(tables)) {
    return Native::kHandedOver;
  }
  const int64_t n_keys = static_cast<int64_t>(keys_in.bytes / 8);
  if (n_keys == 0 || n_keys > plan.max_keys) return Native::kHandedOver;
  s.counts.resize(static_cast<size_t>(tables));
  if (!read_cpu(counts_in.input, counts_in.buffers, counts_in.bytes,
                reinterpret_cast<char*>(s.counts.data()))) {
    return Native::kHandedOver;
  }
  int64_t total = 0, floats = 0, samples = 0;
  for (int64_t t = 0; t < tables; ++t) {
    const int64_t c = s.counts[t];
    if (c < 0) return Native::kHandedOver;
    total += c;
    floats += c * plan.tables[t].dim;
    samples = std::max(samples, (c + plan.maxnum[t] - 1) / plan.maxnum[t]);
  }
  if (total != n_keys || samples > plan.max_batch_size) return Native::kHandedOver;
  const auto* keys = static_cast<const int64_t*>(data_of(keys_in, &s.copy[0]));
  if (keys == nullptr) return Native::kHandedOver;
  const int exact = exact_of(request);
  if (exact < 0) return Native::kHandedOver;

  // Checked: from here on the request is answered here.
  TRITONBACKEND_Response* response = nullptr;
  if (auto* e = TRITONBACKEND_ResponseNew(&response, request)) {
    drop(e);
    return Native::kFailed;
  }
  float* out = nullptr;
  Defaults d;
  TRITONSERVER_Error* err = answer(response, plan, {floats}, &out);
  if (err == nullptr) {
    err = guarded(st, [&] {
      if (plan.gpu()) {
        hps_gpu(st, keys, n_keys, s.counts.data(), floats, out, exact == 1, &d);
        return;
      }
      for (int64_t t = 0; t < tables; ++t) {  // straight into the response buffer
        lookup_table(st, static_cast<size_t>(t), keys, s.counts[t], out, &s, exact == 1, &d);
        keys += s.counts[t];
        out += s.counts[t] * plan.tables[t].dim;
      }
    });
  }
  return finish_response(plan, response, err, samples, d) ? Native::kAnswered : Native::kFailed;
}

// The hugectr interface: DES (FP32), CATCOLUMN (INT64 or UINT32, sample-major), ROWINDEX
// (INT32, one CSR block per table). Every check of parse_hugectr_request and of the input
// limits (else kHandedOver: the Python path names the problem); then per table the lookup and
// the slot combiner, and the dense network, all here.
Native hugectr_path(const InstanceState& st, TRITONBACKEND_Request* request) {
  const NativePlan& plan = *st.plan;
  Scratch& s = t_scratch;
  In des_in, cat_in, rows_in;
  if (!find(request, "DES", &des_in) || !find(request, "CATCOLUMN", &cat_in) ||
      !find(request, "ROWINDEX", &rows_in)) {
    return Native::kHandedOver;
  }
  const auto key_type = plan.uint32_keys ? TRITONSERVER_TYPE_UINT32 : TRITONSERVER_TYPE_INT64;
  if (des_in.type != TRITONSERVER_TYPE_FP32 || rows_in.type != TRITONSERVER_TYPE_INT32 ||
      cat_in.type != key_type) {
    return Native::kHandedOver;
  }
  const int64_t key_size = plan.uint32_keys ? 4 : 8;
  const int64_t n_des = static_cast<int64_t>(des_in.bytes / 4);
  const int64_t n_cat = static_cast<int64_t>(cat_in.bytes) / key_size;
  const int64_t n_rows = static_cast<int64_t>(rows_in.bytes / 4);
  const int64_t tables = static_cast<int64_t>(plan.tables.size());
  if (n_des > plan.limit_des || n_cat > plan.limit_cat || n_rows > plan.limit_rows)
    return Native::kHandedOver;
  const int64_t extra = n_rows - tables;
  if (extra <= 0 || extra % plan.total_slots != 0) return Native::kHandedOver;
  const int64_t n = extra / plan.total_slots;
  if (n > plan.max_batch_size || n_des != n * plan.dense_dim) return Native::kHandedOver;
  const auto* des = static_cast<const float*>(data_of(des_in, &s.copy[0]));
  const void* cat = data_of(cat_in, &s.copy[1]);
  const auto* rows = static_cast<const int32_t*>(data_of(rows_in, &s.copy[2]));
  if (des == nullptr || cat == nullptr || rows == nullptr) return Native::kHandedOver;
  for (int64_t i = 0; i < n_des; ++i) {
    if (!std::isfinite(des[i])) return Native::kHandedOver;
  }
  s.keys.resize(static_cast<size_t>(std::max<int64_t>(n_cat, 1)));
  s.key_starts.resize(static_cast<size_t>(tables + 1));
  s.ptrs.resize(static_cast<size_t>(n_rows));
  const bool regrouped =
      plan.uint32_keys
          ? tr::regroup_hugectr(static_cast<const uint32_t*>(cat), n_cat, rows, plan.slots.data(),
                                tables, n, s.keys.data(), s.key_starts.data(), s.ptrs.data())
          : tr::regroup_hugectr(static_cast<const int64_t*>(cat), n_cat, rows, plan.slots.data(),
                                tables, n, s.keys.data(), s.key_starts.data(), s.ptrs.data());
  if (!regrouped) return Native::kHandedOver;
  const int exact = exact_of(request);
  if (exact < 0) return Native::kHandedOver;

  // Checked: from here on the request is answered here.
  TRITONBACKEND_Response* response = nullptr;
  if (auto* e = TRITONBACKEND_ResponseNew(&response, request)) {
    drop(e);
    return Native::kFailed;
  }
  // upstream's [num_samples]; [num_samples, label_dim] for label_dim > 1 (RankingSession)
  std::vector<int64_t> shape{n};
  if (plan.label_dim > 1) shape.push_back(plan.label_dim);
  float* out = nullptr;
  Defaults d;
  TRITONSERVER_Error* err = answer(response, plan, shape, &out);
  if (err == nullptr) {
    err = guarded(st, [&] {
      if (plan.gpu() && plan.net && n <= plan.host_max_batch) {
        hugectr_gpu_host_dense(st, s, n, n_cat, des, out, exact == 1, &d);
        return;
      }
      if (plan.gpu()) {
        hugectr_gpu(st, s, n, n_cat, n_rows, des, out, exact == 1, &d);
        return;
      }
      s.combined.resize(static_cast<size_t>(tables));
      s.embeddings.clear();
      int64_t block = 0;
      for (int64_t t = 0; t < tables; ++t) {
        const int64_t dim = plan.tables[t].dim, segments = n * plan.slots[t];
        const int64_t first = s.key_starts[t], count = s.key_starts[t + 1] - first;
        s.vectors.resize(static_cast<size_t>(std::max<int64_t>(count * dim, 1)));
        lookup_table(st, static_cast<size_t>(t), s.keys.data() + first, count, s.vectors.data(), &s,
                     exact == 1, &d);
        auto& combined = s.combined[t];
        combined.resize(static_cast<size_t>(segments * dim));
        if (!tr::combine_segments(s.vectors.data(), count, dim, s.ptrs.data() + block, segments,
                                  plan.mean[t], combined.data())) {
          throw std::runtime_error("row pointers outside the table's keys");
        }
        s.embeddings.push_back(combined.data());
        block += segments + 1;
      }
      plan.net->predict(n, des, s.embeddings, out, &s.dense, tr::find_sgemm());
    });
  }
  return finish_response(plan, response, err, n, d) ? Native::kAnswered : Native::kFailed;
}

// The dense interface (the dense step of an hps -> dense ensemble): DES (FP32), EMBEDDINGS
// (FP32: the hps model's answer, every key's vector, table-major) and ROWINDEX (INT32, the
// hugectr layout counted within each table's keys). Every check of parse_embedding_request
// and of the input limits (else kHandedOver: the Python path names the problem); then per
// table the slot combiner and the dense network, as hugectr_path after its lookups.
Native dense_path(const InstanceState& st, TRITONBACKEND_Request* request) {
  const NativePlan& plan = *st.plan;
  Scratch& s = t_scratch;
  In des_in, emb_in, rows_in;
  if (!find(request, "DES", &des_in) || !find(request, "EMBEDDINGS", &emb_in) ||
      !find(request, "ROWINDEX", &rows_in)) {
    return Native::kHandedOver;
  }
  if (des_in.type != TRITONSERVER_TYPE_FP32 || emb_in.type != TRITONSERVER_TYPE_FP32 ||
      rows_in.type != TRITONSERVER_TYPE_INT32) {
    return Native::kHandedOver;
  }
  const int64_t n_des = static_cast<int64_t>(des_in.bytes / 4);
  const int64_t n_emb = static_cast<int64_t>(emb_in.bytes / 4);
  const int64_t n_rows = static_cast<int64_t>(rows_in.bytes / 4);
  const int64_t tables = static_cast<int64_t>(plan.slots.size());
  if (n_des > plan.limit_des || n_emb > plan.limit_cat || n_rows > plan.limit_rows)
    return Native::kHandedOver;
  const int64_t extra = n_rows - tables;
  if (extra <= 0 || extra % plan.total_slots != 0) return Native::kHandedOver;
  const int64_t n = extra / plan.total_slots;
  if (n > plan.max_batch_size || n_des != n * plan.dense_dim) return Native::kHandedOver;
  const auto* des = static_cast<const float*>(data_of(des_in, &s.copy[0]));
  const auto* emb = static_cast<const float*>(data_of(emb_in, &s.copy[1]));
  const auto* rows = static_cast<const int32_t*>(data_of(rows_in, &s.copy[2]));
  if (des == nullptr || emb == nullptr || rows == nullptr) return Native::kHandedOver;
  s.key_starts.resize(static_cast<size_t>(tables + 1));
  s.ptrs.resize(static_cast<size_t>(n_rows));
  if (!tr::widen_row_pointers(rows, plan.slots.data(), tables, n, s.key_starts.data(),
                              s.ptrs.data())) {
    return Native::kHandedOver;
  }
  int64_t floats = 0;
  for (int64_t t = 0; t < tables; ++t) {
    floats += (s.key_starts[t + 1] - s.key_starts[t]) * plan.vec_sizes[t];
  }
  if (floats != n_emb) return Native::kHandedOver;
  for (int64_t i = 0; i < n_des; ++i) {
    if (!std::isfinite(des[i])) return Native::kHandedOver;
  }
  for (int64_t i = 0; i < n_emb; ++i) {
    if (!std::isfinite(emb[i])) return Native::kHandedOver;
  }

  // Checked: from here on the request is answered here.
  TRITONBACKEND_Response* response = nullptr;
  if (auto* e = TRITONBACKEND_ResponseNew(&response, request)) {
    drop(e);
    return Native::kFailed;
  }
  float* out = nullptr;
  const Defaults d;
  TRITONSERVER_Error* err = answer(response, plan, {n * plan.label_dim}, &out);
  if (err == nullptr) {
    err = guarded(st, [&] {
      s.combined.resize(static_cast<size_t>(tables));
      s.embeddings.clear();
      int64_t block = 0;
      const float* vectors = emb;
      for (int64_t t = 0; t < tables; ++t) {
        const int64_t dim = plan.vec_sizes[t], segments = n * plan.slots[t];
        const int64_t count = s.key_starts[t + 1] - s.key_starts[t];
        auto& combined = s.combined[t];
        combined.resize(static_cast<size_t>(segments * dim));
        if (!tr::combine_segments(vectors, count, dim, s.ptrs.data() + block, segments,
                                  plan.mean[t], combined.data())) {
          throw std::runtime_error("row pointers outside the table's keys");
        }
        s.embeddings.push_back(combined.data());
        vectors += count * dim;
        block += segments + 1;
      }
      plan.net->predict(n, des, s.embeddings, out, &s.dense, tr::find_sgemm());
    });
  }
  return finish_response(plan, response, err, n, d) ? Native::kAnswered : Native::kFailed;
}

Native native_path(const InstanceState& st, TRITONBACKEND_Request* request) {
  if (st.plan->dense_only) return dense_path(st, request);
  return st.plan->hugectr ? hugectr_path(st, request) : hps_path(st, request);
}

TRITONSERVER_Error* model_string(TRITONBACKEND_Model* model, ModelState* ms) {
  const char* name = nullptr;
  if (auto* e = TRITONBACKEND_ModelName(model, &name)) return e;
  ms->name = name;
  if (auto* e = TRITONBACKEND_ModelVersion(model, &ms->version)) return e;
  TRITONBACKEND_ArtifactType at = TRITONBACKEND_ARTIFACT_FILESYSTEM;
  const char* location = nullptr;
  if (auto* e = TRITONBACKEND_ModelRepository(model, &at, &location)) return e;
  ms->repository = location;
  TRITONSERVER_Message* message = nullptr;
  if (auto* e = TRITONBACKEND_ModelConfig(model, 1, &message)) return e;
  const char* base = nullptr;
  size_t size = 0;
  TRITONSERVER_Error* e = TRITONSERVER_MessageSerializeToJson(message, &base, &size);
  if (e == nullptr) ms->config_json.assign(base, size);
  drop(TRITONSERVER_MessageDelete(message));
  return e;
}

}  // namespace

extern "C" {

#define TREC_EXPORT __attribute__((visibility("default")))

TREC_EXPORT TRITONSERVER_Error* TRITONBACKEND_Initialize(TRITONBACKEND_Backend* backend) {
  const char* name = nullptr;
  if (auto* e = TRITONBACKEND_BackendName(backend, &name)) return e;
  g_backend_name = name;
  TRITONBACKEND_ArtifactType at = TRITONBACKEND_ARTIFACT_FILESYSTEM;
  const char* location = nullptr;
  if (auto* e = TRITONBACKEND_BackendArtifacts(backend, &at, &location)) return e;
  g_backend_dir = location;
  return start_python();
}

TREC_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInitialize(TRITONBACKEND_Model* model) {
  auto ms = std::make_unique<ModelState>();
  if (auto* e = model_string(model, ms.get())) return e;
  return TRITONBACKEND_ModelSetState(model, ms.release());
}

TREC_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelFinalize(TRITONBACKEND_Model* model) {
  void* state = nullptr;
  if (auto* e = TRITONBACKEND_ModelState(model, &state)) return e;
  delete static_cast<ModelState*>(state);
  return nullptr;
}

TREC_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceInitialize(
    TRITONBACKEND_ModelInstance* instance) {
  TRITONBACKEND_Model* model = nullptr;
  void* mstate = nullptr;
  if (auto* e = TRITONBACKEND_ModelInstanceModel(instance, &model)) return e;
  if (auto* e = TRITONBACKEND_ModelState(model, &mstate)) return e;
  const auto& ms = *static_cast<ModelState*>(mstate);
  const char* iname = nullptr;
  TRITONSERVER_InstanceGroupKind kind = TRITONSERVER_INSTANCEGROUPKIND_CPU;
  int32_t device = 0;
  if (auto* e = TRITONBACKEND_ModelInstanceName(instance, &iname)) return e;
  if (auto* e = TRITONBACKEND_ModelInstanceKind(instance, &kind)) return e;
  if (auto* e = TRITONBACKEND_ModelInstanceDeviceId(instance, &device)) return e;
  const char* kind_name = kind == TRITONSERVER_INSTANCEGROUPKIND_GPU     ? "GPU"
                          : kind == TRITONSERVER_INSTANCEGROUPKIND_MODEL ? "MODEL"
                                                                         : "CPU";
  auto st = std::make_unique<InstanceState>();
  st->model_name = ms.name;
  Gil gil;
  Ref args(Py_BuildValue("{s:s,s:s,s:s,s:s,s:s,s:s,s:s}", "model_config", ms.config_json.c_str(),
                         "model_name", ms.name.c_str(), "model_repository", ms.repository.c_str(),
                         "model_version", std::to_string(ms.version).c_str(), "model_instance_name",
                         iname, "model_instance_kind", kind_name, "model_instance_device_id",
                         std::to_string(device).c_str()));
  const std::string model_file = g_backend_dir + "/model.py";
  st->hosted =
      args ? PyObject_CallMethod(g_inprocess, "HostedModel", "sO", model_file.c_str(), args.p)
           : nullptr;
  if (st->hosted == nullptr) return error(TRITONSERVER_ERROR_INTERNAL, python_error());
  std::string path = "Python (hosted in-process)";
  Ref plan(PyObject_CallMethod(st->hosted, "native_plan", nullptr));
  try {
    if (!plan) throw std::runtime_error(python_error());
    st->plan = read_plan(plan.p);
    if (st->plan) path = "native";
  } catch (const std::exception& x) {
    st->plan.reset();
    path = std::string("Python (hosted in-process; native plan refused: ") + x.what() + ")";
  }
  const std::string line = "model '" + ms.name + "' instance " + iname + ": request path " + path;
  drop(TRITONSERVER_LogMessage(TRITONSERVER_LOG_INFO, __FILE__, __LINE__, line.c_str()));
  return TRITONBACKEND_ModelInstanceSetState(instance, st.release());
}

TREC_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceFinalize(
    TRITONBACKEND_ModelInstance* instance) {
  void* state = nullptr;
  if (auto* e = TRITONBACKEND_ModelInstanceState(instance, &state)) return e;
  auto* st = static_cast<InstanceState*>(state);
  if (st == nullptr) return nullptr;
  {
    Gil gil;
    Ref r(PyObject_CallMethod(st->hosted, "finalize", nullptr));
    if (!r) {
      const std::string line = "model '" + st->model_name + "': finalize failed: " + python_error();
      drop(TRITONSERVER_LogMessage(TRITONSERVER_LOG_ERROR, __FILE__, __LINE__, line.c_str()));
    }
    st->plan.reset();
    Py_XDECREF(st->hosted);
  }
  delete st;
  return nullptr;
}

// The drained stop (src/native/drain.hpp): this process's mapping of the launcher's drain
// file, once; nullptr when the server was not started by the launcher.
tr::DrainMap* process_drain() {
  static tr::DrainMap* drain = []() -> tr::DrainMap* {
    const char* path = std::getenv("TRITON_REC_DRAIN_FILE");
    if (path == nullptr || *path == 0) return nullptr;
    try {
      return new tr::DrainMap(path);  // kept for the process's life
    } catch (const std::exception&) {
      return nullptr;  // the launcher has gone: nothing to drain for
    }
  }();
  return drain;
}

// Counts an execute in flight for the launcher (drain.hpp) from construction to
// destruction; `refuse`: the server is stopping.
struct InFlight {
  tr::DrainMap* drain = process_drain();
  bool refuse = drain != nullptr && drain->enter();
  ~InFlight() {
    if (drain != nullptr) drain->leave();
  }
};

// Every request of the call refused as retryable (UNAVAILABLE: HTTP 503, gRPC
// UNAVAILABLE) because the server is stopping; nothing else is done.
void refuse_stopping(TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests,
                     uint32_t request_count, uint64_t start) {
  for (uint32_t r = 0; r < request_count; ++r) {
    TRITONBACKEND_Response* response = nullptr;
    if (auto* e = TRITONBACKEND_ResponseNew(&response, requests[r])) {
      drop(e);
    } else {
      send(response, error(TRITONSERVER_ERROR_UNAVAILABLE, tr::kStoppingMessage));
    }
    const uint64_t end = now_ns();
    drop(TRITONBACKEND_ModelInstanceReportStatistics(instance, requests[r], false, start, start,
                                                     end, end));
    drop(TRITONBACKEND_RequestRelease(requests[r], TRITONSERVER_REQUEST_RELEASE_ALL));
  }
}

TREC_EXPORT TRITONSERVER_Error* TRITONBACKEND_ModelInstanceExecute(
    TRITONBACKEND_ModelInstance* instance, TRITONBACKEND_Request** requests,
    const uint32_t request_count) {
  const uint64_t start = now_ns();
  void* state = nullptr;
  if (auto* e = TRITONBACKEND_ModelInstanceState(instance, &state)) return e;
  const auto& st = *static_cast<InstanceState*>(state);
  const InFlight in_flight;
  if (in_flight.refuse) {
    refuse_stopping(instance, requests, request_count, start);
    return nullptr;
  }
  // Triton leaves its instance threads named "tritonserver": name this one after its model
  // (15 characters at most), so `top -H` and /proc show which model a thread's CPU serves.
  thread_local bool named = false;
  if (!named) {
    named = true;
    pthread_setname_np(pthread_self(), ("trec:" + st.model_name).substr(0, 15).c_str());
  }
  // per thread, reused: whether each request succeeded, when it was answered, and the
  // requests the native path left to the hosted model
  thread_local std::vector<char> ok;
  thread_local std::vector<uint64_t> ends;
  thread_local std::vector<uint32_t> rest;
  ok.assign(request_count, 0);
  ends.assign(request_count, 0);
  rest.clear();
  for (uint32_t r = 0; r < request_count; ++r) {
    const Native done = st.plan ? native_path(st, requests[r]) : Native::kHandedOver;
    if (done == Native::kHandedOver) {
      rest.push_back(r);
    } else {
      ok[r] = done == Native::kAnswered;
      ends[r] = now_ns();
    }
  }
  if (!rest.empty()) {
    python_path(st, requests, rest, &ok);
    const uint64_t t = now_ns();
    for (uint32_t r : rest) ends[r] = t;
  }
  uint64_t answered = 0;
  for (uint32_t r = 0; r < request_count; ++r) {
    answered += ok[r];
    drop(TRITONBACKEND_ModelInstanceReportStatistics(instance, requests[r], ok[r] != 0, start,
                                                     start, ends[r], ends[r]));
    drop(TRITONBACKEND_RequestRelease(requests[r], TRITONSERVER_REQUEST_RELEASE_ALL));
  }
  const uint64_t end = now_ns();
  if (answered > 0) {
    drop(TRITONBACKEND_ModelInstanceReportBatchStatistics(instance, answered, start, start, end,
                                                          end));
  }
  return nullptr;
}

}  // extern "C"
