// The CUDA driver API, loaded at run time (dlopen of libcuda.so.1): nothing to link, no
// CUDA toolkit to build with. The native core and the native backend load the kernels
// (PTX from NVRTC, triton_rec/gpu/kernels.py) and drive them through this table.
// Without a driver every entry point throws CudaError saying so.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

namespace triton_rec {
namespace cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUstream = struct CUstream_st*;
using CUgraph = struct CUgraph_st*;
using CUgraphExec = struct CUgraphExec_st*;
using CUevent = struct CUevent_st*;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr unsigned CU_STREAM_NON_BLOCKING = 0x1;
constexpr unsigned CU_EVENT_BLOCKING_SYNC = 0x1;
constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;
constexpr CUresult CUDA_ERROR_NOT_READY = 600;
constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 0x1;
constexpr unsigned CU_MEMHOSTALLOC_DEVICEMAP = 0x2;
constexpr unsigned CU_MEMHOSTREGISTER_PORTABLE = 0x1;
constexpr unsigned CU_MEMHOSTREGISTER_DEVICEMAP = 0x2;
constexpr unsigned CU_MEMHOSTREGISTER_READ_ONLY = 0x8;
constexpr int CU_STREAM_CAPTURE_MODE_RELAXED = 2;
constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
constexpr int CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2;
constexpr unsigned CU_MEMORYTYPE_HOST = 1;
constexpr unsigned CU_MEMORYTYPE_DEVICE = 2;

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The entry points this project uses (the _v2 names the headers map to since CUDA 4/11).
struct Driver {
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDriverGetVersion)(int*) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*cuDeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuCtxGetCurrent)(CUcontext*) = nullptr;
  CUresult (*cuModuleLoadData)(CUmodule*, const void*) = nullptr;
  CUresult (*cuModuleUnload)(CUmodule) = nullptr;
  CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void**, void**) = nullptr;
  CUresult (*cuStreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*cuStreamDestroy)(CUstream) = nullptr;
  CUresult (*cuStreamSynchronize)(CUstream) = nullptr;
  CUresult (*cuEventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*cuEventDestroy)(CUevent) = nullptr;
  CUresult (*cuEventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*cuEventQuery)(CUevent) = nullptr;
  CUresult (*cuEventSynchronize)(CUevent) = nullptr;
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t) = nullptr;
  CUresult (*cuMemFree)(CUdeviceptr) = nullptr;
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*cuMemFreeHost)(void*) = nullptr;
  CUresult (*cuMemHostRegister)(void*, size_t, unsigned) = nullptr;
  CUresult (*cuMemHostUnregister)(void*) = nullptr;
  CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned) = nullptr;
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*cuPointerGetAttribute)(void*, int, CUdeviceptr) = nullptr;
  CUresult (*cuStreamBeginCapture)(CUstream, int) = nullptr;
  CUresult (*cuStreamEndCapture)(CUstream, CUgraph*) = nullptr;
  CUresult (*cuGraphInstantiateWithFlags)(CUgraphExec*, CUgraph, unsigned long long) = nullptr;
  CUresult (*cuGraphLaunch)(CUgraphExec, CUstream) = nullptr;
  CUresult (*cuGraphDestroy)(CUgraph) = nullptr;
  CUresult (*cuGraphExecDestroy)(CUgraphExec) = nullptr;
  CUresult (*cuGetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*cuGetErrorName)(CUresult, const char**) = nullptr;

  // The process's driver table, loaded (and cuInit) on first use; throws CudaError when
  // there is no driver or it fails to initialize (no device).
  static const Driver& get() {
    static std::once_flag once;
    static Driver d;
    static std::string failure;
    std::call_once(once, [] {
      try {
        d.load();
      } catch (const std::exception& e) {
        failure = e.what();
      }
    });
    if (!failure.empty()) throw CudaError(failure);
    return d;
  }

  // "cuFoo failed: CUDA_ERROR_X (text)" for a failed call.
  std::string describe(CUresult r, const char* what) const {
    const char* name = nullptr;
    const char* text = nullptr;
    if (cuGetErrorName != nullptr) cuGetErrorName(r, &name);
    if (cuGetErrorString != nullptr) cuGetErrorString(r, &text);
    return std::string(what) + " failed: " + (name ? name : "CUDA error " + std::to_string(r)) +
           (text ? std::string(" (") + text + ")" : std::string());
  }

  void check(CUresult r, const char* what) const {
    if (r != CUDA_SUCCESS) throw CudaError(describe(r, what));
  }

 private:
  void* lib_ = nullptr;

  template <class F>
  void sym(F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(lib_, name));
    if (f == nullptr) throw CudaError(std::string("libcuda.so.1 has no ") + name);
  }

  void load() {
    lib_ = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib_ == nullptr) {
      const char* why = dlerror();
      throw CudaError(std::string("no CUDA driver here (libcuda.so.1: ") +
                      (why ? why : "not found") + ")");
    }
    sym(cuGetErrorString, "cuGetErrorString");
    sym(cuGetErrorName, "cuGetErrorName");
    sym(cuInit, "cuInit");
    sym(cuDriverGetVersion, "cuDriverGetVersion");
    sym(cuDeviceGetCount, "cuDeviceGetCount");
    sym(cuDeviceGet, "cuDeviceGet");
    sym(cuDeviceGetAttribute, "cuDeviceGetAttribute");
    sym(cuDeviceGetName, "cuDeviceGetName");
    sym(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    sym(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
    sym(cuCtxSetCurrent, "cuCtxSetCurrent");
    sym(cuCtxGetCurrent, "cuCtxGetCurrent");
    sym(cuModuleLoadData, "cuModuleLoadData");
    sym(cuModuleUnload, "cuModuleUnload");
    sym(cuModuleGetFunction, "cuModuleGetFunction");
    sym(cuLaunchKernel, "cuLaunchKernel");
    sym(cuStreamCreate, "cuStreamCreate");
    sym(cuStreamDestroy, "cuStreamDestroy_v2");
    sym(cuStreamSynchronize, "cuStreamSynchronize");
    sym(cuEventCreate, "cuEventCreate");
    sym(cuEventDestroy, "cuEventDestroy_v2");
    sym(cuEventRecord, "cuEventRecord");
    sym(cuEventQuery, "cuEventQuery");
    sym(cuEventSynchronize, "cuEventSynchronize");
    sym(cuMemAlloc, "cuMemAlloc_v2");
    sym(cuMemFree, "cuMemFree_v2");
    sym(cuMemHostAlloc, "cuMemHostAlloc");
    sym(cuMemFreeHost, "cuMemFreeHost");
    sym(cuMemHostRegister, "cuMemHostRegister_v2");
    sym(cuMemHostUnregister, "cuMemHostUnregister");
    sym(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2");
    sym(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
    sym(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
    sym(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
    sym(cuMemsetD8Async, "cuMemsetD8Async");
    sym(cuPointerGetAttribute, "cuPointerGetAttribute");
    sym(cuStreamBeginCapture, "cuStreamBeginCapture_v2");
    sym(cuStreamEndCapture, "cuStreamEndCapture");
    sym(cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags");
    sym(cuGraphLaunch, "cuGraphLaunch");
    sym(cuGraphDestroy, "cuGraphDestroy");
    sym(cuGraphExecDestroy, "cuGraphExecDestroy");
    check(cuInit(0), "cuInit");
  }
};

// Makes the primary context of a device current on the calling thread (the one CuPy and
// the runtime API use, so device pointers from either are valid here). Cheap: call it at
// the start of every operation from a thread that may not have it current.
class Device {
 public:
  explicit Device(int ordinal) : ordinal_(ordinal) {
    const Driver& d = Driver::get();
    int count = 0;
    d.check(d.cuDeviceGetCount(&count), "cuDeviceGetCount");
    if (ordinal < 0 || ordinal >= count) {
      throw CudaError("no CUDA device " + std::to_string(ordinal) + " (" + std::to_string(count) +
                      " here)");
    }
    d.check(d.cuDeviceGet(&dev_, ordinal), "cuDeviceGet");
    d.check(d.cuDevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
  }
  ~Device() {
    if (ctx_ != nullptr) Driver::get().cuDevicePrimaryCtxRelease(dev_);
  }
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  void make_current() const {
    const Driver& d = Driver::get();
    CUcontext cur = nullptr;
    d.cuCtxGetCurrent(&cur);
    if (cur != ctx_) d.check(d.cuCtxSetCurrent(ctx_), "cuCtxSetCurrent");
  }
  int attribute(int which) const {
    int v = 0;
    Driver::get().check(Driver::get().cuDeviceGetAttribute(&v, which, dev_),
                        "cuDeviceGetAttribute");
    return v;
  }
  int ordinal() const { return ordinal_; }
  int multiprocessors() const { return attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT); }
  // Compute capability as major * 10 + minor (90 for an H100/H200).
  int compute_capability() const {
    return attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR) * 10 +
           attribute(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
  }

 private:
  int ordinal_;
  CUdevice dev_ = 0;
  CUcontext ctx_ = nullptr;
};

// Whether [p, p + bytes) is page-locked host memory the device can copy from or to
// asynchronously (cuMemHostAlloc or registered): checked at p.
inline bool is_pinned(const void* p) {
  const Driver& d = Driver::get();
  unsigned type = 0;
  const CUresult r = d.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                                             reinterpret_cast<CUdeviceptr>(p));
  return r == CUDA_SUCCESS && type == CU_MEMORYTYPE_HOST;
}

}  // namespace cuda
}  // namespace triton_rec
