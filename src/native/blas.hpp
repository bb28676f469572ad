// A BLAS sgemm for the native dense executor, found among the libraries the process has
// already loaded (numpy's OpenBLAS, from its PyPI wheel: ILP64, `cblas_sgemm64_`; or any
// LP64 `cblas_sgemm`), so the native path multiplies with the same library as the numpy
// executor and the build links no BLAS. Falls back to sgemm_loops (dense_net.hpp).
#pragma once

#include <dlfcn.h>
#include <link.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "dense_net.hpp"

namespace triton_rec {

namespace blas_detail {

using Sgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t,
                         const float*, int64_t, float, float*, int64_t);
using Sgemm32 = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                         float, float*, int);
constexpr int kRowMajor = 101, kNoTrans = 111;  // CBLAS_ORDER / CBLAS_TRANSPOSE values

inline Sgemm64 g_sgemm64 = nullptr;
inline Sgemm32 g_sgemm32 = nullptr;
inline std::string g_source = "loops";

inline void sgemm64(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c) {
  g_sgemm64(kRowMajor, kNoTrans, kNoTrans, m, n, k, 1.0f, a, k, b, n, 0.0f, c, n);
}

inline void sgemm32(int64_t m, int64_t n, int64_t k, const float* a, const float* b, float* c) {
  g_sgemm32(kRowMajor, kNoTrans, kNoTrans, static_cast<int>(m), static_cast<int>(n),
            static_cast<int>(k), 1.0f, a, static_cast<int>(k), b, static_cast<int>(n), 0.0f, c,
            static_cast<int>(n));
}

inline int visit(dl_phdr_info* info, size_t, void*) {
  const char* name = info->dlpi_name;
  if (name == nullptr || std::strstr(name, "blas") == nullptr) return 0;
  void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
  if (h == nullptr) return 0;
  if (void* f = dlsym(h, "cblas_sgemm64_")) {
    g_sgemm64 = reinterpret_cast<Sgemm64>(f);
  } else if (void* g = dlsym(h, "cblas_sgemm")) {
    g_sgemm32 = reinterpret_cast<Sgemm32>(g);
  } else {
    dlclose(h);
    return 0;
  }
  g_source = name;  // the handle stays open: the library stays loaded
  return 1;
}

}  // namespace blas_detail

// The sgemm to use: a loaded BLAS if there is one (looked up once), else the loops.
inline SgemmFn find_sgemm() {
  using namespace blas_detail;
  static const SgemmFn fn = [] {
    dl_iterate_phdr(visit, nullptr);
    if (g_sgemm64 != nullptr) return static_cast<SgemmFn>(&sgemm64);
    if (g_sgemm32 != nullptr) return static_cast<SgemmFn>(&sgemm32);
    return static_cast<SgemmFn>(&sgemm_loops);
  }();
  return fn;
}

// Where find_sgemm's function comes from (a library path, or "loops").
inline const std::string& sgemm_source() {
  find_sgemm();
  return blas_detail::g_source;
}

}  // namespace triton_rec
