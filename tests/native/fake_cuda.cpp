// A fake libcuda.so.1 for tests/native/gpu_host_paths.cpp (tests/unit/test_gpu_host_paths.py
// builds both): the GPU paths' host code (gpu_paths.cpp, plan.cpp, gpu_ops.hpp) runs against
// it on a machine without a GPU. Device memory is host memory; every copy and kernel argument
// is checked against its allocation (cuMemAlloc, cuMemHostAlloc, or one the harness registers:
// fake_register); a stream's work is queued and runs only at a synchronization, so a result
// read before it, or staging changed while a copy from it is pending, shows (FAKE_POISON=1:
// a copy to the host fills its destination with garbage until it runs); the kernels are CPU
// versions of src/native/kernels/cache_kernels.cu (lookup and write: array_cache_twin.hpp);
// graphs run by the harness's runner (fake_set_graph_runner). What went wrong is printed
// and counted (fake_errors).
// What it cannot check: real CUDA (graph capture, the kernels as compiled for the GPU and
// their argument ABI as the GPU compiler sees it, concurrency between streams, timing).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "array_cache_twin.hpp"
#include "cuda_driver.hpp"
#include "request_kernels.hpp"

namespace xc = triton_rec::xcache;
namespace cu = triton_rec::cuda;
using cu::CUdeviceptr;
using cu::CUresult;

struct Region {
  size_t bytes;
  int kind;  // 0 device, 1 pinned host, 2 external (registered by the harness)
  std::string name;
};
static std::map<uintptr_t, Region> g_regions;
static int g_errors = 0;
static bool g_poison = getenv("FAKE_POISON") && atoi(getenv("FAKE_POISON"));

static void report(const std::string& s) {
  ++g_errors;
  fprintf(stderr, "FAKECUDA: %s\n", s.c_str());
}

static const Region* region_of(uintptr_t p, size_t bytes, uintptr_t* base = nullptr) {
  auto it = g_regions.upper_bound(p);
  if (it == g_regions.begin()) return nullptr;
  --it;
  if (p + bytes > it->first + it->second.bytes) return nullptr;
  if (base) *base = it->first;
  return &it->second;
}

static void check(const void* p, size_t bytes, const char* what, int want_kind = -1) {
  if (bytes == 0) return;
  const Region* r = region_of(reinterpret_cast<uintptr_t>(p), bytes);
  if (r == nullptr) {
    char b[256];
    snprintf(b, sizeof b, "%s: [%p, +%zu) lies in no allocation", what, p, bytes);
    report(b);
  } else if (want_kind >= 0 && r->kind != want_kind && !(want_kind == 0 && r->kind == 2)) {
    char b[256];
    snprintf(b, sizeof b, "%s: [%p, +%zu) is of kind %d (%s), not %d", what, p, bytes, r->kind,
             r->name.c_str(), want_kind);
    report(b);
  }
}

struct Op {
  std::function<void()> run;
  std::vector<std::pair<uintptr_t, size_t>> touches;  // host/device ranges it uses
  std::string what;
};
struct Stream {
  std::deque<Op> q;
};
static std::vector<Stream*> g_streams;

static void flush(Stream* s) {
  while (!s->q.empty()) {
    Op op = std::move(s->q.front());
    s->q.pop_front();
    op.run();
  }
}

static void pending_touching(uintptr_t p, const char* what) {
  for (Stream* s : g_streams) {
    for (const Op& op : s->q) {
      for (auto& t : op.touches) {
        auto it = g_regions.find(p);
        size_t bytes = it != g_regions.end() ? it->second.bytes : 1;
        if (t.first < p + bytes && p < t.first + t.second) {
          report(std::string(what) + " of memory a pending " + op.what + " uses");
        }
      }
    }
  }
}

template <class T>
static T arg(void** args, int i) {
  T v;
  memcpy(&v, args[i], sizeof(T));
  return v;
}

