// The GPU paths' host code run without a GPU (tests/unit/test_gpu_host_paths.py builds and
// runs it): gpu_paths.cpp's dense_gpu, hugectr_gpu, hps_gpu and lookup_tables, plan.cpp's
// upload_targets, gpu_ops.hpp's lookup_host and write_many, against the fake driver
// (fake_cuda.cpp), each answer compared with one computed on the host. hugectr_gpu also
// fails midway (finish_query or the inserts' flush throwing): no work may be left on a lane
// and the next answers must stay right. Exit status 0: every answer right, nothing left
// pending, no fault the driver saw.
// What it cannot check: real CUDA (graph capture, the kernels as the GPU compiler builds
// them and their argument ABI, timing); the network here is a linear stand-in run as the
// "graph", the engine's miss handling a stand-in finish_query.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "host.hpp"

extern "C" {
typedef void (*GraphRunner)(void* exec, int device);
void fake_set_graph_runner(GraphRunner r);
void fake_register(void* p, size_t bytes, const char* name);
void fake_register_on(void* p, size_t bytes, const char* name, int device);
long fake_device_work(int device);
int fake_errors();
int fake_pending();
}

namespace trec_host {
// plan.cpp names it on paths this harness does not take (reading a plan from Python)
std::string python_error() { return "python"; }
// plan.cpp's, not in host.hpp: the targets' device copies for the lookup and combine kernels
void upload_targets(NativePlan* plan);
}  // namespace trec_host

using namespace trec_host;
namespace xc = triton_rec::xcache;
namespace gpu = triton_rec::gpu;

static int g_fail = 0;
#define EXPECT(c, ...)                                     \
  do {                                                     \
    if (!(c)) {                                            \
      ++g_fail;                                            \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
    }                                                      \
  } while (0)

// the "table": every key's vector (exact in fp32)
static float vec(int64_t key, int64_t d) { return static_cast<float>(key % 1000) + 0.25f * d; }

// ---------------------------------------------------------------- the fake network
// A plan's graphs: exec handles (plan number << 16) + bucket + 1, run by run_graph.
static std::vector<NativePlan*> g_graph_plans;
static void network_rows(const NativePlan& plan, int64_t rows, const float* dense,
                         const std::vector<const float*>& emb, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t l = 0; l < plan.label_dim; ++l) {
      double acc = 0;
      for (int64_t j = 0; j < plan.dense_dim; ++j) acc += dense[i * plan.dense_dim + j] * (l + 1);
      for (size_t t = 0; t < plan.slots.size(); ++t) {
        const int64_t w = plan.slots[t] * plan.table_dim(t);
        for (int64_t k = 0; k < w; ++k) acc += emb[t][i * w + k] * (k + 1 + l);
      }
      out[i * plan.label_dim + l] = static_cast<float>(acc);
    }
  }
}
static void run_graph(void* exec, int device) {
  const auto h = reinterpret_cast<uintptr_t>(exec);
  const NativePlan& plan = *g_graph_plans.at(h >> 16);
  const size_t b = (h & 0xFFFF) - 1;
  EXPECT(plan.gpu_device == device, "a graph of device %d launched on device %d", plan.gpu_device,
         device);
  std::vector<const float*> emb;
  for (auto e : plan.emb_in) emb.push_back(reinterpret_cast<const float*>(e));
  network_rows(plan, plan.buckets[b].batch, reinterpret_cast<const float*>(plan.dense_in), emb,
               reinterpret_cast<float*>(plan.buckets[b].out));
}

// memory of the plan's device the harness makes (as CuPy does for the graphs)
static float* ext_alloc(size_t floats, const char* name, int device) {
  auto* p = static_cast<float*>(malloc(std::max<size_t>(floats, 1) * 4));
  for (size_t i = 0; i < floats; ++i) p[i] = NAN;
  fake_register_on(p, std::max<size_t>(floats, 1) * 4, name, device);
  return p;
}

