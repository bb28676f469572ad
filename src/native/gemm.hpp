// The matrix products of the native dense executor (dense_net.hpp), against weights
// packed once when the network is loaded: y [m, n] = act(x [m, k] . W [k, n] + b), one
// thread, float32. No BLAS: the speed of a served network does not depend on which
// kernel a library we do not control picks on the node (numpy's OpenBLAS, steered by
// OPENBLAS_CORETYPE, ran the same network at 0.12x-1.02x onnxruntime).
//
// Layout: W's columns in panels of 2 SIMD vectors (16 floats with AVX2, 32 with
// AVX-512); panel p holds, for each row r of W, the panel's columns of that row side by
// side, so a product streams each panel once from front to back. The bias is kept
// beside it, padded to whole panels (zeros past n, as the panel's columns).
//
// The kernel: a tile of R rows of x by P panels keeps R x 2P sums in registers while k
// runs; each step loads the P panels' 2P vectors of row k of W, broadcasts x[i, k] for
// each of the R rows and adds their products (a fused multiply-add where the CPU has one).
// Every sum runs over k in order, starting from the bias, whatever the tile: a sample's
// answer does not depend on the batch it comes in, nor on its place in it. Rows of x
// come in blocks of kMc, columns of W in slices of kKc rows (the panel's slice stays in the
// core's caches while a block's tiles read it); a batch of 1 reads 4 panels at a time, so that
// enough independent sums hide the latency of the multiply-adds.
//
// Compiled for AVX-512, AVX2 + FMA and the x86-64 baseline (SSE2), the CPU's widest is
// picked at load (gemm_kernels()); tests run every one the CPU has against numpy.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

namespace triton_rec {

// SIMD values of 4, 8 and 16 floats and their shuffle indices (GCC/Clang vector
// extension: a zmm register with AVX-512; two ymm with AVX2, four xmm otherwise). The
// build asks for contraction (-ffp-contract=fast, CMakeLists.txt): a * b + c is one fused
// multiply-add in the functions compiled for a CPU that has one.
typedef float F4 __attribute__((vector_size(16)));
typedef float F8 __attribute__((vector_size(32)));
typedef float F16 __attribute__((vector_size(64)));
typedef int32_t I4 __attribute__((vector_size(16)));
typedef int32_t I8 __attribute__((vector_size(32)));
typedef int32_t I16 __attribute__((vector_size(64)));

class PackedMatrix;

// One compiled kernel: y [m, n] (row stride ldy) = act(x [m, k] (row stride ldx) . W + b).
using PackedGemmFn = void (*)(const PackedMatrix& w, int64_t m, const float* x, int64_t ldx,
                              bool relu, float* y, int64_t ldy);
struct GemmKernel {
  const char* name;
  PackedGemmFn fn;
  int64_t lanes;  // floats per SIMD vector; a panel is 2 vectors
};

// W [k, n] (row-major) and its bias [n] (or none: zeros), packed for one kernel.
class PackedMatrix {
 public:
  PackedMatrix(const float* w, const float* bias, int64_t k, int64_t n, const GemmKernel& kernel)
      : kernel_(&kernel), k_(k), n_(n), panel_(2 * kernel.lanes) {
    if (k <= 0 || n <= 0) throw std::invalid_argument("packed matrix: empty shape");
    panels_ = (n + panel_ - 1) / panel_;
    const int64_t padded = panels_ * panel_;
    data_ = allocate(static_cast<size_t>(k * padded + padded));
    float* p = data_.get();
    for (int64_t q = 0; q < panels_; ++q) {
      const int64_t c0 = q * panel_, width = std::min(panel_, n - c0);
      for (int64_t r = 0; r < k; ++r, p += panel_) {
        std::memcpy(p, w + r * n + c0, sizeof(float) * static_cast<size_t>(width));
        std::fill(p + width, p + panel_, 0.0f);
      }
    }
    std::fill(p, p + padded, 0.0f);  // the bias, padded
    if (bias != nullptr) std::memcpy(p, bias, sizeof(float) * static_cast<size_t>(n));
  }

  // y = act(x . W + b); relu: max(y, 0) with a NaN kept (np.maximum's rule).
  void run(int64_t m, const float* x, int64_t ldx, bool relu, float* y, int64_t ldy) const {
    if (m > 0) kernel_->fn(*this, m, x, ldx, relu, y, ldy);
  }
  void run(int64_t m, const float* x, bool relu, float* y) const { run(m, x, k_, relu, y, n_); }

  int64_t k() const { return k_; }
  int64_t n() const { return n_; }
  int64_t panels() const { return panels_; }
  int64_t panel_width() const { return panel_; }
  // Panel q's rows from r on.
  const float* panel(int64_t q, int64_t r) const { return data_.get() + (q * k_ + r) * panel_; }
  const float* bias() const { return data_.get() + panels_ * panel_ * k_; }
  const GemmKernel& kernel() const { return *kernel_; }