extern "C" {
typedef void (*GraphRunner)(void* exec);
static GraphRunner g_graph_runner = nullptr;
void fake_set_graph_runner(GraphRunner r) { g_graph_runner = r; }
void fake_register(void* p, size_t bytes, const char* name) {
  g_regions[reinterpret_cast<uintptr_t>(p)] = Region{bytes, 2, name};
}
int fake_errors() { return g_errors; }
int fake_pending() {
  int n = 0;
  for (Stream* s : g_streams) n += static_cast<int>(s->q.size());
  return n;
}

CUresult cuGetErrorString(CUresult, const char** s) {
  *s = "fake";
  return 0;
}
CUresult cuGetErrorName(CUresult, const char** s) {
  *s = "FAKE";
  return 0;
}
CUresult cuInit(unsigned) { return 0; }
CUresult cuDriverGetVersion(int* v) {
  *v = 12040;
  return 0;
}
CUresult cuDeviceGetCount(int* c) {
  *c = 1;
  return 0;
}
CUresult cuDeviceGet(int* d, int o) {
  *d = o;
  return 0;
}
CUresult cuDeviceGetAttribute(int* v, int a, int) {
  *v = a == cu::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT ? 4 : 9;
  return 0;
}
CUresult cuDeviceGetName(char* n, int len, int) {
  snprintf(n, len, "fake");
  return 0;
}
static int g_ctx;
CUresult cuDevicePrimaryCtxRetain(void** c, int) {
  *c = &g_ctx;
  return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int) { return 0; }
static void* g_current = nullptr;
CUresult cuCtxSetCurrent(void* c) {
  g_current = c;
  return 0;
}
CUresult cuCtxGetCurrent(void** c) {
  *c = g_current;
  return 0;
}
static int g_module;
CUresult cuModuleLoadData(void** m, const void*) {
  *m = &g_module;
  return 0;
}
CUresult cuModuleUnload(void*) { return 0; }
CUresult cuModuleGetFunction(void** f, void*, const char* name) {
  *f = strdup(name);
  return 0;
}
CUresult cuStreamCreate(void** s, unsigned) {
  Stream* st = new Stream;
  g_streams.push_back(st);
  *s = st;
  return 0;
}
CUresult cuStreamDestroy_v2(void* s) {
  flush(static_cast<Stream*>(s));
  return 0;
}
CUresult cuStreamSynchronize(void* s) {
  flush(static_cast<Stream*>(s));
  return 0;
}
struct Event {
  Stream* s = nullptr;
};
CUresult cuEventCreate(void** e, unsigned) {
  *e = new Event;
  return 0;
}
CUresult cuEventDestroy_v2(void* e) {
  delete static_cast<Event*>(e);
  return 0;
}
CUresult cuEventRecord(void* e, void* s) {
  static_cast<Event*>(e)->s = static_cast<Stream*>(s);
  return 0;
}
CUresult cuEventQuery(void* e) {
  if (static_cast<Event*>(e)->s) flush(static_cast<Event*>(e)->s);
  return 0;
}
CUresult cuEventSynchronize(void* e) { return cuEventQuery(e); }
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
  void* m = malloc(bytes);
  memset(m, 0xEE, bytes);
  g_regions[reinterpret_cast<uintptr_t>(m)] = Region{bytes, 0, "device"};
  *p = reinterpret_cast<CUdeviceptr>(m);
  return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  pending_touching(p, "cuMemFree");
  g_regions.erase(p);
  free(reinterpret_cast<void*>(p));
  return 0;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
  void* m = malloc(bytes);
  memset(m, 0xDD, bytes);
  g_regions[reinterpret_cast<uintptr_t>(m)] = Region{bytes, 1, "pinned"};
  *p = m;
  return 0;
}
CUresult cuMemFreeHost(void* p) {
  pending_touching(reinterpret_cast<uintptr_t>(p), "cuMemFreeHost");
  g_regions.erase(reinterpret_cast<uintptr_t>(p));
  free(p);
  return 0;
}
CUresult cuMemHostRegister_v2(void*, size_t, unsigned) { return 0; }
CUresult cuMemHostUnregister(void*) { return 0; }
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned) {
  *d = reinterpret_cast<CUdeviceptr>(p);
  return 0;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
  check(reinterpret_cast<void*>(dst), n, "HtoD dst", 0);
  // From memory no allocation holds (pageable: a std::vector), CUDA copies at once
  const bool pageable = region_of(reinterpret_cast<uintptr_t>(src), 1) == nullptr;
  if (!pageable) check(src, n, "HtoD src");
  auto snap = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                  static_cast<const char*>(src) + n);
  Op op;
  op.what = "HtoD copy";
  op.touches = {{dst, n}};
  if (!pageable) op.touches.push_back({reinterpret_cast<uintptr_t>(src), n});
  op.run = [=] {
    if (g_poison || pageable) {
      memcpy(reinterpret_cast<void*>(dst), snap->data(), n);
    } else {
      if (memcmp(src, snap->data(), n) != 0) {
        char b[200];
        snprintf(b, sizeof b, "HtoD source %p (+%zu) changed while the copy was pending", src, n);
        report(b);
      }
      memcpy(reinterpret_cast<void*>(dst), src, n);
    }
  };
  static_cast<Stream*>(s)->q.push_back(std::move(op));
  return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
  check(dst, n, "DtoH dst");
  check(reinterpret_cast<void*>(src), n, "DtoH src", 0);
  if (g_poison) memset(dst, 0x7F, n);  // NaN-ish floats until the copy runs
  Op op;
  op.what = "DtoH copy";
  op.touches = {{reinterpret_cast<uintptr_t>(dst), n}, {src, n}};
  op.run = [=] { memcpy(dst, reinterpret_cast<void*>(src), n); };
  static_cast<Stream*>(s)->q.push_back(std::move(op));
  return 0;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s2, size_t n, void* s) {
  Op op;
  op.what = "DtoD";
  op.run = [=] { memcpy(reinterpret_cast<void*>(d), reinterpret_cast<void*>(s2), n); };
  static_cast<Stream*>(s)->q.push_back(std::move(op));
  return 0;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void* s) {
  Op op;
  op.what = "memset";
  op.run = [=] { memset(reinterpret_cast<void*>(d), v, n); };
  static_cast<Stream*>(s)->q.push_back(std::move(op));
  return 0;
}
CUresult cuPointerGetAttribute(void* out, int, CUdeviceptr p) {
  const Region* r = region_of(p, 1);
  *static_cast<unsigned*>(out) =
      r && r->kind == 1 ? cu::CU_MEMORYTYPE_HOST : cu::CU_MEMORYTYPE_DEVICE;
  return r ? 0 : 1;
}
CUresult cuStreamBeginCapture_v2(void*, int) { return 0; }
CUresult cuStreamEndCapture(void*, void**) { return 0; }
CUresult cuGraphInstantiateWithFlags(void**, void*, unsigned long long) { return 0; }
CUresult cuGraphLaunch(void* exec, void* s) {
  Op op;
  op.what = "graph";
  op.run = [=] { g_graph_runner(exec); };
  static_cast<Stream*>(s)->q.push_back(std::move(op));
  return 0;
}
CUresult cuGraphDestroy(void*) { return 0; }
CUresult cuGraphExecDestroy(void*) { return 0; }

