// DLRM's dot interaction (HugeCTR's Interaction layer), natively: per row r, the bottom
// MLP's output m (mlp + r * dim) and the row's `slots` embeddings (slot k at
// emb[k].base + r * emb[k].stride: one [rows, slots, dim] array, or the tables' own
// arrays where the executor skips the Concat before the interaction) are the n = slots + 1
// vectors z_0 = m, z_1, ...; out (+ r * width) gets m, then z_i . z_j for i > j in (i, j)
// order, then a zero (the padding element).
//
// One row at a time, SIMD along the vectors' dimension: a block of I vectors z_i by J
// vectors z_j keeps I x J sums of SIMD lanes in registers while the dimension runs (each
// z_i loaded once per step for J products), then each sum's lanes are added in a fixed
// tree and the dimension's last dim % lanes elements in order. The row's vectors are read
// where they are (13 KB for DLRM's 27 x 128: in L1), with no transposition; the kernel
// that ran SIMD across rows spent more than half its time transposing them in and out.
// Every row is computed the same way whatever the batch, so a sample's answer does not
// depend on its batch. Compiled for AVX-512, AVX2 + FMA and the x86-64 baseline; the
// CPU's widest is used (interaction_kernels()).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "gemm.hpp"

namespace triton_rec {

// Where each row's embedding of one slot lies: base + row * stride.
struct SlotSource {
  const float* base;
  int64_t stride;
};

// The sources of a [rows, slots, dim] array's slots.
inline void contiguous_slots(const float* emb, int64_t slots, int64_t dim, SlotSource* out) {
  for (int64_t k = 0; k < slots; ++k) out[k] = {emb + k * dim, slots * dim};
}

namespace interaction_detail {

template <class V>
constexpr int kLanes = static_cast<int>(sizeof(V) / sizeof(float));

// The lanes of v added in a fixed tree: the upper half onto the lower, until one lane
// (a 256-bit sum is one 128-bit add and two shuffles, not a chain of scalar adds).
__attribute__((always_inline)) inline float lane_sum(F4 v) {
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2);
  return v[0];
}
__attribute__((always_inline)) inline float lane_sum(F8 v) {
  return lane_sum(
      F4(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7)));
}
__attribute__((always_inline)) inline float lane_sum(F16 v) {
  return lane_sum(F8(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)));
}

// The dot products of one row's n vectors z[k] into dots, pair (i, j) at
// i * (i - 1) / 2 + j.
template <class V, int I, int J>
__attribute__((always_inline)) inline void row_dots(int64_t dim, int64_t n, const float* const* zs,
                                                    float* dots) {
  constexpr int L = kLanes<V>;
  const int64_t whole = dim / L * L;
  auto z = [&](int64_t k) { return zs[k]; };
  for (int64_t i0 = 1; i0 < n; i0 += I) {
    const int64_t j_end = std::min<int64_t>(i0 + I - 1, n - 1);  // j < i <= i0 + I - 1
    const float* zi[I];
#pragma GCC unroll 8
    for (int b = 0; b < I; ++b) zi[b] = z(std::min<int64_t>(i0 + b, n - 1));  // past n: unused
    for (int64_t j0 = 0; j0 < j_end; j0 += J) {
      const float* zj[J];
#pragma GCC unroll 8
      for (int c = 0; c < J; ++c) zj[c] = z(std::min<int64_t>(j0 + c, n - 1));
      V acc[I][J] = {};
      for (int64_t d = 0; d < whole; d += L) {
        V vj[J];
#pragma GCC unroll 8
        for (int c = 0; c < J; ++c) std::memcpy(&vj[c], zj[c] + d, sizeof(V));
#pragma GCC unroll 8
        for (int b = 0; b < I; ++b) {
          V vi;
          std::memcpy(&vi, zi[b] + d, sizeof(V));
#pragma GCC unroll 8
          for (int c = 0; c < J; ++c) acc[b][c] += vi * vj[c];
        }
      }
#pragma GCC unroll 8
      for (int b = 0; b < I; ++b) {
        const int64_t i = i0 + b;
#pragma GCC unroll 8
        for (int c = 0; c < J; ++c) {
          const int64_t j = j0 + c;
          if (i >= n || j >= i) continue;
          float s = lane_sum(acc[b][c]);
          for (int64_t d = whole; d < dim; ++d) s += zi[b][d] * zj[c][d];
          dots[i * (i - 1) / 2 + j] = s;
        }
      }
    }
  }
}