static void add_graphs(NativePlan& plan) {
  const int d = plan.gpu_device;
  plan.dense_in =
      reinterpret_cast<uintptr_t>(ext_alloc(plan.max_batch_size * plan.dense_dim, "dense_in", d));
  for (size_t t = 0; t < plan.slots.size(); ++t) {
    plan.emb_in.push_back(reinterpret_cast<uintptr_t>(
        ext_alloc(plan.max_batch_size * plan.slots[t] * plan.table_dim(t), "emb_in", d)));
  }
  std::vector<int64_t> bs;
  for (int64_t b = 1; b < plan.max_batch_size; b *= 2) bs.push_back(b);
  bs.push_back(plan.max_batch_size);
  const uintptr_t base = g_graph_plans.size() << 16;
  g_graph_plans.push_back(&plan);
  for (size_t i = 0; i < bs.size(); ++i) {
    plan.buckets.push_back(
        {bs[i], reinterpret_cast<triton_rec::cuda::CUgraphExec>(base + i + 1),
         reinterpret_cast<uintptr_t>(ext_alloc(bs[i] * plan.label_dim, "out", d))});
  }
  fake_set_graph_runner(run_graph);
}

static void add_gpu(NativePlan& plan, int device = 0) {
  auto dev = std::make_shared<triton_rec::cuda::Device>(device);
  plan.gpu_device = plan.device_id = device;
  plan.kernels = std::make_shared<gpu::Kernels>(dev, std::string("fake"));
  plan.lane = std::make_unique<gpu::Lane>(plan.kernels);
}

// a request's ROWINDEX (widened, per table a block counted within its keys) and key counts
struct Rows {
  std::vector<int64_t> ptrs, key_starts;
};
static Rows make_rows(const NativePlan& plan, int64_t n, std::mt19937& rng, int maxnnz) {
  Rows r;
  r.key_starts.push_back(0);
  for (size_t t = 0; t < plan.slots.size(); ++t) {
    int64_t c = 0;
    r.ptrs.push_back(0);
    for (int64_t s = 0; s < n * plan.slots[t]; ++s) {
      c += static_cast<int64_t>(rng() % (maxnnz + 1));
      r.ptrs.push_back(c);
    }
    r.key_starts.push_back(r.key_starts.back() + c);
  }
  return r;
}

// a request's scratch: its row pointers and key counts, room for its keys
static Scratch scratch_of(const Rows& r) {
  Scratch s;
  s.ptrs = r.ptrs;
  s.key_starts = r.key_starts;
  s.keys.resize(std::max<int64_t>(r.key_starts.back(), 1));
  return s;
}

// expected predictions: host combine, then the network on n rows
static std::vector<float> expect(const NativePlan& plan, int64_t n, const Rows& r,
                                 const std::vector<float>& vectors, const std::vector<float>& des) {
  std::vector<std::vector<float>> comb(plan.slots.size());
  std::vector<const float*> emb;
  int64_t block = 0, voff = 0;
  for (size_t t = 0; t < plan.slots.size(); ++t) {
    const int64_t segs = n * plan.slots[t], dim = plan.table_dim(t);
    const int64_t count = r.key_starts[t + 1] - r.key_starts[t];
    comb[t].resize(segs * dim);
    tr::combine_segments(vectors.data() + voff, count, dim, r.ptrs.data() + block, segs,
                         plan.mean[t], comb[t].data());
    emb.push_back(comb[t].data());
    block += segs + 1;
    voff += count * dim;
  }
  std::vector<float> out(n * plan.label_dim);
  network_rows(plan, n, des.data(), emb, out.data());
  return out;
}

