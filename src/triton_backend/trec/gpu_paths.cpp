// The hot paths on a GPU instance (KIND_GPU): the instance's stream, keys in, one launch
// for every table's lookups, the caches' inserts of a request in one write, the network as
// CUDA graphs.
#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "host.hpp"
#include "request_kernels.hpp"

namespace trec_host {

// The inserts of a GPU request's caches (a node-local table's misses fetched for them),
// gathered while its tables are settled and written together after the last (one write,
// one synchronization, instead of a round trip per table): this thread's, emptied.
tr::PendingInserts& request_inserts() {
  thread_local tr::PendingInserts pending;
  pending.clear();  // what a request that failed midway left
  return pending;
}

// After table t's lookup on the GPU (its statuses and answers in host memory): the table's
// statistics, and a cache's misses answered by HPS's rules (finish_query: LocalMisses for
// a node-local table, its inserts into `pending`; else the engine; their answers written
// into `out`).
void settle_gpu_table(const InstanceState& st, size_t t, const int64_t* keys, int64_t n, float* out,
                      uint8_t* status, uint64_t ns, bool exact, Defaults* d,
                      tr::PendingInserts* pending) {
  const NativeTable& nt = st.plan->tables[t];
  int64_t hits = 0, corrupt = 0;
  for (int64_t i = 0; i < n; ++i) {
    hits += status[i] == tr::xcache::kHit;
    corrupt += status[i] == tr::xcache::kCorrupt;
  }
  if (!nt.target.cache) {  // static / uvm: the whole table; what it lacks no tier holds
    if (corrupt != 0) throw std::runtime_error("corrupt device table: a slot names no row");
    const int64_t absent = n - hits;
    nt.count_not_found(absent, d);
    nt.count(tr::kLookups, n);
    nt.count(tr::kHits, hits);
    nt.count(tr::kMisses, absent);
    nt.count(tr::kCacheNs, static_cast<int64_t>(ns));
    return;
  }
  if (hits == n) {
    nt.count_cache_hits(n, ns);
    return;
  }
  for (int64_t i = 0; i < n; ++i) status[i] = status[i] == tr::xcache::kHit;  // torn: a miss
  finish_query(st, t, keys, n, out, status, hits, ns, exact, d, pending);
}

// Every table of a request settled after its lookups on the GPU (settle_gpu_table): table t's
// keys from key_starts[t], its vectors from vectors + voff[t] and statuses from status +
// key_starts[t]; the caches' inserts of the request gathered (request_inserts) and written
// together after the last table (one write, one synchronization). settled(t) runs after
// table t is settled, before_flush() after the last, before the write.
template <typename Settled, typename BeforeFlush>
void settle_tables(const InstanceState& st, const int64_t* keys, const int64_t* key_starts,
                   float* vectors, const int64_t* voff, uint8_t* status, uint64_t ns, bool exact,
                   Defaults* d, Settled&& settled, BeforeFlush&& before_flush) {
  tr::PendingInserts& pending = request_inserts();
  for (size_t t = 0; t < st.plan->tables.size(); ++t) {
    const int64_t first = key_starts[t];
    settle_gpu_table(st, t, keys + first, key_starts[t + 1] - first, vectors + voff[t],
                     status + first, ns, exact, d, &pending);
    settled(t);
  }
  before_flush();
  pending.flush();
}
// The same, with nothing to do between.
void settle_tables(const InstanceState& st, const int64_t* keys, const int64_t* key_starts,
                   float* vectors, const int64_t* voff, uint8_t* status, uint64_t ns, bool exact,
                   Defaults* d) {
  settle_tables(st, keys, key_starts, vectors, voff, status, ns, exact, d, [](size_t) {}, [] {});
}

// The lookups of every table of a request on the GPU, host to host: keys[0..key_starts[T])
// (table t's from key_starts[t]) through pinned staging, one copy in (the keys and their
// spans), one launch for every table, one copy out (the answers and the statuses lie one
// after the other), one synchronization. The staging is valid until the lane's next use.
Looked lookup_tables(const NativePlan& plan, const int64_t* keys, const int64_t* key_starts,
                     const int64_t* out_starts) {
  tr::gpu::Lane& lane = *plan.lane;
  const auto entered = lane.enter();
  const size_t tables = plan.tables.size();
  const auto n_keys = static_cast<size_t>(key_starts[tables]);
  const size_t kb = n_keys * 8, fb = static_cast<size_t>(out_starts[tables]) * 4;
  const tr::gpu::Lane::Parts parts{kb, tr::gpu::lookup_spans_bytes(tables), fb, n_keys};
  char* h = lane.host(parts);
  const tr::cuda::CUdeviceptr dv = lane.device(parts);
  const auto& o = parts.offsets;
  const uint64_t t0 = now_ns();
  std::memcpy(h, keys, kb);
  tr::gpu::fill_lookup_spans(reinterpret_cast<int64_t*>(h + o[1]), key_starts, out_starts, tables);
  lane.to_device(dv, h, o[2]);  // the keys and their spans
  tr::gpu::launch_lookups(lane, plan.targets.ptr(), tables, dv + o[1], key_starts, dv, dv + o[2],
                          dv + o[3]);
  lane.to_host(h + o[2], dv + o[2], (o[3] - o[2]) + n_keys);
  lane.sync();
  return {reinterpret_cast<float*>(h + o[2]), reinterpret_cast<uint8_t*>(h + o[3]), now_ns() - t0};
}

// An hps request on the GPU: keys[0..n_keys) of every table -> answer (floats): the
// lookups (lookup_tables), each table settled, the caches' inserts written together.
void hps_gpu(const InstanceState& st, const int64_t* keys, int64_t n_keys, const int32_t* counts,
             int64_t floats, float* answer, bool exact, Defaults* d) {
  const NativePlan& plan = *st.plan;
  const size_t tables = plan.tables.size();
  thread_local std::vector<int64_t> key_starts, out_starts;
  hps_starts(plan, counts, &key_starts, &out_starts);
  if (key_starts[tables] != n_keys || out_starts[tables] != floats) {
    throw std::logic_error("hps_gpu: the counts disagree with the request's sizes");
  }
  const Looked r = lookup_tables(plan, keys, key_starts.data(), out_starts.data());
  settle_tables(st, keys, key_starts.data(), r.out, out_starts.data(), r.status, r.ns, exact, d);
  std::memcpy(answer, r.out, static_cast<size_t>(floats) * 4);
}

// A hugectr request of few samples (at most host_max_batch) on a GPU instance: the lookups
// on the GPU (the cache), then the slots combined and the network run on the host, where
// such a batch is fastest (DenseGraphs.calibrate).
void hugectr_gpu_host_dense(const InstanceState& st, Scratch& s, int64_t n, int64_t n_cat,
                            const float* des, float* answer, bool exact, Defaults* d) {
  const NativePlan& plan = *st.plan;
  const size_t tables = plan.tables.size();
  const std::vector<int64_t> voff = vector_offsets(plan, s);
  if (s.key_starts[tables] != n_cat) {
    throw std::logic_error("hugectr_gpu_host_dense: the key starts disagree with CATCOLUMN");
  }
  const Looked r = lookup_tables(plan, s.keys.data(), s.key_starts.data(), voff.data());
  settle_tables(st, s.keys.data(), s.key_starts.data(), r.out, voff.data(), r.status, r.ns, exact,
                d);
  combine_and_predict(plan, s, n, des, answer, d, false,
                      [&](size_t t, int64_t first, int64_t, TablePart&) {
                        return r.out + voff[t] + first * plan.table_dim(t);
                      });
}

// Where the combiner of a request of n samples works (trec_combine_tables' spans): each
// table's elements (slots x vector width), from elem[t], and row pointers, from ptr[t].
struct CombineStarts {
  std::vector<int64_t> elem, ptr;
};
const CombineStarts& combine_starts(const NativePlan& plan, int64_t n) {
  thread_local CombineStarts c;
  const size_t tables = plan.slots.size();
  c.elem.assign(tables + 1, 0);
  c.ptr.assign(tables + 1, 0);
  for (size_t t = 0; t < tables; ++t) {
    const int64_t segments = n * plan.slots[t];
    c.elem[t + 1] = c.elem[t] + segments * plan.table_dim(t);
    c.ptr[t + 1] = c.ptr[t] + segments + 1;
  }
  return c;
}

// The network's graph for the smallest bucket that holds n samples (found: read_dense_gpu
// refuses a plan whose last bucket is below max_batch_size, and requests above it are
// refused before they get here).
const NativePlan::Bucket& bucket_for(const NativePlan& plan, int64_t n) {
  return *std::find_if(plan.buckets.begin(), plan.buckets.end(),
                       [&](const auto& b) { return b.batch >= n; });
}

// A hugectr request on the GPU (keys regrouped by table in s.keys, row pointers in s.ptrs,
// rows rows of them): the lookups of every table in one launch, every table's slots combined
// into the network's input in one launch, the network's graph for the smallest bucket that
// holds n samples, one synchronization. When a cache missed, the host answers its misses
// (settle_tables) into the pinned staging at their places and trec_scatter_rows copies just
// those rows to the device; then the slots and the network run. The network runs before
// the statuses are known (one synchronization) while the plan's last request did not miss,
// and again when this one did; after a request that missed, only once, after the misses.
void hugectr_gpu(const InstanceState& st, const Scratch& s, int64_t n, int64_t n_cat, int64_t rows,
                 const float* des, float* answer, bool exact, Defaults* d) {
  const NativePlan& plan = *st.plan;
  tr::gpu::Lane& lane = *plan.lane;
  const auto entered = lane.enter();
  const size_t tables = plan.tables.size();
  const std::vector<int64_t> voff = vector_offsets(plan, s);
  const CombineStarts& starts = combine_starts(plan, n);
  const size_t kb = static_cast<size_t>(n_cat) * 8, pb = static_cast<size_t>(rows) * 8;
  const size_t db = static_cast<size_t>(n * plan.dense_dim) * 4;
  const size_t vb = static_cast<size_t>(voff[tables]) * 4,
               ob = static_cast<size_t>(n * plan.label_dim) * 4;
  const tr::gpu::Lane::Parts parts{kb,
                                   tr::gpu::lookup_spans_bytes(tables),
                                   tr::gpu::combine_spans_bytes(tables),
                                   pb,
                                   db,
                                   vb,
                                   static_cast<size_t>(n_cat),
                                   ob};
  char* h = lane.host(parts);
  const tr::cuda::CUdeviceptr dv = lane.device(parts);
  const auto& o = parts.offsets;
  const uint64_t t0 = now_ns();
  std::memcpy(h, s.keys.data(), kb);
  tr::gpu::fill_lookup_spans(reinterpret_cast<int64_t*>(h + o[1]), s.key_starts.data(), voff.data(),
                             tables);
  tr::gpu::fill_combine_spans(reinterpret_cast<int64_t*>(h + o[2]), starts.elem.data(), voff.data(),
                              starts.ptr.data(), tables);
  std::memcpy(h + o[3], s.ptrs.data(), pb);
  std::memcpy(h + o[4], des, db);
  lane.to_device(dv, h, o[4]);  // keys, spans and row pointers
  lane.to_device(plan.dense_in, h + o[4], db);
  tr::gpu::launch_lookups(lane, plan.targets.ptr(), tables, dv + o[1], s.key_starts.data(), dv,
                          dv + o[5], dv + o[6]);
  const NativePlan::Bucket& bucket = bucket_for(plan, n);
  auto dense = [&] {
    tr::gpu::launch_combines(lane, plan.combines.ptr(), tables, dv + o[2], starts.elem.data(),
                             dv + o[5], dv + o[3]);
    tr::gpu::launch_graph(lane, bucket.graph);
    lane.to_host(h + o[7], bucket.out, ob);
  };
  const bool early = !plan.last_missed.load(std::memory_order_relaxed);
  if (early) dense();
  lane.to_host(h + o[6], dv + o[6], static_cast<size_t>(n_cat));
  lane.sync();
  const uint64_t ns = now_ns() - t0;
  auto* status = reinterpret_cast<uint8_t*>(h + o[6]);
  auto* vectors = reinterpret_cast<float*>(h + o[5]);
  // The keys' staging is free once they are on the device: each missed cache's rows to copy
  // (the keys that did not hit, as indices into its answer), from its first key's place.
  auto* missed_rows = reinterpret_cast<int64_t*>(h);
  std::vector<int64_t> missed(tables, 0);  // rows to copy of each table
  bool any = false;
  for (size_t t = 0; t < tables; ++t) {
    if (!plan.tables[t].target.cache) continue;  // a whole table: answered on the device
    const int64_t first = s.key_starts[t], m = s.key_starts[t + 1] - first;
    int64_t k = 0;
    for (int64_t i = 0; i < m; ++i) {
      if (status[first + i] != tr::xcache::kHit) missed_rows[first + k++] = i;
    }
    missed[t] = k;
    any = any || k > 0;
  }
  plan.last_missed.store(any, std::memory_order_relaxed);
  const tr::cuda::CUdeviceptr mapped = any ? lane.mapped(h) : 0;
  settle_tables(
      st, s.keys.data(), s.key_starts.data(), vectors, voff.data(), status, ns, exact, d,
      [&](size_t t) {  // the rows the host answered for a cache's misses, to the device
        const int64_t f = voff[t] * 4;
        tr::gpu::launch_scatter_rows(lane, dv + o[5] + f, mapped + o[5] + f,
                                     mapped + s.key_starts[t] * 8, missed[t],
                                     static_cast<int32_t>(plan.tables[t].dim));
      },
      [&] {
        // the slots and the network (again), on the instance's stream, while the inserts
        // are written on another (a failure of the write waits for the lane: `entered`)
        if (any || !early) dense();
      });
  if (any || !early) lane.sync();
  std::memcpy(answer, h + o[7], ob);
}

// A dense request on the GPU: the looked-up vectors (n_emb floats, table-major as the hps
// model answered them), the row pointers (s.ptrs, rows of them, counted within each
// table's keys as in s.key_starts) and DES through pinned staging in one copy and one
// more, every table's slots combined in one launch, the graph of the smallest bucket that
// holds n samples, one copy out, one synchronization.
void dense_gpu(const InstanceState& st, const Scratch& s, int64_t n, const float* emb,
               int64_t n_emb, int64_t rows, const float* des, float* answer) {
  const NativePlan& plan = *st.plan;
  tr::gpu::Lane& lane = *plan.lane;
  const auto entered = lane.enter();
  const size_t tables = plan.slots.size();
  const std::vector<int64_t> voff = vector_offsets(plan, s);  // each table's first float
  const CombineStarts& starts = combine_starts(plan, n);
  const size_t pb = static_cast<size_t>(rows) * 8, eb = static_cast<size_t>(n_emb) * 4;
  const size_t db = static_cast<size_t>(n * plan.dense_dim) * 4,
               ob = static_cast<size_t>(n * plan.label_dim) * 4;
  const tr::gpu::Lane::Parts parts{tr::gpu::combine_spans_bytes(tables), pb, eb, db, ob};
  char* h = lane.host(parts);
  const tr::cuda::CUdeviceptr dv = lane.device(parts);
  const auto& o = parts.offsets;
  tr::gpu::fill_combine_spans(reinterpret_cast<int64_t*>(h), starts.elem.data(), voff.data(),
                              starts.ptr.data(), tables);
  std::memcpy(h + o[1], s.ptrs.data(), pb);
  std::memcpy(h + o[2], emb, eb);
  std::memcpy(h + o[3], des, db);
  lane.to_device(dv, h, o[3]);  // spans, row pointers and vectors
  lane.to_device(plan.dense_in, h + o[3], db);
  tr::gpu::launch_combines(lane, plan.combines.ptr(), tables, dv, starts.elem.data(), dv + o[2],
                           dv + o[1]);
  const NativePlan::Bucket& bucket = bucket_for(plan, n);
  tr::gpu::launch_graph(lane, bucket.graph);
  lane.to_host(h + o[4], bucket.out, ob);
  lane.sync();
  std::memcpy(answer, h + o[4], ob);
}

}  // namespace trec_host
