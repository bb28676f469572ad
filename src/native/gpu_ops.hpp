// Driving the GPU kernels (src/native/kernels/cache_kernels.cu) from the host: module,
// streams with their pinned staging, and the launch sequences of a lookup, a cache write
// and the HugeCTR path. One implementation for both users: the native core (_native, which
// the engine's device cache and the benchmarks call) and the native backend
// (src/triton_backend/trec/gpu_paths.cpp, the request path of KIND_GPU instances).
//
// Staging: a Lane is one CUDA stream with its pinned host and device buffers, used by one
// thread at a time. A host-to-host lookup is: keys copied into pinned memory, one
// host-to-device copy, one launch for all the tables (up to kLaunchTables), one
// device-to-host copy of the answers and statuses, one synchronization.
//
// The synchronization polls an event (made with CU_EVENT_BLOCKING_SYNC), yielding the core
// between polls, then sleeps on it, instead of letting the driver spin a core for the whole
// request as cuStreamSynchronize does in a context with the default scheduling: on a served
// node those cores are what the front end and the other instances need.
// TRITON_REC_GPU_WAIT chooses (Wait below; docs/configuration.md, "The server: how a GPU
// instance waits").
#pragma once

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "array_cache_twin.hpp"
#include "cuda_driver.hpp"

namespace triton_rec {
namespace gpu {

using cuda::CUdeviceptr;
using cuda::CUfunction;
using cuda::CUstream;
using cuda::Driver;

// The kernels of one module (the PTX of cache_kernels.cu), loaded on one device.
class Kernels {
 public:
  // `image`: cubin, or PTX (NUL-terminated: std::string's c_str)
  Kernels(std::shared_ptr<cuda::Device> device, const std::string& image)
      : device_(std::move(device)) {
    const Driver& d = Driver::get();
    device_->make_current();
    d.check(d.cuModuleLoadData(&module_, image.c_str()), "cuModuleLoadData (the kernels)");
    get(&write, "trec_cache_write");
    get(&clear, "trec_cache_clear");
    get(&repair, "trec_cache_repair");
    get(&lookup_tables, "trec_lookup_tables");
    get(&combine_tables, "trec_combine_tables");
    get(&scatter_rows, "trec_scatter_rows");
    sms_ = device_->multiprocessors();
  }
  ~Kernels() {
    if (module_ != nullptr) {
      device_->make_current();
      Driver::get().cuModuleUnload(module_);
    }
  }
  Kernels(const Kernels&) = delete;
  Kernels& operator=(const Kernels&) = delete;

  const cuda::Device& device() const { return *device_; }
  // Blocks for `items` work items of `per_block` each: enough to fill the device, never
  // more than the items need (the kernels loop when there are more items than threads).
  unsigned grid(int64_t items, int64_t per_block) const {
    const int64_t need = (items + per_block - 1) / per_block;
    return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(need, int64_t{sms_} * 16)));
  }

  CUfunction write = nullptr, clear = nullptr, repair = nullptr;
  CUfunction lookup_tables = nullptr, combine_tables = nullptr, scatter_rows = nullptr;

 private:
  void get(CUfunction* f, const char* name) {
    Driver::get().check(Driver::get().cuModuleGetFunction(f, module_, name), name);
  }
  std::shared_ptr<cuda::Device> device_;
  cuda::CUmodule module_ = nullptr;
  int sms_ = 1;
};

constexpr unsigned kBlock = 256;       // threads per block of every kernel
constexpr int64_t kWarpsPerBlock = 8;  // kBlock / 32: keys (sets) per block per pass

inline void launch(CUfunction f, unsigned grid, CUstream stream, void** args, const char* what) {
  Driver::get().check(
      Driver::get().cuLaunchKernel(f, grid, 1, 1, kBlock, 1, 1, 0, stream, args, nullptr), what);
}

// Device memory that grows (never shrinks) to the largest size asked for.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  CUdeviceptr reserve(size_t bytes) {
    if (bytes > bytes_) {
      release();
      Driver::get().check(Driver::get().cuMemAlloc(&ptr_, bytes), "cuMemAlloc");
      bytes_ = bytes;
    }
    return ptr_;
  }
  CUdeviceptr ptr() const { return ptr_; }

 private:
  void release() {
    if (ptr_ != 0) Driver::get().cuMemFree(ptr_);
    ptr_ = 0;
    bytes_ = 0;
  }
  CUdeviceptr ptr_ = 0;
  size_t bytes_ = 0;
};