// ---------------------------------------------------------------- device caches
struct Cache {
  std::vector<int64_t> keys, ticks, seq, meta;
  std::vector<uint8_t> valid, vectors;
  xc::View v;
  Cache(int64_t sets, int64_t ways, int64_t dim) {
    keys.assign(sets * ways, 0);
    ticks.assign(sets * ways, 0);
    valid.assign(sets * ways, 0);
    vectors.assign(sets * ways * dim * 4, 0);
    seq.assign(sets, 0);
    meta.assign(xc::kMetaLen, 0);
    gpu::StateAddresses a;
    a.keys = (uintptr_t)keys.data();
    a.valid = (uintptr_t)valid.data();
    a.ticks = (uintptr_t)ticks.data();
    a.vectors = (uintptr_t)vectors.data();
    a.seq = (uintptr_t)seq.data();
    a.meta = (uintptr_t)meta.data();
    v = gpu::make_view(a, sets, ways, dim, 0, 0, 0);
  }
  // its state arrays: memory of `device`
  void register_on(int device) {
    fake_register_on(keys.data(), keys.size() * 8, "cache", device);
    fake_register_on(valid.data(), valid.size(), "cache", device);
    fake_register_on(ticks.data(), ticks.size() * 8, "cache", device);
    fake_register_on(vectors.data(), vectors.size(), "cache", device);
    fake_register_on(seq.data(), seq.size() * 8, "cache", device);
    fake_register_on(meta.data(), meta.size() * 8, "cache", device);
  }
  void insert(const std::vector<int64_t>& ks) {
    std::vector<float> rows;
    for (int64_t k : ks)
      for (int64_t d = 0; d < v.dim; ++d) rows.push_back(vec(k, d));
    int64_t counts[xc::kWriteCounts] = {};
    xc::twin_write_keys(v, xc::kModeInsert, ks.data(), ks.size(),
                        reinterpret_cast<const uint8_t*>(rows.data()), counts);
  }
  bool holds(int64_t k) {
    std::vector<float> o(v.dim);
    uint8_t st;
    xc::twin_query(v, &k, 1, o.data(), &st);
    return st == xc::kHit;
  }
};

static int g_throw_finish = 0, g_throw_flush = 0;
// the inserts' cache (as KernelInsert: write_many on a lane of its own)
struct FakeMissCache : tr::MissCache {
  Cache* c;
  gpu::Lane* lane;
  tr::RowFormat format() const override {
    return tr::RowFormat(tr::Precision::kFp32, static_cast<size_t>(c->v.dim));
  }
  void insert(const int64_t* keys, size_t n, const uint8_t* rows) const override {
    std::vector<int64_t> counts(xc::kWriteCounts);
    gpu::write_host(*lane, c->v, xc::kModeInsert, keys, n, rows, counts.data());
  }
  const void* kind() const override { return lane; }
  void insert_together(const tr::PendingInsert* parts, size_t n) const override {
    if (g_throw_flush) throw std::runtime_error("flush");
    std::vector<xc::WritePart> w(n);
    for (size_t i = 0; i < n; ++i) {
      w[i].view = static_cast<const FakeMissCache*>(parts[i].cache)->c->v;
      w[i].mode = xc::kModeInsert;
      w[i].keys = parts[i].keys;
      w[i].n = parts[i].n;
      w[i].rows = parts[i].rows;
    }
    std::vector<int64_t> counts(n * xc::kWriteCounts);
    gpu::write_many(*lane, w.data(), n, counts.data(), true, nullptr);
    inserted += n;
  }
  mutable size_t inserted = 0;
};
// each plan's tables' inserts
static std::map<const NativePlan*, std::vector<FakeMissCache*>> g_miss;
static int64_t g_missed_keys = 0;

namespace trec_host {
// the misses: each key's vector (the table), its row for the cache into `pending`
void finish_query(const InstanceState& st, size_t t, const int64_t* keys, int64_t n, float* out,
                  uint8_t* hit, int64_t, uint64_t, bool, Defaults*, tr::PendingInserts* pending) {
  const int64_t dim = st.plan->tables[t].dim;
  if (g_throw_finish && t == 1) throw std::runtime_error("finish");
  std::vector<int64_t> ks;
  std::vector<float> rows;
  for (int64_t i = 0; i < n; ++i) {
    if (hit[i]) continue;
    ++g_missed_keys;
    ks.push_back(keys[i]);
    for (int64_t d = 0; d < dim; ++d) {
      out[i * dim + d] = vec(keys[i], d);
      rows.push_back(vec(keys[i], d));
    }
  }
  const FakeMissCache* miss = g_miss.at(st.plan.get())[t];
  if (pending) {
    pending->add(miss, ks.data(), ks.size(), reinterpret_cast<const uint8_t*>(rows.data()),
                 st.plan->tables[t].stats);
  } else {
    miss->insert(ks.data(), ks.size(), reinterpret_cast<const uint8_t*>(rows.data()));
  }
}
}  // namespace trec_host

