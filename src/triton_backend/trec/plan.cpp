// Reading a NativePlan (triton_rec/serving/native_plan.py) into the C++ plan (host.hpp).
#include <memory>
#include <stdexcept>

#include "host.hpp"
#include "plan_fields.hpp"

namespace trec_host {

namespace pf = tr::plan_fields;

namespace {

// The Python type's name of `o`, for messages.
std::string type_name(PyObject* o) { return Py_TYPE(o)->tp_name; }

// "TablePlan.vec_size": a field as messages name it.
std::string where(const pf::PlanType& t, int f) { return std::string(t.name) + "." + t.fields[f]; }

[[noreturn]] void bad_field(const pf::PlanType& t, int f, const std::string& problem) {
  throw PlanFieldError("native plan: " + where(t, f) + " " + problem);
}

// The field `f` of `o`, a plan dataclass of type `t` (plan_fields.hpp names its fields);
// nullptr where it is None. An object without the field fails naming it (the plan's
// dataclass and this reader disagree). Borrowed: the plan object holds it for as long as
// the plan lives.
PyObject* field(PyObject* o, const pf::PlanType& t, int f) {
  PyObject* v = PyObject_GetAttrString(o, t.fields[f]);
  if (v == nullptr) {
    PyErr_Clear();
    bad_field(t, f, "is missing (a " + type_name(o) + " has no '" + t.fields[f] + "')");
  }
  Py_DECREF(v);  // an instance attribute: the object keeps its own reference
  return v == Py_None ? nullptr : v;
}

// The field, which may not be None.
PyObject* required(PyObject* o, const pf::PlanType& t, int f) {
  PyObject* v = field(o, t, f);
  if (v == nullptr) bad_field(t, f, "is None");
  return v;
}

// An int (not a bool) of a field: `v` its value, `what` its name in messages.
int64_t int_value(PyObject* v, const pf::PlanType& t, int f, const char* what = "") {
  if (!PyLong_Check(v) || PyBool_Check(v)) {
    bad_field(t, f, std::string(what) + "must be an int, got " + type_name(v));
  }
  const int64_t x = PyLong_AsLongLong(v);
  if (x == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    bad_field(t, f, std::string(what) + "does not fit in int64");
  }
  return x;
}
uintptr_t address_value(PyObject* v, const pf::PlanType& t, int f, const char* what = "") {
  if (!PyLong_Check(v) || PyBool_Check(v)) {
    bad_field(t, f, std::string(what) + "must be an address (an int), got " + type_name(v));
  }
  const unsigned long long x = PyLong_AsUnsignedLongLong(v);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    bad_field(t, f, std::string(what) + "is not an address");
  }
  return static_cast<uintptr_t>(x);
}

int64_t integer(PyObject* o, const pf::PlanType& t, int f) {
  return int_value(required(o, t, f), t, f);
}
uintptr_t address(PyObject* o, const pf::PlanType& t, int f) {
  return address_value(required(o, t, f), t, f);
}
double real(PyObject* o, const pf::PlanType& t, int f) {
  PyObject* v = required(o, t, f);
  if (PyFloat_Check(v)) return PyFloat_AsDouble(v);
  return static_cast<double>(int_value(v, t, f, "(a number) "));
}
std::string text(PyObject* o, const pf::PlanType& t, int f) {
  PyObject* v = required(o, t, f);
  const char* s = PyUnicode_Check(v) ? PyUnicode_AsUTF8(v) : nullptr;
  if (s == nullptr) {
    PyErr_Clear();
    bad_field(t, f, "must be a str, got " + type_name(v));
  }
  return s;
}
// A list field; `none_ok`: None reads as an empty list.
PyObject* list(PyObject* o, const pf::PlanType& t, int f) {
  PyObject* v = required(o, t, f);
  if (!PyList_Check(v)) bad_field(t, f, "must be a list, got " + type_name(v));
  return v;
}
std::vector<int64_t> ints(PyObject* o, const pf::PlanType& t, int f) {
  PyObject* l = list(o, t, f);
  std::vector<int64_t> out;
  for (Py_ssize_t i = 0; i < PyList_Size(l); ++i) {
    out.push_back(int_value(PyList_GetItem(l, i), t, f, "items "));
  }
  return out;
}
// An (address, count) tuple field (a Span), or false where it is None.
bool span(PyObject* o, const pf::PlanType& t, int f, uintptr_t* a, int64_t* n) {
  PyObject* v = field(o, t, f);
  if (v == nullptr) return false;
  if (!PyTuple_Check(v) || PyTuple_Size(v) != 2) {
    bad_field(t, f, "must be an (address, count) tuple, got " + type_name(v));
  }
  *a = address_value(PyTuple_GetItem(v, 0), t, f, "(its address) ");
  *n = int_value(PyTuple_GetItem(v, 1), t, f, "(its count) ");
  return true;
}

}  // namespace

