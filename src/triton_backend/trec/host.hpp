// The library `trec` (libtriton_trec.so, installed per backend as
// <backend-dir>/<name>/libtriton_<name>.so): what its parts share. One concern per file:
//   backend.cpp      the Triton life cycle (TRITONBACKEND_*), the drained stop
//   interpreter.cpp  the embedded interpreter and the hosted engine (triton_rec)
//   plan.cpp         reading a NativePlan (triton_rec/serving/native_plan.py)
//   requests.cpp     a request's inputs and parameters, sending a response
//   python_path.cpp  a request answered by the hosted model.py (the GIL taken)
//   hot_paths.cpp    a request answered in C++: hps, hugectr, dense (no GIL)
//   gpu_paths.cpp    the same on a GPU instance's stream
//   combine.cpp      HugeCTR's combiner on the host (combine_table), both paths'
#pragma once

#include <Python.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend_util.hpp"
#include "dense_net.hpp"
#include "gpu_ops.hpp"
#include "hash_index.hpp"
#include "idle_pool.hpp"
#include "local_misses.hpp"
#include "shm_cache.hpp"
#include "triton_api.h"

namespace trec_host {

namespace tr = triton_rec;
using trec_backend::drop;
using trec_backend::now_ns;
using trec_backend::read_cpu;

// A new Triton error (the caller owns it).
inline TRITONSERVER_Error* error(TRITONSERVER_Error_Code code, const std::string& msg) {
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
std::string python_error();

// -- the process (interpreter.cpp) --------------------------------------------------------

extern std::string g_backend_name;  // "hps", "hugectr", "dense": which model.py is hosted
extern std::string g_backend_dir;   // <backend-dir>/<name>
extern PyObject* g_inprocess;       // triton_rec.triton.inprocess
TRITONSERVER_Error* start_python();

// -- the native plan (plan.cpp) -----------------------------------------------------------

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
  // a cache's misses: in C++ (a node-local table behind a shared-memory or a device
  // cache), else the engine's handler in Python (CachedTable.native_finish: a tier
  // store), borrowed from the plan
  const tr::LocalMisses* misses = nullptr;
  PyObject* finish = nullptr;
  tr::IndexView index{nullptr, 0};
  tr::TableView vectors{nullptr, 0, {}};
  // KIND_GPU: the device cache (misses by the table's handler, as above) or a whole table
  // on the device (static, uvm)
  bool device = false;
  tr::gpu::LookupTarget target{};

  void count(TableStat s, int64_t v) const { tr::count(stats, s, v); }
  // A lookup of n keys that the table's cache held every one of (its query took ns).
  void count_cache_hits(int64_t n, uint64_t ns) const {
    count(tr::kLookups, n);
    count(tr::kHits, n);
    count(tr::kCacheNs, static_cast<int64_t>(ns));
  }
  // `absent` keys the table itself lacks (no tier holds them): answered with the default
  // value, counted as such in the table's statistics and the request's defaults.
  void count_not_found(int64_t absent, Defaults* d) const {
    d->by_cause[tr::kCauseNotFound] += absent;
    if (absent) count(tr::kNotFound, absent);
  }
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
  // the host's executor: the plan's dense_net, shared with every plan holding it (plan.cpp)
  std::shared_ptr<const tr::DenseNet> net;
  // KIND_GPU: the kernels and this instance's stream with its staging; a hugectr model's
  // dense network as CUDA graphs (DenseGraphs.native_plan): inputs, and per batch bucket
  // (ascending) its size, graph and output
  std::shared_ptr<tr::gpu::Kernels> kernels;
  int gpu_device = -1;  // the device of `kernels`
  // KIND_GPU: what a launch for every table reads, in device memory: each table's lookup
  // target, and (a hugectr network on the GPU) where each table's slots are combined into
  // (emb_in). Declared before `lane`: freed after it, while its context is current.
  tr::gpu::DeviceArray<tr::gpu::LookupTarget> targets;
  tr::gpu::DeviceArray<tr::xcache::CombineTarget> combines;
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
  // KIND_GPU hugectr: whether the last request's caches missed (hugectr_gpu runs the network
  // before it knows only while they do not)
  mutable std::atomic<bool> last_missed{false};
  bool gpu() const { return kernels != nullptr; }
  // The width of table t's vectors (a dense plan has no tables, only their widths).
  int64_t table_dim(size_t t) const { return dense_only ? vec_sizes[t] : tables[t].dim; }
  // Whether a batch of n samples runs the network on the host (`net`), not as a graph.
  bool dense_on_host(int64_t n) const { return !gpu() || (net && n <= host_max_batch); }
};

// A plan that lacks a field the native path reads, or holds one with the wrong type
// (src/native/plan_fields.hpp names them): the plan's dataclasses and the reader disagree,
// and the model's load fails naming the field.
struct PlanFieldError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Reads a NativePlan (triton_rec/serving/native_plan.py; GIL held); nullptr if None.
// Throws PlanFieldError naming a field it lacks or holds with the wrong type, and a
// runtime_error saying why for a plan the native path refuses (Python answers then).
std::unique_ptr<NativePlan> read_plan(PyObject* plan);

// -- model and instance state (backend.cpp) ---------------------------------------------

struct ModelState {
  std::string name, config_json, repository;
  uint64_t version = 0;
};

struct InstanceState {
  std::string model_name;
  PyObject* hosted = nullptr;  // inprocess.HostedModel
  std::unique_ptr<NativePlan> plan;
};

// -- a request (requests.cpp) ----------------------------------------------------------------

// One input of a request and its properties.
struct In {
  TRITONBACKEND_Input* input = nullptr;
  TRITONSERVER_DataType type = TRITONSERVER_TYPE_INVALID;
  const int64_t* shape = nullptr;
  uint32_t dims = 0, buffers = 0;
  uint64_t bytes = 0;
};

// Fills the properties of `in->input` (and its name); Triton's error if unreadable.
TRITONSERVER_Error* describe(In* in, const char** name);
// The input `name` and its properties; false if it is absent or unreadable.
bool find(TRITONBACKEND_Request* request, const char* name, In* in);
// The data of `in`: Triton's own buffer when it is one piece in CPU memory, else a copy
// in `copy`; nullptr if it cannot be read.
const void* data_of(const In& in, std::vector<char>* copy);
// Sends `err` (owned) or the filled response; false if the request failed.
bool send(TRITONBACKEND_Response* response, TRITONSERVER_Error* err);
// The output `name` of `response` (type, shape) and its buffer of `bytes` in CPU memory
// (*buffer); Triton's error, or one if the buffer is not in CPU memory.
TRITONSERVER_Error* output_buffer(TRITONBACKEND_Response* response, const char* name,
                                  TRITONSERVER_DataType type, const int64_t* shape, uint32_t dims,
                                  uint64_t bytes, void** buffer);

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

// -- the two request paths ------------------------------------------------------------

// Answers requests[r] for every r in `which` through the hosted model (GIL taken here);
// (*ok)[r]: whether request r succeeded (python_path.cpp).
void python_path(const InstanceState& st, TRITONBACKEND_Request** requests,
                 const std::vector<uint32_t>& which, std::vector<char>* ok);

// What the native path did with a request: answered it (its response sent), failed it (an
// error response sent), or handed it over untouched to the Python path, which answers
// what the native checks refused, naming the problem (and serves what is not native).
enum class Native { kAnswered, kFailed, kHandedOver };

// The native path of one request (hot_paths.cpp).
Native native_path(const InstanceState& st, TRITONBACKEND_Request* request);

// -- what the hot paths and the GPU paths share (hot_paths.cpp) ---------------------------

// What one part of a request's tables holds (each_table): a table's cache hits, its chunk's
// segment pointers, and the keys it answered with the default value.
struct TablePart {
  std::vector<uint8_t> hit;
  std::vector<int64_t> chunk_ptrs;
  Defaults defaults;
};

// Keys [first, first + count) of one table: what one part of an hps request looks up
// (hps_path: a mapped table's keys in ranges of kRangeNs of work or more).
struct KeyRange {
  size_t table;
  int64_t first, count;
};

struct Scratch {  // reused buffers of the hot path, a request's at a time (ScratchLease)
  std::vector<int64_t> keys, key_starts, ptrs, blocks, out_starts;
  std::vector<int32_t> counts;
  std::vector<TablePart> parts;               // each_unit's, one a part
  std::vector<KeyRange> ranges;               // hps_path's units
  std::vector<char> copy[3];                  // split inputs, made contiguous
  std::vector<std::vector<float>> looked_up;  // per table: its keys' vectors
  std::vector<std::vector<float>> combined;
  std::vector<const float*> embeddings;  // the combined blocks, as the network takes them
  tr::DenseNet::Workspace dense;

