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
// Two devices (kDevices), each with its primary context; the current context is per
// thread, as CUDA's. Device memory (cuMemAlloc, or registered with fake_register_on) belongs
// to the device whose context was current; a stream, a module and its functions too. Every
// copy, memset, launch and graph launch must be queued on a stream of the current context's
// device, and everything it touches must be that device's memory (or host memory every
// context may use: portable pinned memory, or registered with fake_register); what crosses
// devices is reported. fake_device_work(d) counts what ran on device d.
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

constexpr int kDevices = 2;

struct Region {
  size_t bytes;
  int kind;  // 0 device, 1 pinned host, 2 external (registered by the harness)
  std::string name;
  int device = -1;  // the device it belongs to; -1: every context may use it
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

// `device` >= 0: the device the operation runs on; memory of another device is reported.
static void check(const void* p, size_t bytes, const char* what, int want_kind = -1,
                  int device = -1) {
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
  } else if (device >= 0 && r->device >= 0 && r->device != device) {
    char b[256];
    snprintf(b, sizeof b, "%s: [%p, +%zu) (%s) is memory of device %d, used on device %d", what, p,
             bytes, r->name.c_str(), r->device, device);
    report(b);
  }
}

// The primary contexts; the calling thread's current one (CUDA's is per thread too).
static int g_ctx[kDevices];
static thread_local void* g_current = nullptr;
static int current_device() {
  for (int d = 0; d < kDevices; ++d)
    if (g_current == &g_ctx[d]) return d;
  return -1;
}
static int device_for(const char* what) {
  const int d = current_device();
  if (d < 0) report(std::string(what) + " with no context current");
  return d;
}
static long g_work[kDevices];  // operations run, per device