CUresult cuLaunchKernel(void* f, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void* s, void** args, void**) {
  const std::string name = static_cast<const char*>(f);
  Op op;
  op.what = name;
  if (name == "trec_lookup_tables") {
    auto tg = arg<const xc::LookupTarget*>(args, 0);
    auto sp = arg<const int64_t*>(args, 1);
    auto m = arg<int32_t>(args, 2);
    auto keys = arg<const int64_t*>(args, 3);
    auto out = arg<float*>(args, 4);
    auto status = arg<uint8_t*>(args, 5);
    op.run = [=] {
      check(tg, m * sizeof(xc::LookupTarget), "lookup targets", 0);
      check(sp, (2 * m + 1) * 8, "lookup spans", 0);
      const int64_t a = sp[0], b = sp[2 * m];
      check(keys + a, (b - a) * 8, "lookup keys", 0);
      check(status + a, b - a, "lookup status", 0);
      for (int t = 0; t < m; ++t) {
        const int64_t n = sp[2 * t + 2] - sp[2 * t];
        check(out + sp[2 * t + 1], n * tg[t].dim() * 4, "lookup out", 0);
      }
      xc::twin_lookup_tables(tg, sp, m, keys, out, status);
    };
  } else if (name == "trec_combine_tables") {
    auto tg = arg<const xc::CombineTarget*>(args, 0);
    auto sp = arg<const int64_t*>(args, 1);
    auto m = arg<int32_t>(args, 2);
    auto vectors = arg<const float*>(args, 3);
    auto ptr = arg<const int64_t*>(args, 4);
    op.run = [=] {
      check(tg, m * sizeof(xc::CombineTarget), "combine targets", 0);
      check(sp, (3 * m + 1) * 8, "combine spans", 0);
      // each table's slots by the host's combiner, whose sums the kernel repeats
      for (int t = 0; t < m; ++t) {
        const xc::CombineTarget c = tg[t];
        const int64_t elements = sp[3 * t + 3] - sp[3 * t];
        if (elements % c.dim != 0) report("combine: a table's elements are not whole slots");
        const int64_t segments = elements / c.dim;
        const float* v = vectors + sp[3 * t + 1];
        const int64_t* p = ptr + sp[3 * t + 2];
        check(p, (segments + 1) * 8, "combine row pointers", 0);
        const int64_t rows = segments > 0 ? p[segments] : 0;
        check(v, rows * c.dim * 4, "combine vectors", 0);
        check(c.out, elements * 4, "combine out", 0);
        if (!triton_rec::combine_segments(v, rows, c.dim, p, segments, c.mean, c.out)) {
          report("combine: row pointers out of order");
        }
      }
    };
  } else if (name == "trec_cache_write") {
    auto v = arg<xc::View>(args, 0);
    auto md = arg<int32_t>(args, 1);
    auto keys = arg<const int64_t*>(args, 2);
    auto src = arg<const int64_t*>(args, 3);
    auto sets = arg<const int64_t*>(args, 4);
    auto starts = arg<const int64_t*>(args, 5);
    auto t = arg<int64_t>(args, 6);
    auto rows = arg<const uint8_t*>(args, 7);
    auto target = arg<int32_t*>(args, 8);
    auto counts = arg<int64_t*>(args, 9);
    op.run = [=] {
      check(sets, t * 8, "write sets", 0);
      check(starts, (t + 1) * 8, "write starts", 0);
      const int64_t m = starts[t];
      check(keys, m * 8, "write keys", 0);
      check(src, m * 8, "write src", 0);
      check(target, m * 4, "write target", 0);
      check(counts, 8 * xc::kWriteCounts, "write counts", 0);
      if (rows) check(rows, 1, "write rows", 0);
      xc::twin_write(v, md, keys, src, sets, starts, t, rows, target, counts);
    };
  } else {
    report("unknown kernel " + name);
  }
  static_cast<Stream*>(s)->q.push_back(std::move(op));
  return 0;
}
}