static std::vector<int64_t> g_stats(64);
// the plan's tables: a cache each on `pool`'s device, its inserts on `pool`
static void add_cache_tables(NativePlan& plan, std::vector<Cache*>& caches, gpu::Lane* pool,
                             const std::vector<int64_t>& dims) {
  g_miss[&plan].clear();  // (a plan of an earlier test may have had its address)
  for (size_t t = 0; t < dims.size(); ++t) {
    caches.push_back(new Cache(8192, 8, dims[t]));
    caches.back()->register_on(pool->kernels().device().ordinal());
    NativeTable nt;
    nt.dim = dims[t];
    nt.stats = g_stats.data();
    nt.device = true;
    nt.target.cache = 1;
    nt.target.view = caches.back()->v;
    plan.tables.push_back(nt);
    auto* m = new FakeMissCache;
    m->c = caches.back();
    m->lane = pool;
    g_miss[&plan].push_back(m);
  }
}

// ---------------------------------------------------------------- tests
static void test_dense(std::mt19937& rng) {
  InstanceState st;
  st.plan = std::make_unique<NativePlan>();
  NativePlan& plan = *st.plan;
  plan.hugectr = plan.dense_only = true;
  plan.slots = {2, 1, 3, 1};
  plan.vec_sizes = {4, 8, 2, 3};
  plan.mean = {false, true, true, false};
  for (auto s : plan.slots) plan.total_slots += s;
  plan.dense_dim = 5;
  plan.label_dim = 2;
  plan.max_batch_size = 40;
  add_gpu(plan);
  add_graphs(plan);
  upload_targets(&plan);
  for (int it = 0; it < 30; ++it) {
    const int64_t n = it < 3 ? 40 - it : 1 + rng() % 40;
    Rows r = make_rows(plan, n, rng, it % 5 == 4 ? 0 : 3);
    int64_t n_emb = 0;
    for (size_t t = 0; t < plan.slots.size(); ++t)
      n_emb += (r.key_starts[t + 1] - r.key_starts[t]) * plan.vec_sizes[t];
    std::vector<float> emb(n_emb), des(n * plan.dense_dim);
    for (auto& x : emb) x = static_cast<float>(rng() % 1000) / 8;
    for (auto& x : des) x = static_cast<float>(rng() % 1000) / 16;
    Scratch s;
    s.ptrs = r.ptrs;
    s.key_starts = r.key_starts;
    std::vector<float> got(n * plan.label_dim, -1);
    dense_gpu(st, s, n, emb.data(), n_emb, static_cast<int64_t>(r.ptrs.size()), des.data(),
              got.data());
    EXPECT(fake_pending() == 0, "dense_gpu left work pending");
    const auto want = expect(plan, n, r, emb, des);
    EXPECT(got == want, "dense_gpu n=%ld: answer differs (got[0]=%g want[0]=%g)", (long)n, got[0],
           want[0]);
  }
}

// The hugectr plans' shape: three cached tables of 2, 3 and 1 slots (sum, mean, sum), three
// dense features, one label, at most 33 samples.
static void hugectr_shape(NativePlan& plan) {
  plan.hugectr = true;
  plan.slots = {2, 3, 1};
  plan.mean = {false, true, false};
  for (auto s : plan.slots) plan.total_slots += s;
  plan.dense_dim = 3;
  plan.label_dim = 1;
  plan.max_batch_size = 33;
}