template <class V, int I, int J>
__attribute__((always_inline)) inline void rows_of(int64_t rows, int64_t dim, int64_t slots,
                                                   int64_t width, const float* mlp,
                                                   const SlotSource* emb, float* out) {
  const int64_t n = slots + 1, pairs = n * (n - 1) / 2;
  thread_local std::vector<const float*> zs;  // the row's vectors
  zs.resize(static_cast<size_t>(n));
  for (int64_t r = 0; r < rows; ++r) {
    const float* m = mlp + r * dim;
    zs[0] = m;
    for (int64_t k = 0; k < slots; ++k)
      zs[static_cast<size_t>(k + 1)] = emb[k].base + r * emb[k].stride;
    float* y = out + r * width;
    std::memcpy(y, m, sizeof(float) * static_cast<size_t>(dim));
    row_dots<V, I, J>(dim, n, zs.data(), y + dim);
    y[dim + pairs] = 0.0f;
  }
}

}  // namespace interaction_detail

// rows, dim, slots, width (floats per output row), mlp [rows, dim], emb (one source per
// slot), out [rows, width].
using InteractionFn = void (*)(int64_t, int64_t, int64_t, int64_t, const float*, const SlotSource*,
                               float*);

#if defined(__GNUC__) && defined(__x86_64__)
// 4 x 6 sums with AVX-512 (24 of 32 registers), 4 x 3 with 16 registers
__attribute__((target("avx512f"))) inline void interaction_avx512(int64_t rows, int64_t dim,
                                                                  int64_t slots, int64_t width,
                                                                  const float* mlp,
                                                                  const SlotSource* emb,
                                                                  float* out) {
  interaction_detail::rows_of<F16, 4, 6>(rows, dim, slots, width, mlp, emb, out);
}
__attribute__((target("avx2,fma"))) inline void interaction_avx2(int64_t rows, int64_t dim,
                                                                 int64_t slots, int64_t width,
                                                                 const float* mlp,
                                                                 const SlotSource* emb,
                                                                 float* out) {
  interaction_detail::rows_of<F8, 4, 3>(rows, dim, slots, width, mlp, emb, out);
}
#endif
inline void interaction_base(int64_t rows, int64_t dim, int64_t slots, int64_t width,
                             const float* mlp, const SlotSource* emb, float* out) {
  interaction_detail::rows_of<F4, 4, 3>(rows, dim, slots, width, mlp, emb, out);
}

struct InteractionKernel {
  const char* name;  // as tests name it
  InteractionFn fn;
};

// The kernels this CPU runs, the widest first (looked up once per process).
inline const std::vector<InteractionKernel>& interaction_kernels() {
  static const std::vector<InteractionKernel> k = [] {
    std::vector<InteractionKernel> v;
#if defined(__GNUC__) && defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f")) v.push_back({"avx512", interaction_avx512});
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      v.push_back({"avx2", interaction_avx2});
    }
#endif
    v.push_back({"base", interaction_base});
    return v;
  }();
  return k;
}

// DLRM's interaction of `rows` rows with the CPU's widest kernel.
inline void interaction_rows(int64_t rows, int64_t dim, int64_t slots, int64_t width,
                             const float* mlp, const SlotSource* emb, float* out) {
  interaction_kernels().front().fn(rows, dim, slots, width, mlp, emb, out);
}

}  // namespace triton_rec