 private:
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  static std::unique_ptr<float, Free> allocate(size_t floats) {
    // 64-byte aligned: a panel's row is one or two whole cache lines
    void* p = std::aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return std::unique_ptr<float, Free>(static_cast<float*>(p));
  }

  const GemmKernel* kernel_;
  int64_t k_, n_, panel_, panels_ = 0;
  std::unique_ptr<float, Free> data_;
};

namespace gemm_detail {

// Rows of W per slice: a panel's slice is 64 KB with AVX2, read from L2 by a block's tiles
// (slices of 256 rows, 16 KB, in L1, ran the MLPerf DLRM's layers 5-15% slower at 64 and
// 288 rows: each slice stores and reloads every sum once more).
constexpr int64_t kKc = 1024;
constexpr int64_t kMc = 144;  // rows of x per block: up to 576 KB of x per slice

template <class V>
constexpr int kLanes = static_cast<int>(sizeof(V) / sizeof(float));

// One tile: rows [R] of x (a, stride lda) by panels [P] (b: the first panel's slice,
// the next ones `stride` floats apart) into c (stride ldc), `cols` of its 2P vectors'
// columns valid. first: the sums start from the bias (else from c); last: ReLU applies.
// prefetch (not null): the slice that the next tiles will read, one panel's row fetched
// into the cache per step (the first tile of a panel hides the next one's misses).
template <class V, int R, int P>
__attribute__((always_inline)) inline void tile(int64_t kc, const float* a, int64_t lda,
                                                const float* b, int64_t stride, const float* bias,
                                                float* c, int64_t ldc, int64_t cols, bool first,
                                                bool last, bool relu,
                                                const float* prefetch = nullptr) {
  constexpr int L = kLanes<V>, C = 2 * P, W = C * L;
  V acc[R][C];
  if (first) {
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      V v;
      std::memcpy(&v, bias + j * L, sizeof v);
#pragma GCC unroll 16
      for (int i = 0; i < R; ++i) acc[i][j] = v;
    }
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      float row[W] = {};
      std::memcpy(row, c + i * ldc, sizeof(float) * static_cast<size_t>(cols));
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) std::memcpy(&acc[i][j], row + j * L, sizeof(V));
    }
  }
  // one step of k: the P panels' 2P vectors of W's row k, each row's x[i, k] broadcast
  auto step = [&](int64_t k) __attribute__((always_inline)) {
    V w[C];
#pragma GCC unroll 8
    for (int j = 0; j < C; ++j) {
      std::memcpy(&w[j], b + (j / 2) * stride + k * 2 * L + (j % 2) * L, sizeof(V));
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
      const V x = a[i * lda + k] - V{};  // a broadcast (x - +0 is x, -0 and NaN too)
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[i][j] += x * w[j];
    }
  };
  if (prefetch != nullptr) {
    for (int64_t k = 0; k < kc; ++k) {
      // a panel's row is 2 vectors: one cache line with AVX2, two with AVX-512
#pragma GCC unroll 2
      for (int l = 0; l < 2 * L; l += 16) __builtin_prefetch(prefetch + k * 2 * L + l);
      step(k);
    }
  } else {
#pragma GCC unroll 4
    for (int64_t k = 0; k < kc; ++k) step(k);
  }
  if (last && relu) {
    const V zero = {};
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) {
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) acc[i][j] = acc[i][j] < zero ? zero : acc[i][j];
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < R; ++i) {
    if (cols == W) {
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) std::memcpy(c + i * ldc + j * L, &acc[i][j], sizeof(V));
    } else {
      float row[W];
#pragma GCC unroll 8
      for (int j = 0; j < C; ++j) std::memcpy(row + j * L, &acc[i][j], sizeof(V));
      std::memcpy(c + i * ldc, row, sizeof(float) * static_cast<size_t>(cols));
    }
  }
}

// Panels per tile for R rows: as many as keep the sums within the registers (16 vector
// registers with AVX2 or SSE, 32 with AVX-512), up to 4.
template <class V, int R>
constexpr int panels_for() {
  constexpr int regs = kLanes<V> == 16 ? 32 : 16;
  constexpr int sums = regs - 4;  // the rest: the panels' vectors and a broadcast
  constexpr int p = sums / (2 * R);
  return p < 1 ? 1 : (p > 4 ? 4 : p);
}

// R rows of x (a) against panels [q0, q1)'s slices from row k0 (kc rows), into c: P
// panels per tile, then one at a time.
template <class V, int R, int P>
__attribute__((always_inline)) inline void rows(const PackedMatrix& w, int64_t q0, int64_t q1,
                                                int64_t k0, int64_t kc, const float* a, int64_t lda,
                                                float* c, int64_t ldc, bool first, bool last,
                                                bool relu) {
  const int64_t width = w.panel_width(), n = w.n();
  const int64_t stride = w.k() * width;  // floats from one panel to the next
  const float* bias = w.bias();
  int64_t q = q0;
  for (; q + P <= q1; q += P) {
    const int64_t cols = std::min(P * width, n - q * width);
    tile<V, R, P>(kc, a, lda, w.panel(q, k0), stride, bias + q * width, c + q * width, ldc, cols,
                  first, last, relu);
  }
  for (; q < q1; ++q) {
    const int64_t cols = std::min(width, n - q * width);
    tile<V, R, 1>(kc, a, lda, w.panel(q, k0), stride, bias + q * width, c + q * width, ldc, cols,
                  first, last, relu);
  }
}