static void test_hugectr(std::mt19937& rng, gpu::Lane* pool) {
  InstanceState st;
  st.plan = std::make_unique<NativePlan>();
  NativePlan& plan = *st.plan;
  hugectr_shape(plan);
  std::vector<Cache*> caches;
  add_cache_tables(plan, caches, pool, {4, 2, 6});
  add_gpu(plan);
  add_graphs(plan);
  upload_targets(&plan);
  int failures = 0;
  for (int it = 0; it < 30; ++it) {
    const int64_t n = 1 + rng() % 33;
    Rows r = make_rows(plan, n, rng, 3);
    Scratch s = scratch_of(r);
    const int64_t n_cat = r.key_starts.back();
    for (int64_t i = 0; i < n_cat; ++i) s.keys[i] = static_cast<int64_t>(rng() % 3000);
    if (it % 3 == 2) {  // all hits: every key cached
      for (size_t t = 0; t < caches.size(); ++t) {
        std::vector<int64_t> ks(s.keys.begin() + r.key_starts[t],
                                s.keys.begin() + r.key_starts[t + 1]);
        caches[t]->insert(ks);
      }
    }
    std::vector<float> vectors, des(n * plan.dense_dim);
    for (size_t t = 0; t < caches.size(); ++t)
      for (int64_t i = r.key_starts[t]; i < r.key_starts[t + 1]; ++i)
        for (int64_t d = 0; d < plan.tables[t].dim; ++d) vectors.push_back(vec(s.keys[i], d));
    for (auto& x : des) x = static_cast<float>(rng() % 1000) / 16;
    std::vector<float> got(n * plan.label_dim, -1);
    Defaults d;
    const int64_t before = g_missed_keys;
    if (it % 5 == 1 || it % 5 == 3) {
      g_throw_finish = it % 5 == 1;
      g_throw_flush = it % 5 == 3;
      // the failure that must reach the caller: finish_query's on a miss of table 1, the
      // flush's on a miss of any table (no miss, no failure: the all-hits iterations)
      bool missed_1 = false, missed_any = false;
      for (size_t t = 0; t < caches.size(); ++t)
        for (int64_t i = r.key_starts[t]; i < r.key_starts[t + 1]; ++i)
          if (!caches[t]->holds(s.keys[i])) {
            missed_any = true;
            missed_1 = missed_1 || t == 1;
          }
      const std::string want_error =
          (g_throw_finish ? missed_1 : missed_any) ? (g_throw_finish ? "finish" : "flush") : "";
      bool threw = false;
      std::string error;
      try {
        hugectr_gpu(st, s, n, n_cat, static_cast<int64_t>(r.ptrs.size()), des.data(), got.data(),
                    true, &d);
      } catch (const std::exception& e) {
        threw = true;
        error = e.what();
      }
      g_throw_finish = g_throw_flush = 0;
      failures += threw;
      EXPECT(threw == !want_error.empty() && error == want_error,
             "hugectr_gpu it=%d: failed with '%s', expected '%s' (a failure swallowed or made up)",
             it, error.c_str(), want_error.c_str());
      EXPECT(fake_pending() == 0, "hugectr_gpu left work pending after a failure (it=%d threw=%d)",
             it, threw);
    }
    hugectr_gpu(st, s, n, n_cat, static_cast<int64_t>(r.ptrs.size()), des.data(), got.data(), true,
                &d);
    EXPECT(fake_pending() == 0, "hugectr_gpu left work pending");
    const auto want = expect(plan, n, r, vectors, des);
    EXPECT(got == want, "hugectr_gpu n=%ld it=%d misses=%ld: answer differs (got[0]=%g want[0]=%g)",
           (long)n, it, (long)(g_missed_keys - before), got[0], want[0]);
    for (size_t t = 0; t < caches.size(); ++t)  // the misses were inserted
      for (int64_t i = r.key_starts[t]; i < r.key_starts[t + 1]; ++i)
        EXPECT(caches[t]->holds(s.keys[i]), "hugectr_gpu: key %ld not inserted", (long)s.keys[i]);
  }
  EXPECT(failures > 0, "hugectr_gpu: no failing finish_query or flush was exercised");
}