// The "gpu" entry of a plan (GpuPlan): the device and the kernels' module (bytes); this
// instance's kernels and lane.
void read_gpu(PyObject* gpu, NativePlan* plan) {
  const auto& T = pf::kGpuPlan;
  const int device = static_cast<int>(integer(gpu, T, pf::gpu_plan::device));
  PyObject* image = required(gpu, T, pf::gpu_plan::image);
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (!PyBytes_Check(image) || PyBytes_AsStringAndSize(image, &data, &size) != 0) {
    PyErr_Clear();
    bad_field(T, pf::gpu_plan::image,
              "must be the kernels' module (bytes), got " + type_name(image));
  }
  plan->gpu_device = device;
  auto dev = std::make_shared<tr::cuda::Device>(device);
  plan->kernels = std::make_shared<tr::gpu::Kernels>(dev, std::string(data, size));
  plan->lane = std::make_unique<tr::gpu::Lane>(plan->kernels);
}

// A table's "device_cache" (DeviceCachePlan: ArrayEmbeddingCache.native_plan) or
// "device_table" (DeviceTablePlan: DeviceTableCache.device_plan) entry, on the plan's GPU.
void read_device_table(PyObject* t, tr::Precision precision, int gpu_device, NativeTable* nt) {
  nt->device = true;
  const int64_t device = integer(t, pf::kTablePlan, pf::table_plan::device);
  if (device != gpu_device) {
    throw std::runtime_error("native plan: a table on GPU " + std::to_string(device) +
                             ", the plan's GPU is " + std::to_string(gpu_device));
  }
  if (PyObject* c = field(t, pf::kTablePlan, pf::table_plan::device_cache)) {
    namespace dc = pf::device_cache_plan;
    const auto& C = pf::kDeviceCachePlan;
    PyObject* arrays = required(c, C, dc::arrays);
    if (!PyDict_Check(arrays)) bad_field(C, dc::arrays, "must be a dict, got " + type_name(arrays));
    const tr::gpu::StateAddresses a = tr::gpu::state_addresses([&](const char* k) -> uintptr_t {
      PyObject* v = PyDict_GetItemString(arrays, k);  // absent: 0 (the sketch without tinylfu)
      return v != nullptr ? address_value(v, C, dc::arrays, "values ") : 0;
    });
    auto num = [&](int f) { return integer(c, C, f); };
    nt->target.cache = true;
    nt->target.view =
        tr::gpu::make_view(a, num(dc::num_sets), num(dc::ways), num(dc::dim), num(dc::precision),
                           num(dc::policy), num(dc::sketch_width));
    if (nt->target.view.dim != nt->dim ||
        nt->target.view.precision != static_cast<int64_t>(precision)) {
      throw std::runtime_error("native plan: the device cache's vec_size or precision differs");
    }
    return;
  }
  PyObject* d = field(t, pf::kTablePlan, pf::table_plan::device_table);
  if (d == nullptr) throw std::runtime_error("native plan: a GPU table has no device entry");
  namespace dt = pf::device_table_plan;
  const auto& D = pf::kDeviceTablePlan;
  nt->target.cache = false;
  tr::gpu::DeviceTable& tb = nt->target.table;
  tb.slots = reinterpret_cast<const int64_t*>(address(d, D, dt::slots));
  tb.capacity = static_cast<uint64_t>(integer(d, D, dt::capacity));
  tb.vectors = reinterpret_cast<const uint8_t*>(address(d, D, dt::vectors));
  tb.rows = integer(d, D, dt::rows);
  tb.precision = static_cast<int64_t>(precision);
  tb.dim = nt->dim;
  tb.default_value = nt->default_value;
  if (tb.slots == nullptr || tb.vectors == nullptr || tb.capacity < 16 ||
      (tb.capacity & (tb.capacity - 1)) != 0) {
    throw std::runtime_error("native plan: bad device table");
  }
}