  // The vectors of a request are given back once it is answered when they grew past this
  // (a chunk of combine_and_predict is 288 samples a dense thread: 3.8 MB of the MLPerf
  // DLRM's 26 tables of 128 floats a thread, so a node of many cores may pass it). Below it
  // they are kept for the next request.
  static constexpr size_t kKeepBytes = size_t{64} << 20;
  void trim() {
    size_t bytes = 0;
    for (const auto& v : looked_up) bytes += v.capacity() * sizeof(float);
    for (const auto& v : combined) bytes += v.capacity() * sizeof(float);
    if (bytes <= kKeepBytes) return;
    std::vector<std::vector<float>>().swap(looked_up);
    std::vector<std::vector<float>>().swap(combined);
    embeddings.clear();
  }
};
// The Scratch of one request, leased from one pool of the process (idle_pool.hpp) rather than
// kept by each instance's thread: a server holds as many as it runs requests at once,
// whatever its instance count (the MLPerf DLRM's 576-sample chunks: about 12 MB each), a
// request takes the one given back last, still warm in cache, and a second after a burst
// they are given back.
using ScratchLease = tr::IdleLease<Scratch>;

// A hosted call on the native path failed: the request's error (as run_requests words it).
struct Failed {
  std::string why;
};

// A hugectr or dense request's inputs, checked (read_dense_request).
struct DenseRequest {
  int64_t samples = 0, tables = 0, n_middle = 0, n_rows = 0;
  const float* des = nullptr;
  const void* middle = nullptr;  // CATCOLUMN's keys, or EMBEDDINGS
  const int32_t* rows = nullptr;
};
bool read_dense_request(const NativePlan& plan, Scratch& s, TRITONBACKEND_Request* request,
                        const char* middle, TRITONSERVER_DataType type, int64_t size,
                        DenseRequest* r);
// Table t's slots of n samples combined into the network's input (s.embeddings[t]), from its
// `count` vectors and its segment pointers ptr[0..n * slots] (CSR offsets into `vectors`). A
// one-hot table's `vectors` are the input themselves: they must live until the network ran.
// Touches table t's buffers alone (each_table's parts run it for other tables at once).
void combine_table(const NativePlan& plan, Scratch& s, size_t t, int64_t n, const float* vectors,
                   int64_t count, const int64_t* ptr);

// What looking up `keys` keys of table t costs, roughly, for each_table's split: a key from
// the table's shared cache (a hit) about 10 ns, from a mapped table about 80 ns (random rows
// of a large table; 2-core development VM, benchmarks/history/
// 2026-12-07-idle-buffers-and-parallel-lookups.md). A part is worth kPartNs, what handing
// it to another thread costs: 1,664 keys of a mapped table split, the same keys answered
// from a cache do not (16 us in one thread, and the other core is often Triton's).
// A mapped table's keys are split in ranges only where each is worth kRangeNs or more (an hps
// request of 1,664 keys of one table, 133 us, lost more to the hand-over on this VM's two
// shared cores than it gained; 26,624 keys, 2.1 ms, gain).
constexpr int64_t kCachedKeyNs = 10, kMappedKeyNs = 80, kPartNs = 30'000, kRangeNs = 250'000;
inline int64_t lookup_ns(const NativePlan& plan, size_t t, int64_t keys) {
  return keys * (plan.tables[t].cache ? kCachedKeyNs : kMappedKeyNs);
}

// fn(u, part) for every unit u in [0, units) of a request's lookups, split across the cores
// no other call of the process is using (row_parts.hpp's rule, one part per kPartNs of their
// work, `work_ns`, at most one a unit and TRITON_REC_DENSE_THREADS): each part takes the
// next unit not taken yet, with a TablePart of its own (s.parts[p]); the keys they answered
// with the default value are added to *d. then_more: RowPool::run's (the network follows).
template <typename Fn>
void each_unit(Scratch& s, int64_t work_ns, size_t units, Defaults* d, bool then_more, Fn&& fn) {
  const tr::IdleParts split(std::min(work_ns / kPartNs, static_cast<int64_t>(units)));
  const int parts = split.parts();
  if (s.parts.size() < static_cast<size_t>(parts)) s.parts.resize(static_cast<size_t>(parts));
  for (int p = 0; p < parts; ++p) s.parts[static_cast<size_t>(p)].defaults = Defaults{};
  if (parts == 1) {
    for (size_t u = 0; u < units; ++u) fn(u, s.parts[0]);
  } else {
    std::atomic<size_t> next{0};
    tr::RowPool::instance().run(
        parts,
        [&](int p) {
          for (size_t u; (u = next.fetch_add(1)) < units;) fn(u, s.parts[static_cast<size_t>(p)]);
        },
        then_more);
  }
  for (int p = 0; d != nullptr && p < parts; ++p) {
    const Defaults& part = s.parts[static_cast<size_t>(p)].defaults;
    for (int c = 0; c < tr::kNumDefaultCauses; ++c) d->by_cause[c] += part.by_cause[c];
  }
}

// fn(t, part) for every table t of a request (its lookups, its slots combined), a table a
// unit of each_unit. So a request alone on a node of idle cores looks up its tables on
// several of them, as its network runs.
template <typename Fn>
void each_table(const NativePlan& plan, Scratch& s, int64_t work_ns, Defaults* d, bool then_more,
                Fn&& fn) {
  const size_t tables = plan.slots.empty() ? plan.tables.size() : plan.slots.size();
  each_unit(s, work_ns, tables, d, then_more, std::forward<Fn>(fn));
}

// Where each table's vectors lie for the keys of a regrouped hugectr request, or in a dense
// request's EMBEDDINGS (s.key_starts: each table's keys): offsets in floats, one past the
// last table's end.
std::vector<int64_t> vector_offsets(const NativePlan& plan, const Scratch& s);

// Where each table's keys and answer start in an hps request (KEYS table-major, counts[t]
// keys of table t): prefix sums of the counts and of counts x dim, tables + 1 each.
void hps_starts(const NativePlan& plan, const int32_t* counts, std::vector<int64_t>* key_starts,
                std::vector<int64_t>* out_starts);

// A hugectr or dense request of n samples answered on the host (`out`), a chunk of samples
// at a time (DenseNet::chunk_rows: every thread of the network's call a whole pass): each
// table's vectors of the chunk's keys, its slots combined (combine_table), then the network
// on the chunk. vectors(t, first, count, part) gives table t's vectors of its keys [first,
// first + count) (s.key_starts counts each table's keys; s.ptrs holds, table after table, the
// n * slots + 1 segment pointers into them): looked up (`looks_up`: the tables split across
// idle cores, each_table, the defaults it answered counted in `part` and then added to *d),
// or where they lie already; they must live until the chunk's network ran. So what a request
// holds besides its inputs and answer is one chunk's vectors, whatever its batch (a batch of
// 65,536 samples of the MLPerf DLRM held 872 MB of them before), and they are read back from
// cache. What the hugectr and dense paths and a GPU instance's small batches share.
template <typename Vectors>
void combine_and_predict(const NativePlan& plan, Scratch& s, int64_t n, const float* des,
                         float* out, Defaults* d, bool looks_up, Vectors&& vectors) {
  const size_t tables = plan.slots.size();
  const int64_t chunk = plan.net->chunk_rows();
  s.combined.resize(tables);
  s.embeddings.resize(tables);
  s.blocks.resize(tables);
  for (size_t t = 0, block = 0; t < tables; ++t) {  // where table t's segment pointers start
    s.blocks[t] = static_cast<int64_t>(block);
    block += static_cast<size_t>(n * plan.slots[t] + 1);
  }
  for (int64_t a = 0; a < n; a += chunk) {
    const int64_t c = std::min(chunk, n - a);
    int64_t work_ns = 0;  // the chunk's lookups'
    for (size_t t = 0; looks_up && t < tables; ++t) {
      const int64_t* p = s.ptrs.data() + s.blocks[t] + a * plan.slots[t];
      work_ns += lookup_ns(plan, t, p[c * plan.slots[t]] - p[0]);
    }
    each_table(plan, s, work_ns, d, true, [&](size_t t, TablePart& part) {  // the network next
      const int64_t segments = c * plan.slots[t];
      const int64_t* p = s.ptrs.data() + s.blocks[t] + a * plan.slots[t];
      const int64_t first = p[0], count = p[segments] - first;
      if (first < 0 || count < 0) throw std::runtime_error("row pointers out of order");
      const int64_t* ptr = p;
      if (first != 0) {  // the chunk's pointers, counted from its first key
        part.chunk_ptrs.resize(static_cast<size_t>(segments + 1));
        for (int64_t i = 0; i <= segments; ++i) part.chunk_ptrs[i] = p[i] - first;
        ptr = part.chunk_ptrs.data();
      }
      combine_table(plan, s, t, c, vectors(t, first, count, part), count, ptr);
    });
    plan.net->predict(c, des + a * plan.dense_dim, s.embeddings, out + a * plan.label_dim,
                      &s.dense);
  }
  s.trim();
}

// The misses of table `t`'s cache query by the table's handler (hot_paths.cpp).
// pending (the GPU paths): where a node-local table's fetched rows go, to be inserted with
// the request's other tables' (null: inserted now).
void finish_query(const InstanceState& st, size_t t, const int64_t* keys, int64_t n, float* out,
                  uint8_t* hit, int64_t hits, uint64_t query_ns, bool exact, Defaults* d,
                  tr::PendingInserts* pending = nullptr);

// -- the GPU paths (gpu_paths.cpp) --------------------------------------------------------

// What the lookups of a request's tables on the GPU left in the lane's pinned staging: the
// answers (table t's from out_starts[t] floats), a status per key, and the time they took.
struct Looked {
  float* out;
  uint8_t* status;
  uint64_t ns;
};
// The lookups of every table of a request on the GPU, host to host (one synchronization).
Looked lookup_tables(const NativePlan& plan, const int64_t* keys, const int64_t* key_starts,
                     const int64_t* out_starts);
// An hps request on the GPU: keys[0..n_keys) of every table -> answer (floats).
void hps_gpu(const InstanceState& st, const int64_t* keys, int64_t n_keys, const int32_t* counts,
             int64_t floats, float* answer, bool exact, Defaults* d);
// A hugectr request of few samples on a GPU instance: lookups on the GPU, network on the host.
void hugectr_gpu_host_dense(const InstanceState& st, Scratch& s, int64_t n, int64_t n_cat,
                            const float* des, float* answer, bool exact, Defaults* d);
// A hugectr request on the GPU: lookups, slots and the network's graph.
void hugectr_gpu(const InstanceState& st, const Scratch& s, int64_t n, int64_t n_cat, int64_t rows,
                 const float* des, float* answer, bool exact, Defaults* d);
// A dense request on the GPU (the looked-up vectors `emb`, n_emb floats, and the row
// pointers s.ptrs, rows of them): the slots combined and the network's graph.
void dense_gpu(const InstanceState& st, const Scratch& s, int64_t n, const float* emb,
               int64_t n_emb, int64_t rows, const float* des, float* answer);

}  // namespace trec_host