struct Op {
  std::function<void()> run;
  std::vector<std::pair<uintptr_t, size_t>> touches;  // host/device ranges it uses
  std::string what;
};
struct Stream {
  std::deque<Op> q;
  int device = -1;
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

// a cache's state arrays (their first bytes) on the device `dev`
static void check_view(const xc::View& v, const char* what, int dev) {
  const std::string w(what);
  check(v.keys, 8, (w + " keys").c_str(), 0, dev);
  check(v.valid, 1, (w + " valid").c_str(), 0, dev);
  check(v.ticks, 8, (w + " ticks").c_str(), 0, dev);
  check(v.vectors, 1, (w + " vectors").c_str(), 0, dev);
  check(v.seq, 8, (w + " seq").c_str(), 0, dev);
  check(v.meta, 8, (w + " meta").c_str(), 0, dev);
}

template <class T>
static T arg(void** args, int i) {
  T v;
  memcpy(&v, args[i], sizeof(T));
  return v;
}

extern "C" {
typedef void (*GraphRunner)(void* exec, int device);  // device: the stream's
static GraphRunner g_graph_runner = nullptr;
void fake_set_graph_runner(GraphRunner r) { g_graph_runner = r; }
void fake_register(void* p, size_t bytes, const char* name) {
  g_regions[reinterpret_cast<uintptr_t>(p)] = Region{bytes, 2, name, -1};
}
// device memory of `device` the harness made (a cache's state, a graph's inputs)
void fake_register_on(void* p, size_t bytes, const char* name, int device) {
  g_regions[reinterpret_cast<uintptr_t>(p)] = Region{bytes, 2, name, device};
}
long fake_device_work(int device) { return device >= 0 && device < kDevices ? g_work[device] : -1; }
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
  *c = kDevices;
  return 0;
}
CUresult cuDeviceGet(int* d, int o) {
  if (o < 0 || o >= kDevices) return 101;  // CUDA_ERROR_INVALID_DEVICE
  *d = o;
  return 0;
}
CUresult cuDeviceGetAttribute(int* v, int a, int) {
  *v = a == cu::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT ? 4 : 9;
  return 0;
}
CUresult cuDeviceGetName(char* n, int len, int d) {
  snprintf(n, len, "fake %d", d);
  return 0;
}
CUresult cuDevicePrimaryCtxRetain(void** c, int d) {
  *c = &g_ctx[d];
  return 0;
}
CUresult cuDevicePrimaryCtxRelease_v2(int) { return 0; }
CUresult cuCtxSetCurrent(void* c) {
  g_current = c;
  return 0;
}
CUresult cuCtxGetCurrent(void** c) {
  *c = g_current;
  return 0;
}
// a module and its functions belong to the device whose context loaded it
struct Module {
  int device;
};
struct Function {
  std::string name;
  int device;
};
CUresult cuModuleLoadData(void** m, const void*) {
  *m = new Module{device_for("cuModuleLoadData")};
  return 0;
}
CUresult cuModuleUnload(void* m) {
  if (static_cast<Module*>(m)->device != current_device())
    report("cuModuleUnload: not its context");
  return 0;
}
CUresult cuModuleGetFunction(void** f, void* m, const char* name) {
  *f = new Function{name, static_cast<Module*>(m)->device};
  return 0;
}
CUresult cuStreamCreate(void** s, unsigned) {
  Stream* st = new Stream;
  st->device = device_for("cuStreamCreate");
  g_streams.push_back(st);
  *s = st;
  return 0;
}
// The stream `s` of an operation queued now: its device must be the current context's.
static Stream* queue_on(void* s, const std::string& what) {
  Stream* st = static_cast<Stream*>(s);
  const int cur = current_device();
  if (cur != st->device) {
    report(what + " queued on a stream of device " + std::to_string(st->device) + " while device " +
           std::to_string(cur) + " is current");
  }
  return st;
}
static void push(Stream* st, Op op) {
  const int d = st->device;
  auto run = std::move(op.run);
  op.run = [d, run] {
    if (d >= 0) ++g_work[d];
    run();
  };
  st->q.push_back(std::move(op));
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
  static_cast<Event*>(e)->s = queue_on(s, "cuEventRecord");
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
  g_regions[reinterpret_cast<uintptr_t>(m)] = Region{bytes, 0, "device", device_for("cuMemAlloc")};
  *p = reinterpret_cast<CUdeviceptr>(m);
  return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  pending_touching(p, "cuMemFree");
  g_regions.erase(p);
  free(reinterpret_cast<void*>(p));
  return 0;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned flags) {
  void* m = malloc(bytes);
  memset(m, 0xDD, bytes);
  // pinned for every context only when portable; else for the one current
  const int device = (flags & cu::CU_MEMHOSTALLOC_PORTABLE) ? -1 : device_for("cuMemHostAlloc");
  g_regions[reinterpret_cast<uintptr_t>(m)] = Region{bytes, 1, "pinned", device};
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
  Stream* st = queue_on(s, "HtoD copy");
  check(reinterpret_cast<void*>(dst), n, "HtoD dst", 0, st->device);
  // From memory no allocation holds (pageable: a std::vector), CUDA copies at once
  const bool pageable = region_of(reinterpret_cast<uintptr_t>(src), 1) == nullptr;
  if (!pageable) check(src, n, "HtoD src", -1, st->device);
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
  push(st, std::move(op));
  return 0;
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
  Stream* st = queue_on(s, "DtoH copy");
  check(dst, n, "DtoH dst", -1, st->device);
  check(reinterpret_cast<void*>(src), n, "DtoH src", 0, st->device);
  if (g_poison) memset(dst, 0x7F, n);  // NaN-ish floats until the copy runs
  Op op;
  op.what = "DtoH copy";
  op.touches = {{reinterpret_cast<uintptr_t>(dst), n}, {src, n}};
  op.run = [=] { memcpy(dst, reinterpret_cast<void*>(src), n); };
  push(st, std::move(op));
  return 0;
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s2, size_t n, void* s) {
  Stream* st = queue_on(s, "DtoD copy");
  check(reinterpret_cast<void*>(d), n, "DtoD dst", 0, st->device);
  check(reinterpret_cast<void*>(s2), n, "DtoD src", 0, st->device);
  Op op;
  op.what = "DtoD";
  op.run = [=] { memcpy(reinterpret_cast<void*>(d), reinterpret_cast<void*>(s2), n); };
  push(st, std::move(op));
  return 0;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void* s) {
  Stream* st = queue_on(s, "memset");
  check(reinterpret_cast<void*>(d), n, "memset dst", 0, st->device);
  Op op;
  op.what = "memset";
  op.run = [=] { memset(reinterpret_cast<void*>(d), v, n); };
  push(st, std::move(op));
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
  Stream* st = queue_on(s, "graph launch");
  Op op;
  op.what = "graph";
  const int device = st->device;
  op.run = [=] { g_graph_runner(exec, device); };
  push(st, std::move(op));
  return 0;
}
CUresult cuGraphDestroy(void*) { return 0; }
CUresult cuGraphExecDestroy(void*) { return 0; }

CUresult cuLaunchKernel(void* f, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, void* s, void** args, void**) {
  const Function& fn = *static_cast<const Function*>(f);
  const std::string name = fn.name;
  Stream* st = queue_on(s, "launch of " + name);
  const int dev = st->device;
  if (fn.device != dev) {
    report(name + ": a function of device " + std::to_string(fn.device) +
           "'s module launched on device " + std::to_string(dev));
  }
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
      check(tg, m * sizeof(xc::LookupTarget), "lookup targets", 0, dev);
      check(sp, (2 * m + 1) * 8, "lookup spans", 0, dev);
      const int64_t a = sp[0], b = sp[2 * m];
      check(keys + a, (b - a) * 8, "lookup keys", 0, dev);
      check(status + a, b - a, "lookup status", 0, dev);
      for (int t = 0; t < m; ++t) {
        const int64_t n = sp[2 * t + 2] - sp[2 * t];
        check(out + sp[2 * t + 1], n * tg[t].dim() * 4, "lookup out", 0, dev);
        if (tg[t].cache) check_view(tg[t].view, "lookup cache", dev);
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
      check(tg, m * sizeof(xc::CombineTarget), "combine targets", 0, dev);
      check(sp, (3 * m + 1) * 8, "combine spans", 0, dev);
      // each table's slots by the host's combiner, whose sums the kernel repeats
      for (int t = 0; t < m; ++t) {
        const xc::CombineTarget c = tg[t];
        const int64_t elements = sp[3 * t + 3] - sp[3 * t];
        if (elements % c.dim != 0) report("combine: a table's elements are not whole slots");
        const int64_t segments = elements / c.dim;
        const float* v = vectors + sp[3 * t + 1];
        const int64_t* p = ptr + sp[3 * t + 2];
        check(p, (segments + 1) * 8, "combine row pointers", 0, dev);
        const int64_t rows = segments > 0 ? p[segments] : 0;
        check(v, rows * c.dim * 4, "combine vectors", 0, dev);
        check(c.out, elements * 4, "combine out", 0, dev);
        if (!triton_rec::combine_segments(v, rows, c.dim, p, segments, c.mean, c.out)) {
          report("combine: row pointers out of order");
        }
      }
    };
  } else if (name == "trec_scatter_rows") {
    auto dst = arg<float*>(args, 0);
    auto src = arg<const float*>(args, 1);
    auto rows = arg<const int64_t*>(args, 2);
    auto k = arg<int64_t>(args, 3);
    auto dim = arg<int32_t>(args, 4);
    op.run = [=] {
      check(rows, k * 8, "scatter rows", 1, dev);  // mapped pinned host memory
      for (int64_t i = 0; i < k; ++i) {
        check(src + rows[i] * dim, dim * 4, "scatter src", 1, dev);
        check(dst + rows[i] * dim, dim * 4, "scatter dst", 0, dev);
        memcpy(dst + rows[i] * dim, src + rows[i] * dim, dim * 4);
      }
    };
  } else if (name == "trec_cache_write") {
    auto v = arg<xc::View>(args, 0);
    auto md = arg<int32_t>(args, 1);
    auto ex = arg<int32_t>(args, 2);
    auto keys = arg<const int64_t*>(args, 3);
    auto src = arg<const int64_t*>(args, 4);
    auto sets = arg<const int64_t*>(args, 5);
    auto starts = arg<const int64_t*>(args, 6);
    auto t = arg<int64_t>(args, 7);
    auto rows = arg<const uint8_t*>(args, 8);
    auto target = arg<int32_t*>(args, 9);
    auto counts = arg<int64_t*>(args, 10);
    op.run = [=] {
      check(sets, t * 8, "write sets", 0, dev);
      check(starts, (t + 1) * 8, "write starts", 0, dev);
      const int64_t m = starts[t];
      check(keys, m * 8, "write keys", 0, dev);
      check(src, m * 8, "write src", 0, dev);
      check(target, m * 4, "write target", 0, dev);
      check(counts, 8 * xc::kWriteResults, "write counts", 0, dev);
      if (rows) check(rows, 1, "write rows", 0, dev);
      check_view(v, "write cache", dev);
      xc::twin_write(v, md, ex != 0, keys, src, sets, starts, t, rows, target, counts);
    };
  } else {
    report("unknown kernel " + name);
  }
  push(st, std::move(op));
  return 0;
}
}