// r (< MR) rows, dispatched to rows<V, r, P>: one panel at a time (P1) or as many as fit
// in the registers (a batch smaller than a tile: no other tile reads the panels).
template <class V, int R, bool P1>
__attribute__((always_inline)) inline void rest(int64_t r, const PackedMatrix& w, int64_t q0,
                                                int64_t q1, int64_t k0, int64_t kc, const float* a,
                                                int64_t lda, float* c, int64_t ldc, bool first,
                                                bool last, bool relu) {
  if constexpr (R > 0) {
    if (r == R) {
      rows<V, R, P1 ? 1 : panels_for<V, R>()>(w, q0, q1, k0, kc, a, lda, c, ldc, first, last, relu);
    } else {
      rest<V, R - 1, P1>(r, w, q0, q1, k0, kc, a, lda, c, ldc, first, last, relu);
    }
  }
}

// The whole product: slices of W's rows, blocks of x's rows; within a block, each panel
// against the block's tiles of MR rows and then its rest (the panel's slice read from L1).
template <class V, int MR>
__attribute__((always_inline)) inline void product(const PackedMatrix& w, int64_t m, const float* x,
                                                   int64_t ldx, bool relu, float* y, int64_t ldy) {
  const int64_t k = w.k(), panels = w.panels(), width = w.panel_width(), n = w.n();
  const int64_t stride = k * width;
  if (m < MR) {  // no block reuses a slice: each panel is streamed whole, P at a time
    rest<V, MR - 1, false>(m, w, 0, panels, 0, k, x, ldx, y, ldy, true, true, relu);
    return;
  }
  for (int64_t k0 = 0; k0 < k; k0 += kKc) {
    const int64_t kc = std::min(kKc, k - k0);
    const bool first = k0 == 0, last = k0 + kc == k;
    for (int64_t m0 = 0; m0 < m; m0 += kMc) {
      const int64_t mc = std::min(kMc, m - m0), full = mc / MR * MR;
      const float* a = x + m0 * ldx + k0;
      float* c = y + m0 * ldy;
      for (int64_t q = 0; q < panels; ++q) {
        const int64_t cols = std::min(width, n - q * width);
        const float* b = w.panel(q, k0);
        // the first tile fetches the next panel's slice while it computes
        const float* next = q + 1 < panels ? w.panel(q + 1, k0) : nullptr;
        for (int64_t i = 0; i < full; i += MR) {
          tile<V, MR, 1>(kc, a + i * ldx, ldx, b, stride, w.bias() + q * width,
                         c + i * ldy + q * width, ldy, cols, first, last, relu,
                         i == 0 ? next : nullptr);
        }
        if (full < mc) {
          rest<V, MR - 1, true>(mc - full, w, q, q + 1, k0, kc, a + full * ldx, ldx, c + full * ldy,
                                ldy, first, last, relu);
        }
      }
    }
  }
}

#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target("avx512f"))) inline void product_avx512(const PackedMatrix& w, int64_t m,
                                                              const float* x, int64_t ldx,
                                                              bool relu, float* y, int64_t ldy) {
  product<F16, 12>(w, m, x, ldx, relu, y, ldy);
}
__attribute__((target("avx2,fma"))) inline void product_avx2(const PackedMatrix& w, int64_t m,
                                                             const float* x, int64_t ldx, bool relu,
                                                             float* y, int64_t ldy) {
  product<F8, 6>(w, m, x, ldx, relu, y, ldy);
}
#endif
inline void product_base(const PackedMatrix& w, int64_t m, const float* x, int64_t ldx, bool relu,
                         float* y, int64_t ldy) {
  product<F4, 6>(w, m, x, ldx, relu, y, ldy);
}

}  // namespace gemm_detail

// The kernels this CPU runs, the widest first (looked up once per process).
inline const std::vector<GemmKernel>& gemm_kernels() {
  static const std::vector<GemmKernel> k = [] {
    std::vector<GemmKernel> v;
#if defined(__GNUC__) && defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f")) v.push_back({"avx512", gemm_detail::product_avx512, 16});
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      v.push_back({"avx2", gemm_detail::product_avx2, 8});
    }
#endif
    v.push_back({"base", gemm_detail::product_base, 4});
    return v;
  }();
  return k;
}

// The kernel called `name` ("" or "auto": the widest); throws if this CPU has no such one.
inline const GemmKernel& gemm_kernel(const std::string& name = "") {
  const auto& all = gemm_kernels();
  if (name.empty() || name == "auto") return all.front();
  for (const auto& k : all) {
    if (name == k.name) return k;
  }
  throw std::invalid_argument("no gemm kernel '" + name + "' on this CPU");
}

}  // namespace triton_rec