static void test_hps(std::mt19937& rng, gpu::Lane* pool) {
  InstanceState st;
  st.plan = std::make_unique<NativePlan>();
  NativePlan& plan = *st.plan;
  std::vector<Cache*> caches;
  add_cache_tables(plan, caches, pool, {4, 1, 7});
  add_gpu(plan);
  upload_targets(&plan);
  for (int it = 0; it < 30; ++it) {
    std::vector<int32_t> counts;
    std::vector<int64_t> keys;
    int64_t floats = 0;
    for (size_t t = 0; t < caches.size(); ++t) {
      const int32_t c = it == 5 && t == 1 ? 0 : 1 + rng() % (it % 4 == 3 ? 3000 : 50);
      counts.push_back(c);
      for (int32_t i = 0; i < c; ++i) keys.push_back(rng() % 4000);
      floats += c * plan.tables[t].dim;
    }
    std::vector<float> got(floats, -1), want;
    size_t k = 0;
    for (size_t t = 0; t < caches.size(); ++t)
      for (int32_t i = 0; i < counts[t]; ++i, ++k)
        for (int64_t d = 0; d < plan.tables[t].dim; ++d) want.push_back(vec(keys[k], d));
    Defaults d;
    hps_gpu(st, keys.data(), keys.size(), counts.data(), floats, got.data(), true, &d);
    EXPECT(fake_pending() == 0, "hps_gpu left work pending");
    EXPECT(got == want, "hps_gpu it=%d: answer differs", it);
    k = 0;
    for (size_t t = 0; t < caches.size(); ++t)
      for (int32_t i = 0; i < counts[t]; ++i, ++k)
        EXPECT(caches[t]->holds(keys[k]), "hps_gpu: key %ld not inserted", (long)keys[k]);
  }
  // no keys at all (a hugectr request whose slots are all empty)
  std::vector<int64_t> ks(1), starts(caches.size() + 1, 0), outs(caches.size() + 1, 0);
  Looked r = lookup_tables(plan, ks.data(), starts.data(), outs.data());
  EXPECT(r.out != nullptr && fake_pending() == 0, "lookup_tables of no keys");
}

static void test_lookup_host(std::mt19937& rng, gpu::Lane* lane) {
  std::vector<Cache*> caches;
  for (int64_t dim : {3, 16}) caches.push_back(new Cache(4096, 8, dim));
  for (auto* c : caches) {
    c->register_on(lane->kernels().device().ordinal());
    std::vector<int64_t> ks;
    for (int64_t k = 0; k < 6000; k += 2) ks.push_back(k);  // even keys cached
    c->insert(ks);
  }
  auto& reg = gpu::PinnedRegistry::get();
  for (int64_t n : {1, 7, 4095, 4096, 4097, 9000}) {
    for (int pin = 0; pin < 4; ++pin) {
      for (int tables = 1; tables <= 2; ++tables) {
        std::vector<gpu::LookupTarget> tg(tables);
        std::vector<int64_t> ks_, os_;
        ks_.push_back(0);
        os_.push_back(0);
        for (int t = 0; t < tables; ++t) {
          tg[t].view = caches[t]->v;
          ks_.push_back(ks_.back() + n);
          os_.push_back(os_.back() + n * caches[t]->v.dim);
        }
        const size_t nk = ks_.back(), nf = os_.back();
        int64_t* keys = (pin & 1) ? static_cast<int64_t*>(reg.alloc(nk * 8)) : new int64_t[nk];
        float* out = (pin & 2) ? static_cast<float*>(reg.alloc(nf * 4)) : new float[nf];
        if (!(pin & 1)) fake_register(keys, nk * 8, "keys");
        if (!(pin & 2)) fake_register(out, nf * 4, "out");
        std::vector<uint8_t> status(nk, 9);
        for (size_t i = 0; i < nk; ++i) keys[i] = rng() % 6000;
        gpu::lookup_host(*lane, tg.data(), tables, keys, ks_.data(), os_.data(), out,
                         status.data());
        EXPECT(fake_pending() == 0, "lookup_host left work pending");
        size_t f = 0;
        bool ok = true;
        for (int t = 0; t < tables; ++t) {
          for (int64_t i = 0; i < n; ++i) {
            const int64_t key = keys[ks_[t] + i];
            const bool hit = key % 2 == 0;
            ok &= status[ks_[t] + i] == (hit ? xc::kHit : xc::kMiss);
            for (int64_t d = 0; d < caches[t]->v.dim; ++d, ++f)
              ok &= hit ? out[f] == vec(key, d) : out[f] == 0.0f;
          }
        }
        EXPECT(ok, "lookup_host n=%ld pin=%d tables=%d: wrong answers", (long)n, pin, tables);
      }
    }
  }
  // one table, the single-table overload
  int64_t key = 42;
  float o[3];
  uint8_t stt;
  fake_register(&key, 8, "k");
  fake_register(o, 12, "o");
  gpu::lookup_host(
      *lane,
      [&] {
        gpu::LookupTarget t;
        t.view = caches[0]->v;
        return t;
      }(),
      &key, 1, o, &stt);
  EXPECT(stt == xc::kHit && o[2] == vec(42, 2), "single lookup_host");
}

