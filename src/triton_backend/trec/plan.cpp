// Reading a NativePlan (triton_rec/serving/native_plan.py) into the C++ plan (host.hpp).
#include <stdexcept>

#include "host.hpp"

namespace trec_host {

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

// A hugectr or dense model's "dense_gpu" entry (DenseGraphs.native_plan).
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

// What the launches for every table read (NativePlan::targets, combines), to the device;
// after the plan's checks (one emb_in, slots and mean entry per table).
void upload_targets(NativePlan* plan) {
  std::vector<tr::gpu::LookupTarget> targets;
  for (const NativeTable& nt : plan->tables) targets.push_back(nt.target);
  plan->targets.upload(*plan->lane, targets);
  if (plan->emb_in.empty()) return;
  std::vector<tr::xcache::CombineTarget> combines(plan->emb_in.size());
  for (size_t t = 0; t < combines.size(); ++t) {
    combines[t].out = reinterpret_cast<float*>(plan->emb_in[t]);
    combines[t].dim = plan->table_dim(t);
    combines[t].mean = plan->mean[t] ? 1 : 0;
  }
  plan->combines.upload(*plan->lane, combines);
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
      if (misses != nullptr) {  // a shared-memory or a device cache: LocalMisses
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
      (plan->dense_only && (!plan->tables.empty() || (!plan->net && plan->buckets.empty())))) {
    throw std::runtime_error("native plan: the per-table lists differ in length");
  }
  if (plan->gpu()) upload_targets(plan.get());
  return plan;
}

}  // namespace trec_host
