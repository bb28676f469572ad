// A request answered in C++, without the GIL: the hps, hugectr and dense interfaces.
#include <strings.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "host.hpp"
#include "request_kernels.hpp"

namespace trec_host {

// The misses of table `t`'s cache query (hit[i] == 0; `hits` hit, in query_ns): by the
// table's handler, which answers them into `out` by HPS's rules and adds the keys it
// answered with the default value to *d. In C++ for a node-local table (LocalMisses, no
// GIL); else the engine's handler in Python (CachedTable.native_finish).
void finish_query(const InstanceState& st, size_t t, const int64_t* keys, int64_t n, float* out,
                  uint8_t* hit, int64_t hits, uint64_t query_ns, bool exact, Defaults* d,
                  tr::PendingInserts* pending) {
  const NativeTable& nt = st.plan->tables[t];
  if (nt.misses != nullptr) {
    const uint8_t want = exact ? 1 : 0;
    nt.misses->finish(keys, n, out, hit, hits, query_ns, nullptr, 0, &want, d->by_cause, pending);
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
                  TablePart* part, bool exact) {
  if (n == 0) return;
  const NativeTable& nt = st.plan->tables[t];
  Defaults* d = &part->defaults;
  if (nt.cache) {
    part->hit.resize(static_cast<size_t>(n));
    const uint64_t t0 = now_ns();
    const int64_t hits = nt.cache->query(keys, static_cast<size_t>(n), out, part->hit.data());
    const uint64_t q = now_ns() - t0;
    if (hits == n) {
      nt.count_cache_hits(n, q);
    } else {
      finish_query(st, t, keys, n, out, part->hit.data(), hits, q, exact, d);
    }
    return;
  }
  const uint64_t t0 = now_ns();
  const int64_t absent = tr::lookup(nt.index, nt.vectors, keys, static_cast<size_t>(n), out,
                                    nt.default_value, nullptr);
  nt.count_not_found(absent, d);
  nt.count(tr::kLookups, n);
  nt.count(tr::kMisses, n);
  nt.count(tr::kSyncFetched, n);
  nt.count(tr::kStoreNs, static_cast<int64_t>(now_ns() - t0));
}

// A response with the answer `shape` (FP32) allocated; *buffer is where it goes.
TRITONSERVER_Error* answer(TRITONBACKEND_Response* response, const NativePlan& plan,
                           const std::vector<int64_t>& shape, float** buffer) {
  int64_t floats = 1;
  for (int64_t d : shape) floats *= d;
  void* b = nullptr;
  TRITONSERVER_Error* err =
      output_buffer(response, plan.output.c_str(), TRITONSERVER_TYPE_FP32, shape.data(),
                    static_cast<uint32_t>(shape.size()), static_cast<uint64_t>(floats) * 4, &b);
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
    void* buffer = nullptr;
    err = output_buffer(response, info.c_str(), TRITONSERVER_TYPE_INT32, &one, 1, 4, &buffer);
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

// Answers a checked request: its response with the FP32 answer of `shape` allocated,
// work(out, &defaults) filling it (a failure becomes the request's error), then the info
// outputs and parameters (`samples`: NumSample), sent.
template <typename Work>
Native respond(const InstanceState& st, TRITONBACKEND_Request* request,
               const std::vector<int64_t>& shape, int64_t samples, Work&& work) {
  TRITONBACKEND_Response* response = nullptr;
  if (auto* e = TRITONBACKEND_ResponseNew(&response, request)) {
    drop(e);
    return Native::kFailed;
  }
  float* out = nullptr;
  Defaults d;
  TRITONSERVER_Error* err = answer(response, *st.plan, shape, &out);
  if (err == nullptr) err = guarded(st, [&] { work(out, &d); });
  return finish_response(*st.plan, response, err, samples, d) ? Native::kAnswered : Native::kFailed;
}

// What the hugectr and dense interfaces share: DES (FP32), the middle input (`middle`:
// CATCOLUMN's keys or EMBEDDINGS, of `type`, `size` bytes an element) and ROWINDEX
// (INT32), readable from CPU memory, within the input limits, holding a whole number of
// samples within max_batch_size, DES finite; false otherwise (the Python path then names
// what is wrong).
bool read_dense_request(const NativePlan& plan, Scratch& s, TRITONBACKEND_Request* request,
                        const char* middle, TRITONSERVER_DataType type, int64_t size,
                        DenseRequest* r) {
  In des_in, mid_in, rows_in;
  if (!find(request, "DES", &des_in) || !find(request, middle, &mid_in) ||
      !find(request, "ROWINDEX", &rows_in)) {
    return false;
  }
  if (des_in.type != TRITONSERVER_TYPE_FP32 || rows_in.type != TRITONSERVER_TYPE_INT32 ||
      mid_in.type != type) {
    return false;
  }
  const int64_t n_des = static_cast<int64_t>(des_in.bytes / 4);
  r->n_middle = static_cast<int64_t>(mid_in.bytes) / size;
  r->n_rows = static_cast<int64_t>(rows_in.bytes / 4);
  r->tables = static_cast<int64_t>(plan.slots.size());
  if (n_des > plan.limit_des || r->n_middle > plan.limit_cat || r->n_rows > plan.limit_rows) {
    return false;
  }
  const int64_t extra = r->n_rows - r->tables;
  if (extra <= 0 || extra % plan.total_slots != 0) return false;
  r->samples = extra / plan.total_slots;
  if (r->samples > plan.max_batch_size || n_des != r->samples * plan.dense_dim) return false;
  r->des = static_cast<const float*>(data_of(des_in, &s.copy[0]));
  r->middle = data_of(mid_in, &s.copy[1]);
  r->rows = static_cast<const int32_t*>(data_of(rows_in, &s.copy[2]));
  if (r->des == nullptr || r->middle == nullptr || r->rows == nullptr) return false;
  return tr::all_finite(r->des, n_des);
}

// The hps interface: KEYS (INT64, table-major) and NUMKEYS (INT32 [T] or [1, T]).
// Every check of LookupSession.parse_request and of the input limits; on any failure
// kHandedOver (nothing sent): the Python path answers, naming what is wrong.
Native hps_path(const InstanceState& st, TRITONBACKEND_Request* request) {
  const NativePlan& plan = *st.plan;
  const ScratchLease lease;
  Scratch& s = *lease;
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
  return respond(st, request, {floats}, samples, [&](float* out, Defaults* d) {
    if (plan.gpu()) {
      hps_gpu(st, keys, n_keys, s.counts.data(), floats, out, exact == 1, d);
      return;
    }
    hps_starts(plan, s.counts.data(), &s.key_starts, &s.out_starts);  // each table's keys, answer
    // The units split across idle cores (each_unit): a table with a cache whole (HPS's
    // hit-rate rules weigh a request's keys of a table together), a mapped table's keys in
    // ranges of kRangeNs of work or more (a model of one large table looks a large request
    // up on every idle core).
    s.ranges.clear();
    int64_t work_ns = 0;
    for (int64_t t = 0; t < tables; ++t) {
      const size_t table = static_cast<size_t>(t);
      const int64_t n = s.counts[t], ns = lookup_ns(plan, table, n);
      const int64_t pieces = plan.tables[table].cache ? 1 : std::max<int64_t>(1, ns / kRangeNs);
      for (int64_t i = 0; i < pieces; ++i) {
        const int64_t first = n * i / pieces;
        s.ranges.push_back({table, first, n * (i + 1) / pieces - first});
      }
      work_ns += ns;
    }
    each_unit(s, work_ns, s.ranges.size(), d, false, [&](size_t u, TablePart& part) {
      const KeyRange& r = s.ranges[u];  // into the response
      lookup_table(st, r.table, keys + s.key_starts[r.table] + r.first, r.count,
                   out + s.out_starts[r.table] + r.first * plan.tables[r.table].dim, &part,
                   exact == 1);
    });
  });
}

// The hugectr interface: DES (FP32), CATCOLUMN (INT64 or UINT32, sample-major), ROWINDEX
// (INT32, one CSR block per table). Every check of parse_hugectr_request and of the input
// limits (else kHandedOver: the Python path names the problem); then per table the lookup and
// the slot combiner, and the dense network, all here.
Native hugectr_path(const InstanceState& st, TRITONBACKEND_Request* request) {
  const NativePlan& plan = *st.plan;
  const ScratchLease lease;
  Scratch& s = *lease;
  const auto key_type = plan.uint32_keys ? TRITONSERVER_TYPE_UINT32 : TRITONSERVER_TYPE_INT64;
  DenseRequest r;
  if (!read_dense_request(plan, s, request, "CATCOLUMN", key_type, plan.uint32_keys ? 4 : 8, &r)) {
    return Native::kHandedOver;
  }
  const int64_t n = r.samples, n_cat = r.n_middle, n_rows = r.n_rows, tables = r.tables;
  const float* des = r.des;
  const void* cat = r.middle;
  const int32_t* rows = r.rows;
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
  // upstream's [num_samples]; [num_samples, label_dim] for label_dim > 1 (RankingSession)
  std::vector<int64_t> shape{n};
  if (plan.label_dim > 1) shape.push_back(plan.label_dim);
  return respond(st, request, shape, n, [&](float* out, Defaults* d) {
    if (plan.gpu() && plan.dense_on_host(n)) {
      hugectr_gpu_host_dense(st, s, n, n_cat, des, out, exact == 1, d);
      return;
    }
    if (plan.gpu()) {
      hugectr_gpu(st, s, n, n_cat, n_rows, des, out, exact == 1, d);
      return;
    }
    s.looked_up.resize(static_cast<size_t>(tables));
    combine_and_predict(
        plan, s, n, des, out, d, true,
        [&](size_t t, int64_t first, int64_t count, TablePart& part) {
          // the table's own buffer: a one-hot table's vectors are the
          // network's input as they are (combine_table), so they must live
          // until the chunk's network has run
          auto& buf = s.looked_up[t];
          buf.resize(static_cast<size_t>(std::max<int64_t>(count * plan.tables[t].dim, 1)));
          lookup_table(st, t, s.keys.data() + s.key_starts[t] + first, count, buf.data(), &part,
                       exact == 1);
          return buf.data();
        });
  });
}

// The dense interface (the dense step of an hps -> dense ensemble): DES (FP32), EMBEDDINGS
// (FP32: the hps model's answer, every key's vector, table-major) and ROWINDEX (INT32, the
// hugectr layout counted within each table's keys). Every check of parse_embedding_request
// and of the input limits (else kHandedOver: the Python path names the problem); then per
// table the slot combiner and the dense network, as hugectr_path after its lookups.
Native dense_path(const InstanceState& st, TRITONBACKEND_Request* request) {
  const NativePlan& plan = *st.plan;
  const ScratchLease lease;
  Scratch& s = *lease;
  DenseRequest r;
  if (!read_dense_request(plan, s, request, "EMBEDDINGS", TRITONSERVER_TYPE_FP32, 4, &r)) {
    return Native::kHandedOver;
  }
  const int64_t n = r.samples, n_emb = r.n_middle, n_rows = r.n_rows, tables = r.tables;
  const float* des = r.des;
  const auto* emb = static_cast<const float*>(r.middle);
  const int32_t* rows = r.rows;
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
  if (!tr::all_finite(emb, n_emb)) return Native::kHandedOver;

  // Checked: from here on the request is answered here.
  return respond(st, request, {n * plan.label_dim}, n, [&](float* out, Defaults* d) {
    if (!plan.dense_on_host(n)) {
      dense_gpu(st, s, n, emb, n_emb, n_rows, des, out);
      return;
    }
    const std::vector<int64_t> voff = vector_offsets(plan, s);  // the tables' vectors
    combine_and_predict(plan, s, n, des, out, d, false,
                        [&](size_t t, int64_t first, int64_t, TablePart&) {
                          return emb + voff[t] + first * plan.vec_sizes[t];
                        });
  });
}

Native native_path(const InstanceState& st, TRITONBACKEND_Request* request) {
  if (st.plan->dense_only) return dense_path(st, request);
  return st.plan->hugectr ? hugectr_path(st, request) : hps_path(st, request);
}

}  // namespace trec_host