// Pinned (page-locked) host memory of our own: the registry of what this process pinned
// through pinned_alloc, so a copy to or from it skips the staging buffer.
class PinnedRegistry {
 public:
  static PinnedRegistry& get() {
    static PinnedRegistry r;
    return r;
  }
  // (a context current on the calling thread) Portable and mapped: every context may copy
  // from it, and a kernel may read it (uvm tables).
  void* alloc(size_t bytes) {
    void* p = nullptr;
    Driver::get().check(Driver::get().cuMemHostAlloc(
                            &p, std::max<size_t>(bytes, 1),
                            cuda::CU_MEMHOSTALLOC_PORTABLE | cuda::CU_MEMHOSTALLOC_DEVICEMAP),
                        "cuMemHostAlloc");
    std::lock_guard<std::mutex> lock(mu_);
    ranges_[reinterpret_cast<uintptr_t>(p)] = bytes;
    return p;
  }
  void free(void* p) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ranges_.erase(reinterpret_cast<uintptr_t>(p));
    }
    Driver::get().cuMemFreeHost(p);
  }
  // Whether [p, p + bytes) lies in one pinned allocation of ours.
  bool contains(const void* p, size_t bytes) {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return false;
    --it;
    return a + bytes <= it->first + it->second;
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, size_t> ranges_;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() { release(); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  char* reserve(size_t bytes) {
    if (bytes > bytes_) {
      release();
      ptr_ = static_cast<char*>(PinnedRegistry::get().alloc(bytes));
      bytes_ = bytes;
    }
    return ptr_;
  }

 private:
  void release() {
    if (ptr_ != nullptr) PinnedRegistry::get().free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  char* ptr_ = nullptr;
  size_t bytes_ = 0;
};

inline size_t align256(size_t n) { return (n + 255) & ~size_t{255}; }

// How a Lane waits for its stream (TRITON_REC_GPU_WAIT): "yield" (the default) polls the
// event, giving the core to any other runnable thread between polls, for up to
// kYieldWaitNs, then sleeps as "block" does; "block" sleeps on a blocking-sync event at
// once; "spin" calls cuStreamSynchronize (the driver's default wait: a busy core). Measured
// on an H200 (benchmarks/history/2026-11-26-gpu-path-h200.md): served, every GPU model
// got closer to its floor with "yield" (e.g. dlrm_hps, whole table: 0.73x against
// 0.61x); in-process a 1,664-key lookup took 36 us with "yield", 73 us with "block".
enum class Wait { kBlock, kSpin, kYield };
constexpr int64_t kYieldWaitNs = 200000;

inline Wait wait_from_env() {
  const char* v = std::getenv("TRITON_REC_GPU_WAIT");
  const std::string s = v == nullptr ? "" : v;
  if (s.empty() || s == "yield") return Wait::kYield;
  if (s == "block") return Wait::kBlock;
  if (s == "spin") return Wait::kSpin;
  throw std::runtime_error("TRITON_REC_GPU_WAIT must be 'block', 'spin' or 'yield', not '" + s +
                           "'");
}

// A stream and its staging buffers; one thread at a time.
class Lane {
 public:
  explicit Lane(std::shared_ptr<const Kernels> kernels)
      : kernels_(std::move(kernels)), wait_(wait_from_env()) {
    const Driver& d = Driver::get();
    kernels_->device().make_current();
    d.check(d.cuStreamCreate(&stream_, cuda::CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    d.check(
        d.cuEventCreate(&done_event_, cuda::CU_EVENT_BLOCKING_SYNC | cuda::CU_EVENT_DISABLE_TIMING),
        "cuEventCreate");
    const CUdeviceptr done = done_.reserve(256);
    d.check(d.cuMemsetD8Async(done, 0, 256, stream_), "cuMemsetD8Async");
    sync();
  }
  ~Lane() {
    if (stream_ != nullptr) {
      kernels_->device().make_current();
      Driver::get().cuStreamSynchronize(stream_);
      Driver::get().cuStreamDestroy(stream_);
    }
    if (done_event_ != nullptr) Driver::get().cuEventDestroy(done_event_);
  }
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;

  const Kernels& kernels() const { return *kernels_; }
  CUstream stream() const { return stream_; }
  // The launch counter the kernels' last block uses (zero between launches).
  CUdeviceptr done() const { return done_.ptr(); }
  // Left by an exception, the scope that entered the lane waits for what it queued on the
  // stream (errors ignored) before unwinding further: no copy from the pinned staging and
  // no kernel on a cache is still running when the staging is reused or a writer lock is
  // released.
  class Entered {
   public:
    explicit Entered(CUstream stream) : stream_(stream), unwinding_(std::uncaught_exceptions()) {}
    ~Entered() {
      if (std::uncaught_exceptions() > unwinding_) Driver::get().cuStreamSynchronize(stream_);
    }
    Entered(const Entered&) = delete;
    Entered& operator=(const Entered&) = delete;

   private:
    CUstream stream_;
    int unwinding_;
  };
  // Makes the lane's device current, for the scope that holds the result.
  [[nodiscard]] Entered enter() const {
    kernels_->device().make_current();
    return Entered(stream_);
  }
  // Waits until everything queued on the stream has run (see the file's comment).
  void sync() const {
    const Driver& d = Driver::get();
    if (wait_ == Wait::kSpin) {
      d.check(d.cuStreamSynchronize(stream_), "cuStreamSynchronize");
      return;
    }
    d.check(d.cuEventRecord(done_event_, stream_), "cuEventRecord");
    if (wait_ == Wait::kYield) {
      const auto start = std::chrono::steady_clock::now();
      for (;;) {
        const cuda::CUresult r = d.cuEventQuery(done_event_);
        if (r == cuda::CUDA_SUCCESS) return;
        if (r != cuda::CUDA_ERROR_NOT_READY) d.check(r, "cuEventQuery");
        if (std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(kYieldWaitNs)) {
          break;
        }
        sched_yield();
      }
    }
    d.check(d.cuEventSynchronize(done_event_), "cuEventSynchronize");
  }
  void to_device(CUdeviceptr dst, const void* src, size_t bytes) const {
    if (bytes)
      Driver::get().check(Driver::get().cuMemcpyHtoDAsync(dst, src, bytes, stream_),
                          "cuMemcpyHtoDAsync");
  }
  void to_host(void* dst, CUdeviceptr src, size_t bytes) const {
    if (bytes)
      Driver::get().check(Driver::get().cuMemcpyDtoHAsync(dst, src, bytes, stream_),
                          "cuMemcpyDtoHAsync");
  }
  // The device's address of host staging (mapped pinned memory: PinnedRegistry), which a
  // kernel reads across the bus.
  CUdeviceptr mapped(const void* host) const {
    CUdeviceptr p = 0;
    Driver::get().check(Driver::get().cuMemHostGetDevicePointer(&p, const_cast<void*>(host), 0),
                        "cuMemHostGetDevicePointer");
    return p;
  }

  // Staging memory, carved into 256-byte aligned parts of the sizes asked for.
  struct Parts {
    std::vector<size_t> offsets;
    size_t total = 0;
    explicit Parts(std::initializer_list<size_t> sizes) {
      for (size_t s : sizes) {
        offsets.push_back(total);
        total += align256(s);
      }
    }
  };
  char* host(const Parts& p) { return host_.reserve(p.total); }
  CUdeviceptr device(const Parts& p) { return device_.reserve(p.total); }

 private:
  std::shared_ptr<const Kernels> kernels_;
  const Wait wait_;
  CUstream stream_ = nullptr;
  cuda::CUevent done_event_ = nullptr;
  DeviceBuffer done_;
  DeviceBuffer device_;
  PinnedBuffer host_;
};

// The device cache's state view from its arrays' addresses and its geometry (what
// ArrayEmbeddingCache.native_plan hands over); std::invalid_argument when inconsistent.
struct StateAddresses {
  uintptr_t keys = 0, valid = 0, ticks = 0, vectors = 0, seq = 0, meta = 0, sketch = 0;
};

// The state arrays by the names ArrayEmbeddingCache.addresses() gives them: get(name) is
// an array's address, or 0 (no sketch without tinylfu).
template <class Get>
StateAddresses state_addresses(Get&& get) {
  StateAddresses a;
  a.keys = get("keys");
  a.valid = get("valid");
  a.ticks = get("ticks");
  a.vectors = get("vectors");
  a.seq = get("seq");
  a.meta = get("meta");
  a.sketch = get("sketch");
  return a;
}

inline xcache::View make_view(const StateAddresses& a, int64_t num_sets, int64_t ways, int64_t dim,
                              int64_t precision, int64_t policy, int64_t sketch_width) {
  if (num_sets < 1 || ways < 1 || ways > xcache::kMaxWays || dim < 1 || precision < 0 ||
      precision > 2 || policy < 0 || policy > 1) {
    throw std::invalid_argument("device cache: bad geometry");
  }
  if (!a.keys || !a.valid || !a.ticks || !a.vectors || !a.seq || !a.meta ||
      (policy == xcache::kPolicyTinyLfu &&
       (!a.sketch || sketch_width < 64 || (sketch_width & (sketch_width - 1))))) {
    throw std::invalid_argument("device cache: a state array address is missing");
  }
  xcache::View v{};
  v.keys = reinterpret_cast<int64_t*>(a.keys);
  v.valid = reinterpret_cast<uint8_t*>(a.valid);
  v.ticks = reinterpret_cast<int64_t*>(a.ticks);
  v.vectors = reinterpret_cast<uint8_t*>(a.vectors);
  v.seq = reinterpret_cast<int64_t*>(a.seq);
  v.meta = reinterpret_cast<int64_t*>(a.meta);
  v.sketch = policy == xcache::kPolicyTinyLfu ? reinterpret_cast<uint8_t*>(a.sketch) : nullptr;
  v.num_sets = num_sets;
  v.ways = ways;
  v.dim = dim;
  v.row_bytes = encoded_row_bytes(static_cast<uint32_t>(precision), dim);
  v.sketch_width = policy == xcache::kPolicyTinyLfu ? sketch_width : 0;
  v.slots = num_sets * ways;
  v.precision = precision;
  v.policy = policy;
  return v;
}

// What a table of a lookup is on the device (array_cache_rules.hpp: the kernels read them).
using DeviceTable = xcache::WholeTable;
using LookupTarget = xcache::LookupTarget;

// What a launch for several tables reads of each (LookupTarget, CombineTarget: fixed for
// a model's life) in device memory: copied there once (upload), then every request
// passes only where each table's keys and answers lie (its spans).
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  void upload(Lane& lane, const std::vector<T>& items) {
    const size_t bytes = items.size() * sizeof(T);
    const auto entered = lane.enter();  // first: the memory is the lane's device's
    CUdeviceptr d = buffer_.reserve(std::max<size_t>(bytes, 1));
    lane.to_device(d, items.data(), bytes);
    lane.sync();
  }
  CUdeviceptr ptr() const { return buffer_.ptr(); }

 private:
  DeviceBuffer buffer_;
};

// trec_lookup_tables' spans of a request whose table t has its keys from key_starts[t]
// to key_starts[t + 1] and its answers from out_starts[t] (floats): into dst [2T + 1].
inline size_t lookup_spans_bytes(size_t tables) { return (2 * tables + 1) * 8; }
inline void fill_lookup_spans(int64_t* dst, const int64_t* key_starts, const int64_t* out_starts,
                              size_t tables) {
  for (size_t t = 0; t < tables; ++t) {
    dst[2 * t] = key_starts[t];
    dst[2 * t + 1] = out_starts[t];
  }
  dst[2 * tables] = key_starts[tables];
}

// The launches of a lookup or combine of `tables` tables whose items (keys, elements) start
// at starts[t]: fn(first, count) for each run of at most kLaunchTables tables that has
// items. The GPU path launches per run; the twin (bindings) runs the same runs, so CI
// covers the split.
template <class Fn>
void each_launch(size_t tables, const int64_t* starts, Fn&& fn) {
  for (size_t c0 = 0; c0 < tables; c0 += xcache::kLaunchTables) {
    const size_t c1 = std::min(tables, c0 + xcache::kLaunchTables);
    if (starts[c1] > starts[c0]) fn(c0, c1 - c0);
  }
}

// Launches the lookups of every table of a request, one launch per kLaunchTables tables:
// targets (device, one per table), spans (device, fill_lookup_spans; key_starts is its
// host copy's key starts), keys, out and status (device) as trec_lookup_tables takes them.
// Nothing waits for it.
inline void launch_lookups(Lane& lane, CUdeviceptr targets, size_t tables, CUdeviceptr spans,
                           const int64_t* key_starts, CUdeviceptr keys, CUdeviceptr out,
                           CUdeviceptr status) {
  const Kernels& k = lane.kernels();
  CUdeviceptr done = lane.done();
  each_launch(tables, key_starts, [&](size_t c0, size_t count) {
    const int64_t n = key_starts[c0 + count] - key_starts[c0];
    CUdeviceptr tg = targets + c0 * sizeof(LookupTarget), sp = spans + c0 * 2 * sizeof(int64_t);
    int32_t m = static_cast<int32_t>(count);
    void* args[] = {&tg, &sp, &m, &keys, &out, &status, &done};
    launch(k.lookup_tables, k.grid(n, kWarpsPerBlock), lane.stream(), args, "trec_lookup_tables");
  });
}

// trec_combine_tables' spans: table t's first element (slot x value) elem_starts[t] (and
// elem_starts[T] one past the last), its first float vec_starts[t] in the vectors, its first
// row pointer ptr_starts[t]: into dst [3T + 1].
inline size_t combine_spans_bytes(size_t tables) { return (3 * tables + 1) * 8; }
inline void fill_combine_spans(int64_t* dst, const int64_t* elem_starts, const int64_t* vec_starts,
                               const int64_t* ptr_starts, size_t tables) {
  for (size_t t = 0; t < tables; ++t) {
    dst[3 * t] = elem_starts[t];
    dst[3 * t + 1] = vec_starts[t];
    dst[3 * t + 2] = ptr_starts[t];
  }
  dst[3 * tables] = elem_starts[tables];
}

// Launches HugeCTR's slot combiner for every table, one launch per kLaunchTables tables
// (targets, spans: device; elem_starts: the spans' host copy of the element starts).
inline void launch_combines(Lane& lane, CUdeviceptr targets, size_t tables, CUdeviceptr spans,
                            const int64_t* elem_starts, CUdeviceptr vectors, CUdeviceptr ptr) {
  const Kernels& k = lane.kernels();
  each_launch(tables, elem_starts, [&](size_t c0, size_t count) {
    const int64_t n = elem_starts[c0 + count] - elem_starts[c0];
    CUdeviceptr tg = targets + c0 * sizeof(xcache::CombineTarget),
                sp = spans + c0 * 3 * sizeof(int64_t);
    int32_t m = static_cast<int32_t>(count);
    void* args[] = {&tg, &sp, &m, &vectors, &ptr};
    launch(k.combine_tables, k.grid(n, kBlock), lane.stream(), args, "trec_combine_tables");
  });
}

// Copies rows[0..k) (row indices) of dim floats from src (mapped host memory: Lane::mapped)
// to the same rows of dst (device) with trec_scatter_rows. Nothing waits for it.
inline void launch_scatter_rows(Lane& lane, CUdeviceptr dst, CUdeviceptr src, CUdeviceptr rows,
                                int64_t k, int32_t dim) {
  if (k <= 0) return;
  const Kernels& kn = lane.kernels();
  void* args[] = {&dst, &src, &rows, &k, &dim};
  launch(kn.scatter_rows, kn.grid(k, kWarpsPerBlock), lane.stream(), args, "trec_scatter_rows");
}

// Pinned keys of at most this many bytes are still copied into the staging: one copy to
// the device instead of two (a copy's call and its DMA's start cost more than a memcpy of
// this much; two copies per lookup where the per-table kernels made one are one of the
// two suspects of the one-table slowdown in
// benchmarks/history/2026-11-26-gpu-path-h200.md, fourth GPU session).
constexpr size_t kStageBytes = 32 << 10;

// A host-to-host lookup of `tables` tables (targets[t]: its keys from key_starts[t] to
// key_starts[t + 1] in keys, key_starts[0] = 0; its answers from out_starts[t] floats in
// out; status one per key), through the lane's staging: the targets, spans and keys in one copy
// (the keys straight from the caller's memory when it is pinned memory of ours, beyond
// kStageBytes), the launches, the answers and statuses back (in one copy unless the answers
// go straight to pinned memory of ours). Returns when they are in place.
inline void lookup_host(Lane& lane, const LookupTarget* targets, size_t tables, const int64_t* keys,
                        const int64_t* key_starts, const int64_t* out_starts, float* out,
                        uint8_t* status) {
  // the spans index keys, answers and statuses from 0: the first table's keys start there
  if (tables > 0 && (key_starts[0] != 0 || out_starts[0] != 0)) {
    throw std::invalid_argument("lookup_host: the first table's keys and answers start at 0");
  }
  const int64_t n = key_starts[tables];
  if (n <= 0) return;
  const auto entered = lane.enter();
  const size_t kb = static_cast<size_t>(n) * 8, sb = static_cast<size_t>(n);
  const size_t ob = static_cast<size_t>(out_starts[tables]) * 4;
  const Lane::Parts parts{tables * sizeof(LookupTarget), lookup_spans_bytes(tables), kb, ob, sb};
  const auto& o = parts.offsets;
  char* h = lane.host(parts);
  const CUdeviceptr d = lane.device(parts);
  std::memcpy(h, targets, tables * sizeof(LookupTarget));
  fill_lookup_spans(reinterpret_cast<int64_t*>(h + o[1]), key_starts, out_starts, tables);
  PinnedRegistry& pinned = PinnedRegistry::get();
  if (kb > kStageBytes && pinned.contains(keys, kb)) {
    lane.to_device(d, h, o[2]);
    lane.to_device(d + o[2], keys, kb);
  } else {
    std::memcpy(h + o[2], keys, kb);
    lane.to_device(d, h, o[3]);
  }
  const bool out_pinned = pinned.contains(out, ob);
  void* oh = out_pinned ? static_cast<void*>(out) : h + o[3];
  launch_lookups(lane, d, tables, d + o[1], key_starts, d + o[2], d + o[3], d + o[4]);
  if (out_pinned) {
    lane.to_host(oh, d + o[3], ob);
    lane.to_host(h + o[4], d + o[4], sb);
  } else {  // the answers and the statuses lie one after the other: one copy back
    lane.to_host(h + o[3], d + o[3], (o[4] - o[3]) + sb);
  }
  lane.sync();
  if (!out_pinned) std::memcpy(out, oh, ob);
  std::memcpy(status, h + o[4], sb);
}

// The same for one table: keys[0..n) -> out [n, dim] and status[0..n).
inline void lookup_host(Lane& lane, const LookupTarget& t, const int64_t* keys, int64_t n,
                        float* out, uint8_t* status) {
  const int64_t key_starts[2] = {0, n}, out_starts[2] = {0, n * t.dim()};
  lookup_host(lane, &t, 1, keys, key_starts, out_starts, out, status);
}

// One table's lookup of n keys on device memory (keys, out [n, dim], status [n]), on the
// lane's stream (its target and spans staged and copied first); waits for it.
inline void lookup_device(Lane& lane, const LookupTarget& t, CUdeviceptr keys, int64_t n,
                          CUdeviceptr out, CUdeviceptr status) {
  if (n <= 0) return;
  const auto entered = lane.enter();
  const Lane::Parts parts{sizeof(LookupTarget), lookup_spans_bytes(1)};
  char* h = lane.host(parts);
  const CUdeviceptr d = lane.device(parts);
  const int64_t key_starts[2] = {0, n}, out_starts[2] = {0, 0};
  std::memcpy(h, &t, sizeof(LookupTarget));
  fill_lookup_spans(reinterpret_cast<int64_t*>(h + parts.offsets[1]), key_starts, out_starts, 1);
  lane.to_device(d, h, parts.total);
  launch_lookups(lane, d, 1, d + parts.offsets[1], key_starts, keys, out, status);
  lane.sync();
}

// The writes of several device caches (the caller holds every one's writer lock,
// `exclusive`ly or shared: xcache::begin_write): parts[0..n) grouped on the host and
// staged together (xcache::StagedWrites: the twin runs the same staging,
// twin_write_staged), one copy to the device, one trec_cache_write launch per part on the
// lane's stream, the results back in one copy, one synchronization. Adds part p's counts
// (xcache::WriteCount order) to counts[p * kWriteCounts ...]; the keys left in busy sets
// (shared only; their targets fetched in a second copy) go to `busy`.
inline void write_many(Lane& lane, const xcache::WritePart* parts, size_t n, int64_t* counts,
                       bool exclusive, xcache::BusyWrites* busy) {
  size_t live = 0;
  for (size_t p = 0; p < n; ++p) live += parts[p].n > 0;
  if (live == 0) return;
  const auto entered = lane.enter();
  thread_local xcache::StagedWrites staged;
  staged.plan(parts, n);
  const Lane::Parts layout{staged.total()};
  char* h = lane.host(layout);
  const CUdeviceptr d = lane.device(layout);
  staged.fill(h, parts, n);
  // everything up to the row targets, then the zeroed counters
  lane.to_device(d, h, staged.upload());
  lane.to_device(d + staged.counts(), h + staged.counts(), staged.total() - staged.counts());
  const Kernels& k = lane.kernels();
  using F = xcache::StagedWrites;
  for (size_t p = 0; p < n; ++p) {
    int64_t t = staged.touched(p);
    if (t == 0) continue;
    xcache::View v = parts[p].view;
    int32_t md = parts[p].mode, ex = exclusive ? 1 : 0;
    CUdeviceptr a0 = d + staged.at(p, F::kKeys), a1 = d + staged.at(p, F::kSrc),
                a2 = d + staged.at(p, F::kSets), a3 = d + staged.at(p, F::kStarts),
                a4 = parts[p].rows != nullptr ? d + staged.at(p, F::kRows) : 0,
                a5 = d + staged.at(p, F::kTarget), a6 = d + staged.at(p, F::kCounts),
                done = lane.done();
    void* args[] = {&v, &md, &ex, &a0, &a1, &a2, &a3, &t, &a4, &a5, &a6, &done};
    launch(k.write, k.grid(t, kWarpsPerBlock), lane.stream(), args, "trec_cache_write");
  }
  lane.to_host(h + staged.counts(), d + staged.counts(), staged.total() - staged.counts());
  lane.sync();
  std::vector<size_t> left;
  for (size_t p = 0; p < n; ++p) {
    const auto* got = reinterpret_cast<const int64_t*>(h + staged.at(p, F::kCounts));
    for (int i = 0; i < xcache::kWriteCounts; ++i) counts[p * xcache::kWriteCounts + i] += got[i];
    if (got[xcache::kWBusy] != 0) left.push_back(p);
  }
  if (left.empty()) return;
  for (size_t p : left) {
    lane.to_host(h + staged.at(p, F::kTarget), d + staged.at(p, F::kTarget),
                 static_cast<size_t>(staged.distinct(p)) * 4);
  }
  lane.sync();
  for (size_t p : left) {
    staged.collect_busy(p, reinterpret_cast<const int32_t*>(h + staged.at(p, F::kTarget)), parts[p],
                        busy);
  }
}

// A write of the device cache under its writer lock held exclusively (DeviceCache.write:
// Python's writers): keys[0..n) with rows [n, row_bytes] (insert, update; null for
// erase), grouped on the host, one kernel. Adds the call's counts (xcache::WriteCount
// order) to counts.
inline void write_host(Lane& lane, const xcache::View& view, int32_t mode, const int64_t* keys,
                       int64_t n, const uint8_t* rows, int64_t* counts) {
  const xcache::WritePart part{view, mode, keys, n, rows};
  write_many(lane, &part, 1, counts, true, nullptr);
}

// clear (or repair) of the device cache; returns the sets healed.
inline int64_t clear_or_repair(Lane& lane, const xcache::View& view, bool clear) {
  const auto entered = lane.enter();
  const Lane::Parts parts{8 * xcache::kWriteCounts};
  char* h = lane.host(parts);
  const CUdeviceptr d = lane.device(parts);
  std::memset(h, 0, parts.total);
  lane.to_device(d, h, parts.total);
  xcache::View v = view;
  CUdeviceptr r = d;
  void* args[] = {&v, &r};
  const Kernels& k = lane.kernels();
  const int64_t items =
      clear ? std::max(view.num_sets, xcache::kSketchRows * view.sketch_width / 4) : view.num_sets;
  launch(clear ? k.clear : k.repair, k.grid(items, kBlock), lane.stream(), args,
         clear ? "trec_cache_clear" : "trec_cache_repair");
  lane.to_host(h, d, parts.total);
  lane.sync();
  return reinterpret_cast<const int64_t*>(h)[xcache::kWRecovered];
}

// A captured graph (the dense network of a batch bucket) on the lane's stream.
inline void launch_graph(Lane& lane, cuda::CUgraphExec graph) {
  Driver::get().check(Driver::get().cuGraphLaunch(graph, lane.stream()), "cuGraphLaunch");
}

}  // namespace gpu
}  // namespace triton_rec
