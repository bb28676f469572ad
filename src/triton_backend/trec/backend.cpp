// The native backend `trec` (issue 14): one library, libtriton_trec.so, installed by the
// launcher once per backend it serves as <backend-dir>/<name>/libtriton_<name>.so (hps,
// hugectr, dense). Its parts: host.hpp.
//
// Control plane: it embeds the interpreter of the project's environment once per server
// and hosts each model instance's TritonPythonModel (the backend's own model.py) through
// triton_rec.triton.inprocess, which plays triton_python_backend_utils in-process. So the
// engine stays the single place of the semantics (ps.json, stores, caches, tiers, refresh,
// updates, metrics, every error text), and no request crosses a process boundary.
//
// Data plane: when the hosted model hands over a native plan (a model whose tables are
// node-local: a CPU shared cache, a device cache, a whole table on the device, or the
// mapped table without a cache), a request is validated and answered here without the
// GIL: the shared cache (shm_cache.hpp), the device's kernels (gpu_paths.cpp) or the
// table index (hash_index.hpp) writes the vectors straight into Triton's response buffer,
// and a cache's misses are answered by HPS's rules by the table's LocalMisses
// (local_misses.hpp: the fetch, the hit-rate rule, the background insert queue; into a
// device cache by its write kernel). Python is entered only for what is not the hot path:
// a request the checks here do not accept (Python then names what is wrong, with today's
// messages), the misses of a cache in front of a tier store (the plan's `finish`
// handler), and every request of a model without a plan. Each such call is counted
// (trec_python_calls_total).
#include <pthread.h>

#include "drain.hpp"
#include "host.hpp"

namespace trec_host {

namespace {

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
}  // namespace trec_host

using namespace trec_host;  // NOLINT: the C entry points below use the library's parts

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
  } catch (const PlanFieldError& x) {  // the plan and its reader disagree: a bug, named
    st->plan.reset();
    Ref r(PyObject_CallMethod(st->hosted, "finalize", nullptr));
    if (!r) PyErr_Clear();
    Py_CLEAR(st->hosted);
    return error(TRITONSERVER_ERROR_INTERNAL, "model '" + ms.name + "': " + x.what());
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