// ---------------------------------------------------------------- two devices
// An instance of one model on a device: its plan (kernels, lane, graphs), its caches and
// the lane of its inserts, all on that device.
struct Instance {
  InstanceState st;
  std::vector<Cache*> caches;
  std::unique_ptr<gpu::Lane> pool;
};

// One request to `in` (keys of parity `parity`: device 0's instance gets even keys, device
// 1's odd), checked: its answer, its work on its own device only, its misses in its caches.
static void serve_on(Instance& in, std::mt19937& rng, int parity, const char* how) {
  NativePlan& plan = *in.st.plan;
  const int dev = plan.gpu_device;
  const int64_t n = 1 + rng() % plan.max_batch_size;
  Rows r = make_rows(plan, n, rng, 3);
  Scratch s = scratch_of(r);
  const int64_t n_cat = r.key_starts.back();
  for (int64_t i = 0; i < n_cat; ++i) s.keys[i] = 2 * static_cast<int64_t>(rng() % 1500) + parity;
  std::vector<float> vectors, des(n * plan.dense_dim);
  for (size_t t = 0; t < in.caches.size(); ++t)
    for (int64_t i = r.key_starts[t]; i < r.key_starts[t + 1]; ++i)
      for (int64_t d = 0; d < plan.tables[t].dim; ++d) vectors.push_back(vec(s.keys[i], d));
  for (auto& x : des) x = static_cast<float>(rng() % 1000) / 16;
  std::vector<float> got(n * plan.label_dim, -1);
  Defaults d;
  const long before[2] = {fake_device_work(0), fake_device_work(1)};
  hugectr_gpu(in.st, s, n, n_cat, static_cast<int64_t>(r.ptrs.size()), des.data(), got.data(), true,
              &d);
  EXPECT(fake_pending() == 0, "two devices (%s): work left pending", how);
  EXPECT(got == expect(plan, n, r, vectors, des), "two devices (%s), device %d: answer differs",
         how, dev);
  EXPECT(fake_device_work(dev) > before[dev] && fake_device_work(1 - dev) == before[1 - dev],
         "two devices (%s): a request to device %d's instance ran %ld operations on device %d", how,
         dev, fake_device_work(1 - dev) - before[1 - dev], 1 - dev);
  for (size_t t = 0; t < in.caches.size(); ++t)
    for (int64_t i = r.key_starts[t]; i < r.key_starts[t + 1]; ++i)
      EXPECT(in.caches[t]->holds(s.keys[i]), "two devices: key %ld not in device %d's cache",
             (long)s.keys[i], dev);
}

static void test_two_devices(std::mt19937& rng) {
  Instance in[2];
  for (int d = 0; d < 2; ++d) {
    in[d].st.plan = std::make_unique<NativePlan>();
    NativePlan& plan = *in[d].st.plan;
    hugectr_shape(plan);
    add_gpu(plan, d);
    in[d].pool = std::make_unique<gpu::Lane>(plan.kernels);
    add_cache_tables(plan, in[d].caches, in[d].pool.get(), {4, 2, 6});
    add_graphs(plan);
  }
  // each plan's targets uploaded while the other device is current (as a thread that
  // loaded the other instance last would have it)
  for (int d = 0; d < 2; ++d) {
    in[1 - d].st.plan->kernels->device().make_current();
    upload_targets(in[d].st.plan.get());
  }
  for (int it = 0; it < 40; ++it) {
    const int d = it < 8 ? it % 2 : static_cast<int>(rng() % 2);
    if (it % 3 == 2) {  // a thread of its own, with no context current yet
      std::thread th([&] { serve_on(in[d], rng, d, "a fresh thread"); });
      th.join();
    } else {
      serve_on(in[d], rng, d, "one thread, devices in turn");
    }
  }
  for (int d = 0; d < 2; ++d)  // nothing of the other instance's keys in a device's caches
    for (size_t t = 0; t < in[d].caches.size(); ++t)
      for (int64_t k = 1 - d; k < 3000; k += 2)
        EXPECT(!in[d].caches[t]->holds(k), "two devices: device %d's cache holds key %ld", d,
               (long)k);
  EXPECT(fake_device_work(0) > 0 && fake_device_work(1) > 0, "two devices: a device did nothing");
}