// A hugectr or dense model's "dense_gpu" entry (DenseGpuPlan: DenseGraphs.native_plan), on
// the plan's GPU.
void read_dense_gpu(PyObject* g, NativePlan* plan) {
  namespace dg = pf::dense_gpu_plan;
  const auto& G = pf::kDenseGpuPlan;
  const int64_t device = integer(g, G, dg::device);
  if (device != plan->gpu_device) {
    throw std::runtime_error("native plan: the network on GPU " + std::to_string(device) +
                             ", the plan's GPU is " + std::to_string(plan->gpu_device));
  }
  plan->dense_in = address(g, G, dg::dense_in);
  plan->host_max_batch = std::max<int64_t>(0, integer(g, G, dg::host_max_batch));
  PyObject* emb = list(g, G, dg::emb_in);
  for (Py_ssize_t i = 0; i < PyList_Size(emb); ++i) {
    plan->emb_in.push_back(address_value(PyList_GetItem(emb, i), G, dg::emb_in, "items "));
  }
  PyObject* buckets = list(g, G, dg::buckets);
  for (Py_ssize_t i = 0; i < PyList_Size(buckets); ++i) {
    PyObject* b = PyList_GetItem(buckets, i);
    if (!PyTuple_Check(b) || PyTuple_Size(b) != 3) {
      bad_field(G, dg::buckets, "items must be (batch, graph, output) tuples");
    }
    plan->buckets.push_back({int_value(PyTuple_GetItem(b, 0), G, dg::buckets, "batches "),
                             reinterpret_cast<tr::cuda::CUgraphExec>(
                                 address_value(PyTuple_GetItem(b, 1), G, dg::buckets, "graphs ")),
                             address_value(PyTuple_GetItem(b, 2), G, dg::buckets, "outputs ")});
  }
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

// One table of the plan (TablePlan).
NativeTable read_table(PyObject* t, const NativePlan& plan) {
  namespace tp = pf::table_plan;
  const auto& T = pf::kTablePlan;
  NativeTable nt;
  nt.dim = integer(t, T, tp::vec_size);
  const tr::Precision precision = tr::precision_of(integer(t, T, tp::precision));
  nt.default_value = static_cast<float>(real(t, T, tp::default_value));
  nt.stats = reinterpret_cast<int64_t*>(address(t, T, tp::stats));
  uintptr_t addr = 0;
  int64_t n = 0;
  if (field(t, T, tp::device_cache) != nullptr || field(t, T, tp::device_table) != nullptr) {
    if (!plan.gpu())
      throw std::runtime_error("native plan: GPU and host tables mixed in one model");
    read_device_table(t, precision, plan.gpu_device, &nt);
  } else if (span(t, T, tp::cache, &addr, &n)) {
    nt.cache = tr::ShmCache::attach(reinterpret_cast<void*>(addr), static_cast<size_t>(n));
    if (static_cast<int64_t>(nt.cache->vec_size()) != nt.dim ||
        nt.cache->format().precision != precision) {
      throw std::runtime_error("native plan: the cache's vec_size or precision differs");
    }
  } else {
    if (field(t, T, tp::device) != nullptr) {
      throw std::runtime_error("native plan: a table on a GPU without its device entry");
    }
    if (!span(t, T, tp::index, &addr, &n)) {
      throw std::runtime_error("native plan: a host table without its index");
    }
    try {  // a hash index, or a direct one (a range of keys: hash_index.hpp)
      nt.index = tr::index_view(reinterpret_cast<const int64_t*>(addr), static_cast<uint64_t>(n));
    } catch (const std::invalid_argument& x) {
      throw std::runtime_error(std::string("native plan: ") + x.what());
    }
    if (!span(t, T, tp::vectors, &addr, &n)) {
      throw std::runtime_error("native plan: a host table without its vectors");
    }
    nt.vectors = tr::TableView{reinterpret_cast<const void*>(addr), n,
                               tr::RowFormat(precision, static_cast<size_t>(nt.dim))};
  }
  PyObject* misses = field(t, T, tp::misses);
  nt.finish = field(t, T, tp::finish);
  if (nt.cache || (nt.device && nt.target.cache)) {  // a cache: its miss handler
    if (misses != nullptr) {  // a shared-memory or a device cache: LocalMisses
      nt.misses = reinterpret_cast<const tr::LocalMisses*>(address_value(misses, T, tp::misses));
      if (nt.misses == nullptr || nt.misses->dim() != nt.dim) {
        throw std::runtime_error("native plan: bad miss handler");
      }
    } else if (nt.finish == nullptr || !PyCallable_Check(nt.finish)) {
      throw std::runtime_error("native plan: a cache without a miss handler");
    }
  } else {
    nt.finish = nullptr;  // no cache: every key is in the table (or a whole table on a GPU)
  }
  return nt;
}

// The dense network as the host runs it: the plan's `dense_net`, a triton_rec._native
// DenseNet, whose capsule() hands over its std::shared_ptr (dense_net.hpp,
// kDenseNetCapsule). Every instance of a model gets the same DenseNet (HugeCTRNetwork.shared
// and its native_net, made once), so they run one packed copy of the weights; a DenseNet is
// immutable once made (predict is const, its scratch is the caller's) and holds all it reads.
void read_dense_net(PyObject* net, NativePlan* plan) {
  Ref capsule(PyObject_CallMethod(net, "capsule", nullptr));
  void* held =
      capsule.p != nullptr ? PyCapsule_GetPointer(capsule.p, tr::kDenseNetCapsule) : nullptr;
  if (held == nullptr) {
    PyErr_Clear();
    bad_field(pf::kNativePlan, pf::native_plan::dense_net,
              "must be a triton_rec._native.DenseNet, got " + type_name(net));
  }
  plan->net = *static_cast<std::shared_ptr<const tr::DenseNet>*>(held);
  if (plan->net->dense_dim() != plan->dense_dim || plan->net->label_dim() != plan->label_dim ||
      plan->net->num_tables() != plan->slots.size()) {
    throw std::runtime_error("native plan: the dense network disagrees with the model");
  }
}

// Reads the NativePlan of HostedModel.native_plan() (GIL held); nullptr if None. Throws
// PlanFieldError naming a field the plan lacks or holds with the wrong type, and a
// runtime_error for a plan the native path refuses.
std::unique_ptr<NativePlan> read_plan(PyObject* d) {
  if (d == Py_None) return nullptr;
  namespace np = pf::native_plan;
  const auto& P = pf::kNativePlan;
  auto plan = std::make_unique<NativePlan>();
  Py_INCREF(d);
  plan->source.p = d;
  const std::string kind = text(d, P, np::kind);
  if (kind != "hps" && kind != "hugectr" && kind != "dense") {
    bad_field(P, np::kind, "must be hps, hugectr or dense, got '" + kind + "'");
  }
  plan->dense_only = kind == "dense";
  plan->hugectr = kind == "hugectr" || plan->dense_only;
  plan->parameters = !plan->dense_only;
  plan->max_batch_size = integer(d, P, np::max_batch_size);
  plan->device_id = static_cast<int32_t>(integer(d, P, np::device_id));
  plan->output = text(d, P, np::output);
  if (PyObject* gpu = field(d, P, np::gpu)) read_gpu(gpu, plan.get());
  PyObject* info = list(d, P, np::info_outputs);
  for (Py_ssize_t i = 0; i < PyList_Size(info); ++i) {
    PyObject* name = PyList_GetItem(info, i);
    const char* s = PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : nullptr;
    if (s == nullptr) bad_field(P, np::info_outputs, "items must be str");
    plan->info_outputs.emplace_back(s);
  }
  if (plan->hugectr) {
    plan->slots = ints(d, P, np::slots);
    for (int64_t s : plan->slots) plan->total_slots += s;
    PyObject* mean = list(d, P, np::mean);
    for (Py_ssize_t i = 0; i < PyList_Size(mean); ++i) {
      PyObject* m = PyList_GetItem(mean, i);
      if (!PyBool_Check(m)) bad_field(P, np::mean, "items must be bool, got " + type_name(m));
      plan->mean.push_back(m == Py_True);
    }
    plan->dense_dim = integer(d, P, np::dense_dim);
    plan->label_dim = integer(d, P, np::label_dim);
    if (plan->dense_only) {
      plan->vec_sizes = ints(d, P, np::vec_sizes);
    } else {
      const std::string key_type = text(d, P, np::key_type);
      if (key_type != "INT64" && key_type != "UINT32") {
        bad_field(P, np::key_type, "must be INT64 or UINT32, got '" + key_type + "'");
      }
      plan->uint32_keys = key_type == "UINT32";
    }
    namespace pl = pf::plan_limits;
    PyObject* limits = required(d, P, np::limits);
    plan->limit_des = integer(limits, pf::kPlanLimits, pl::des);
    plan->limit_cat = integer(limits, pf::kPlanLimits, pl::cat);
    plan->limit_rows = integer(limits, pf::kPlanLimits, pl::rows);
    if (PyObject* dense_gpu = field(d, P, np::dense_gpu)) {
      if (!plan->gpu()) throw std::runtime_error("native plan: a GPU network without kernels");
      read_dense_gpu(dense_gpu, plan.get());
    }
  }
  if (plan->hugectr && plan->gpu() && plan->buckets.empty()) {
    throw std::runtime_error("native plan: GPU tables need the network on the GPU too");
  }
  PyObject* net = field(d, P, np::dense_net);
  const bool host_dense = plan->host_max_batch > 0 && net != nullptr;
  if (plan->hugectr && (plan->buckets.empty() || host_dense)) {
    read_dense_net(required(d, P, np::dense_net), plan.get());
  } else if (!plan->hugectr) {
    plan->maxnum = ints(d, P, np::maxnum);
    int64_t per_sample = 0;
    for (int64_t m : plan->maxnum) per_sample += m;
    plan->max_keys = plan->max_batch_size * per_sample;
  }
  PyObject* tables = list(d, P, np::tables);
  for (Py_ssize_t i = 0; i < PyList_Size(tables); ++i) {
    plan->tables.push_back(read_table(PyList_GetItem(tables, i), *plan));
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
  if (PyErr_Occurred()) throw std::runtime_error(python_error());
  if (plan->gpu()) upload_targets(plan.get());
  return plan;
}

}  // namespace trec_host