// write_many under the shared lock (ArrayMissCache's first pass): a set another writer
// holds (its seq odd) is left as it is and its keys come back with their rows, the other
// keys are written; under the exclusive lock the same keys go in, and a set still odd then
// (its writer died) is healed.
static void test_busy_sets(gpu::Lane* lane) {
  Cache c(8, 8, 4);
  c.register_on(0);
  std::vector<int64_t> keys;
  for (int64_t k = 1; keys.size() < 12; ++k) keys.push_back(k);
  const int64_t held = xc::set_of(c.v, keys[0]);
  std::vector<float> rows;
  for (int64_t k : keys)
    for (int64_t d = 0; d < c.v.dim; ++d) rows.push_back(vec(k, d));
  c.seq[held] = 7;  // a writer is in the set
  const xc::WritePart part{c.v, xc::kModeInsert, keys.data(), (int64_t)keys.size(),
                           reinterpret_cast<const uint8_t*>(rows.data())};
  std::vector<int64_t> counts(xc::kWriteCounts, 0);
  xc::BusyWrites busy;
  gpu::write_many(*lane, &part, 1, counts.data(), false, &busy);
  std::vector<int64_t> expect_busy;
  for (int64_t k : keys)
    if (xc::set_of(c.v, k) == held) expect_busy.push_back(k);
  EXPECT(busy.parts.size() == 1 && busy.parts[0].part == 0 && busy.parts[0].keys == expect_busy,
         "busy: the held set's keys come back");
  EXPECT(c.seq[held] == 7, "busy: the held set is left as it is");
  bool rows_back = busy.parts.size() == 1;
  for (size_t i = 0; rows_back && i < busy.parts[0].keys.size(); ++i) {
    const float* r = reinterpret_cast<const float*>(busy.parts[0].rows.data()) + i * c.v.dim;
    for (int64_t d = 0; d < c.v.dim; ++d) rows_back = rows_back && r[d] == vec(expect_busy[i], d);
  }
  EXPECT(rows_back, "busy: the keys' rows come back with them");
  for (int64_t k : keys) {
    if (xc::set_of(c.v, k) != held) {
      EXPECT(c.holds(k), "busy: a key of a free set was written");
    }
  }
  if (busy.parts.size() != 1) return;
  const xc::BusyWrites::Part& left = busy.parts[0];
  const xc::WritePart again{c.v, xc::kModeInsert, left.keys.data(), (int64_t)left.keys.size(),
                            left.rows.data()};
  std::vector<int64_t> healed(xc::kWriteCounts, 0);
  gpu::write_many(*lane, &again, 1, healed.data(), true, nullptr);
  EXPECT(healed[xc::kWRecovered] == 1 && c.seq[held] == 8,
         "busy: the exclusive write heals the set");
  for (int64_t k : expect_busy) EXPECT(c.holds(k), "busy: the retried keys are written");
}

int main() {
  std::mt19937 rng(7);
  auto dev = std::make_shared<triton_rec::cuda::Device>(0);
  auto kernels = std::make_shared<gpu::Kernels>(dev, std::string("fake"));
  gpu::Lane pool(kernels), other(kernels);
  test_dense(rng);
  test_hugectr(rng, &pool);
  test_hps(rng, &pool);
  test_lookup_host(rng, &other);
  test_two_devices(rng);
  test_busy_sets(&other);
  printf("failures %d, driver reports %d\n", g_fail, fake_errors());
  return g_fail + fake_errors() ? 1 : 0;
}
